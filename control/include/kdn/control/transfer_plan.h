#pragma once
// Which KV moves from a prefill worker to a decode worker for one request,
// and under which names (docs/serving.md, "KV path"): every full chunk past
// the ones the decode worker holds, named by its prefix key, and the partial
// tail past the last full chunk, named by the request's transfer key. Each
// region travels as one layer slice per layer (kvbus::LayerSliceKey).
// Both ends compute the same plan from the same request. Thread-safe (pure).

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kdn/kvbus/key.h"

namespace kdn::control {

struct KvRegion {
  kvbus::ChunkKey parent;  // the prefix key, or the transfer key for the tail
  int64_t first = 0;       // first token position
  int64_t count = 0;
  bool tail = false;       // named by the transfer key: of this request alone
};

// `prefix_keys` are the prompt's full-chunk keys (kvbus::PrefixKeys);
// `held_chunks` is clamped to [0, prefix_keys.size()].
std::vector<KvRegion> TransferRegions(std::span<const kvbus::ChunkKey> prefix_keys,
                                      int64_t prompt_tokens, int chunk_tokens, int held_chunks,
                                      std::string_view transfer_id);

}  // namespace kdn::control
