#pragma once
// Which KV moves from a prefill worker to a decode worker for one request,
// and under which names (docs/serving.md, "KV path"): everything past the
// tokens the decode worker holds. That is, in order:
//   - when what it holds ends inside a full chunk (it loaded tail pieces,
//     docs/kvbus.md "Tail keys"), the rest of that chunk, a "gap" named by
//     the transfer key of the request's transfer id followed by the gap's
//     first position (u64, little-endian);
//   - every full chunk after that, named by its prefix key;
//   - the prompt's partial tail past its last full chunk, named by the
//     request's transfer key.
// Each region travels as one layer slice per layer (kvbus::LayerSliceKey).
// Both ends compute the same plan from the same request. Thread-safe (pure).

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kdn/kvbus/key.h"

namespace kdn::kvbus {

struct KvRegion {
  ChunkKey parent;    // the prefix key, or a transfer key (gap, tail)
  int64_t first = 0;  // first token position
  int64_t count = 0;
  bool tail = false;  // named by a transfer key: of this request alone
};

// `prefix_keys` are the prompt's full-chunk keys (kvbus::PrefixKeys);
// `held_tokens` (the decode worker's leading tokens) is clamped to
// [0, prompt_tokens].
std::vector<KvRegion> TransferRegions(std::span<const ChunkKey> prefix_keys, int64_t prompt_tokens,
                                      int chunk_tokens, int64_t held_tokens,
                                      std::string_view transfer_id);

}  // namespace kdn::kvbus
