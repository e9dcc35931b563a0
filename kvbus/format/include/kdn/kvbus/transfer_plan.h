#pragma once
// Which KV moves from a prefill worker to a decode worker for one request,
// and under which names (docs/serving.md, "KV path"): everything past the
// tokens the decode worker holds. That is, in order:
//   - when what it holds ends inside a full chunk (it loaded tail pieces,
//     docs/kvbus.md "Tail keys"), the rest of that chunk, the "gap";
//   - every full chunk after that;
//   - the prompt's partial tail past its last full chunk.
// Each region is named for this request alone: the transfer key of the
// request's transfer id followed by the region's first position (u64,
// little-endian). Not by content: two requests prepared on one decode
// worker with one prefix each get their own slices, whatever order their
// pushes come in (docs/kvbus.md, "Transfer and layer-slice keys").
// Each region travels as one layer slice per layer (kvbus::LayerSliceKey).
// Both ends compute the same plan from the same request. Thread-safe (pure).

#include <cstdint>
#include <string_view>
#include <vector>

#include "kdn/kvbus/key.h"

namespace kdn::kvbus {

struct KvRegion {
  ChunkKey parent;    // TransferRegionKey(transfer id, first)
  int64_t first = 0;  // first token position
  int64_t count = 0;
};

// `full_chunks` is the number of the prompt's full chunks (its prefix keys;
// 0 lays the whole prompt out as one region); `held_tokens` (the decode
// worker's leading tokens) is clamped to [0, prompt_tokens].
std::vector<KvRegion> TransferRegions(int64_t full_chunks, int64_t prompt_tokens, int chunk_tokens,
                                      int64_t held_tokens, std::string_view transfer_id);

// The name of a request's region that starts at `first`:
// TransferKey(transfer_id || u64le(first)).
ChunkKey TransferRegionKey(std::string_view transfer_id, int64_t first);

}  // namespace kdn::kvbus
