#pragma once
// The copy plan of a layer slice moved between two differently paged KV
// pools: the source's extents and the destination's cover the same bytes in
// the same order but are cut at other places (each side's blocks are its
// own). SplitExtents cuts both lists at every boundary of either, so each
// piece lies inside one source extent and one destination extent: what the
// device copy (kvbus/cuda, CopyExtents) runs, one piece per unit of work.
//
// Pure host code, no device needed. Thread-compatible.

#include <cstdint>
#include <span>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/region.h"

namespace kdn::kvbus {

// `bytes` bytes from source offset `src_offset` to destination offset
// `dst_offset` (offsets relative to each side's base).
struct CopyPiece {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
  friend bool operator==(const CopyPiece&, const CopyPiece&) = default;
};

// The sum of the extents' bytes; INVALID_ARGUMENT when it, or an extent's
// end, does not fit in 64 bits.
Result<uint64_t> ExtentBytes(std::span<const Extent> extents);

// Replaces *pieces with the pieces that copy `src` onto `dst` in order: the
// i-th byte of the source's concatenation lands on the i-th byte of the
// destination's. Extents of zero bytes are skipped. With max_piece_bytes > 0
// no piece is longer (a long run is cut, so that the device's units of work
// are even); 0 leaves runs whole. Adjacent pieces that continue each other
// on both sides are merged (up to max_piece_bytes). *pieces keeps its
// capacity, for reuse. INVALID_ARGUMENT (and *pieces empty) when the totals
// differ or an extent overflows.
Status SplitExtents(std::span<const Extent> src, std::span<const Extent> dst,
                    uint64_t max_piece_bytes, std::vector<CopyPiece>* pieces);

// The extents of one layer slice of a paged KV pool whose K (and V) rows are
// laid out [block][block_tokens slots][row_bytes]: the first `tokens` rows
// of the blocks `blocks` in order (the last block may be partly used), K
// rows from k_offset, then V rows from v_offset. Rows that follow each
// other in the pool give one extent (common/kv_block.h's AppendPagedRuns,
// the rule KvCache::LayerRanges follows too). Offsets in bytes from the pool's base
// (engine/cuda/src/device_kv_cache.h: one layer's K or V pool is
// [block][16][kv_heads][head_dim]). Needs tokens <= blocks.size() * block_tokens.
std::vector<Extent> PagedSliceExtents(std::span<const int32_t> blocks, int64_t tokens,
                                      int block_tokens, uint64_t row_bytes, uint64_t k_offset,
                                      uint64_t v_offset);

// INVALID_ARGUMENT (naming `what` and the extent) unless every extent lies
// in [0, bytes): the bounds check of a write into a peer's region.
Status CheckExtentsWithin(std::span<const Extent> extents, uint64_t bytes, const char* what);

// The same, host to host: applies `pieces` from src_base to dst_base with
// memcpy (the reference the device copy is tested against).
void ApplyPieces(const uint8_t* src_base, uint8_t* dst_base, std::span<const CopyPiece> pieces);

}  // namespace kdn::kvbus
