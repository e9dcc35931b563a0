#pragma once
// Per-head pruned KV (docs/kvbus.md, "Per-head kept tokens") between a chunk
// and the engine: what prune::CompactKv makes of a text whose layers and KV
// heads kept tokens of their own (prune::Granularity kLayer, kHead or
// kGlobal) is stored as a chunk holding only each head's kept KV, and read
// back into the sequence CompactKv made: slot j of layer l's KV head h holds
// that head's j-th kept token, the slots past its count are holes
// (engine::KvSequence::SetHeadTokens), and the next position is the text's
// length. Thread-safe as the cache is (kdn/kvbridge/paged_chunks.h).

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kdn/common/dtype.h"
#include "kdn/common/status.h"
#include "kdn/engine/kv_cache.h"
#include "kdn/kvbus/chunk.h"

namespace kdn::kvbridge {

// The chunk of `seq`, a text of `logical` tokens computed from position 0
// and compacted per head: `counts` ([layer][kv_head]) and `positions` (each
// head's kept offsets, head after head) as kvbus::ChunkInfo::SetHeadKept
// takes them. INVALID_ARGUMENT when `seq` is not that: its slots not the
// largest count, its next position not `logical`, a head's holes not
// starting at its count.
Result<std::shared_ptr<const kvbus::Chunk>> HeadPrunedChunkFromPagedKv(
    const engine::KvCache& cache, const engine::KvSequence& seq, uint32_t logical,
    std::vector<uint32_t> counts, std::vector<uint32_t> positions, const kvbus::ChunkKey& key,
    const kvbus::ChunkKey& model_fingerprint, kdn::DType dtype);

// Loads a per-head chunk into `seq`, an empty sequence of `cache`: its
// `tokens` slots, each head's kept KV in its first slots and holes after,
// and the next position the chunk's position plus its text's length.
// INVALID_ARGUMENT for a chunk that is not per-head pruned or not of the
// cache's shape; RESOURCE_EXHAUSTED without room (seq then empty).
Status HeadPrunedChunkToPagedKv(const kvbus::Chunk& chunk, engine::KvCache& cache,
                                engine::KvSequence& seq);

// A per-head chunk where every head's tokens share slots (a blend's fused
// prompt: kdn/blend/blend.h): one slot per offset some layer's KV head
// kept, ascending (HeadPrunedSlots), a head that did not keep a slot's
// token leaving a hole there (HeadPrunedHoles: [layer][kv_head][slot], 1
// for a hole, as engine::KvSequence::SetHoles takes them for a sequence of
// these slots alone). HeadPrunedLayerToSlots writes layer `layer` of the
// chunk into slots [first, first + slots.size()) of `seq` (reserved): slot
// i holds the token at offset slots[i] in each head that kept it, zeros in
// the others. INVALID_ARGUMENT for a chunk not per-head pruned, not of the
// cache's shape, or slots that are not the chunk's.
std::vector<uint32_t> HeadPrunedSlots(const kvbus::ChunkInfo& info);
std::vector<uint8_t> HeadPrunedHoles(const kvbus::ChunkInfo& info, std::span<const uint32_t> slots);
Status HeadPrunedLayerToSlots(const kvbus::Chunk& chunk, int layer, std::span<const uint32_t> slots,
                              engine::KvCache& cache, engine::KvSequence& seq, int64_t first);

// A sequence's holes over its first `slots` slots as bits, bit
// (layer * kv_heads + kv_head) * slots + slot set for a hole, little-endian
// within each byte: what a prefill worker sends with the KV of a blend over
// a document pruned per head (PrefillReply.kv_holes); empty when it has
// none there. UnpackHoles sets them on `seq` (at least `slots` long):
// INVALID_ARGUMENT for bits of another size.
std::string PackHoles(const engine::KvCache& cache, const engine::KvSequence& seq, int64_t slots);
Status UnpackHoles(std::string_view bits, int64_t slots, const engine::KvCache& cache,
                   engine::KvSequence& seq);

}  // namespace kdn::kvbridge
