#pragma once
// The paged KV cache's block: the tokens of KV one block holds. One constant
// for every process: the decode worker's cache allocates in these blocks
// (engine::KvCache) and the router counts a request's reservation in them
// (router/placement.h), so the two must agree.

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace kdn {

inline constexpr int kKvBlockTokens = 16;

// The blocks that hold `tokens` tokens of KV.
constexpr int64_t KvBlocksFor(int64_t tokens) {
  return (tokens + kKvBlockTokens - 1) / kKvBlockTokens;
}

// Admission by what a request needs now (docs/serving.md, "Admission and
// preemption"): a decode worker takes KV for the tokens sent to it (a
// resumed request's generated ones included) and a growth margin of one
// block; its later tokens take blocks as they come, and a worker out of
// blocks preempts. A blended request takes its whole length (`sent_tokens`
// + `max_tokens` less those already generated) at once: its fused KV is
// stored under no prefix key, so it could only resume by a recompute that
// would change its tokens. The router's placement and the decode worker
// count by this one rule; the decode worker caps it at the model's context.
inline constexpr int64_t kKvGrowthTokens = kKvBlockTokens;
constexpr int64_t KvTokensAdmitted(int64_t sent_tokens, int64_t whole_tokens, bool blended) {
  return blended ? whole_tokens : std::min(sent_tokens + kKvGrowthTokens, whole_tokens);
}

// A range of bytes of a memory region: [offset, offset + bytes). A KV
// pool's layer slice (engine::KvPoolRange) and a transport's extent
// (kvbus::Extent) are lists of them.
struct ByteRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  friend bool operator==(const ByteRange&, const ByteRange&) = default;
};

// Where one layer's K (or V) rows of positions [first, first + count) of a
// paged sequence lie: the sequence's blocks are `blocks` (position p in
// blocks[p / block_tokens], slot p % block_tokens), each row `row_bytes`,
// block b's first row at block_base(b). Appends the runs to `out`, merging
// each with the one before it (out's last included) where they touch. The
// one rule for the engine's KvCache::LayerRanges and the transports'
// kvbus::PagedSliceExtents. Needs first + count <= blocks.size() *
// block_tokens.
template <typename BlockBase>
void AppendPagedRuns(std::span<const int32_t> blocks, int64_t first, int64_t count,
                     int block_tokens, uint64_t row_bytes, BlockBase block_base,
                     std::vector<ByteRange>* out) {
  for (int64_t t = first; t < first + count;) {
    const int64_t slot = t % block_tokens;
    const int64_t run = std::min<int64_t>(block_tokens - slot, first + count - t);
    const uint64_t at = static_cast<uint64_t>(block_base(blocks[t / block_tokens])) +
                        static_cast<uint64_t>(slot) * row_bytes;
    const uint64_t bytes = static_cast<uint64_t>(run) * row_bytes;
    if (!out->empty() && out->back().offset + out->back().bytes == at) {
      out->back().bytes += bytes;
    } else {
      out->push_back({at, bytes});
    }
    t += run;
  }
}

}  // namespace kdn
