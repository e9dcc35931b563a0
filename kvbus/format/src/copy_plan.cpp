#include "kdn/kvbus/copy_plan.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

namespace kdn::kvbus {

namespace {

constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();

Status CheckEnds(std::span<const Extent> extents, const char* side) {
  for (size_t i = 0; i < extents.size(); ++i) {
    if (extents[i].bytes > kMax - extents[i].offset) {
      return InvalidArgument(std::string(side) + " extent " + std::to_string(i) +
                             " ends past 2^64");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<uint64_t> ExtentBytes(std::span<const Extent> extents) {
  uint64_t total = 0;
  for (const Extent& e : extents) {
    if (e.bytes > kMax - total) return InvalidArgument("extents total more than 2^64 bytes");
    total += e.bytes;
  }
  return total;
}

Status SplitExtents(std::span<const Extent> src, std::span<const Extent> dst,
                    uint64_t max_piece_bytes, std::vector<CopyPiece>* pieces) {
  pieces->clear();
  KDN_RETURN_IF_ERROR(CheckEnds(src, "source"));
  KDN_RETURN_IF_ERROR(CheckEnds(dst, "destination"));
  KDN_ASSIGN_OR_RETURN(const uint64_t src_total, ExtentBytes(src));
  KDN_ASSIGN_OR_RETURN(const uint64_t dst_total, ExtentBytes(dst));
  if (src_total != dst_total) {
    return InvalidArgument("source extents cover " + std::to_string(src_total) +
                           " bytes, destination extents " + std::to_string(dst_total));
  }
  const uint64_t cap = max_piece_bytes == 0 ? kMax : max_piece_bytes;
  size_t si = 0, di = 0;
  uint64_t s_used = 0, d_used = 0;  // bytes of src[si] / dst[di] already planned
  while (si < src.size() && di < dst.size()) {
    if (src[si].bytes == s_used) {
      ++si, s_used = 0;
      continue;
    }
    if (dst[di].bytes == d_used) {
      ++di, d_used = 0;
      continue;
    }
    const uint64_t s_off = src[si].offset + s_used;
    const uint64_t d_off = dst[di].offset + d_used;
    uint64_t n = std::min(src[si].bytes - s_used, dst[di].bytes - d_used);
    if (!pieces->empty()) {
      CopyPiece& last = pieces->back();
      if (last.src_offset + last.bytes == s_off && last.dst_offset + last.bytes == d_off &&
          last.bytes < cap) {
        const uint64_t grow = std::min(n, cap - last.bytes);
        last.bytes += grow;
        s_used += grow, d_used += grow;
        continue;
      }
    }
    n = std::min(n, cap);
    pieces->push_back({s_off, d_off, n});
    s_used += n, d_used += n;
  }
  return Status::Ok();
}

std::vector<Extent> PagedSliceExtents(std::span<const int32_t> blocks, int64_t tokens,
                                      int block_tokens, uint64_t row_bytes, uint64_t k_offset,
                                      uint64_t v_offset) {
  std::vector<Extent> out;
  const uint64_t block_bytes = static_cast<uint64_t>(block_tokens) * row_bytes;
  tokens = std::min<int64_t>(tokens, static_cast<int64_t>(blocks.size()) * block_tokens);
  for (const uint64_t base : {k_offset, v_offset}) {
    AppendPagedRuns(
        blocks, 0, tokens, block_tokens, row_bytes,
        [&](int32_t block) { return base + static_cast<uint64_t>(block) * block_bytes; }, &out);
  }
  return out;
}

Status CheckExtentsWithin(std::span<const Extent> extents, uint64_t bytes, const char* what) {
  for (size_t i = 0; i < extents.size(); ++i) {
    const Extent& e = extents[i];
    if (e.offset > bytes || e.bytes > bytes - e.offset) {
      return InvalidArgument(std::string(what) + " extent " + std::to_string(i) + " [" +
                             std::to_string(e.offset) + ", +" + std::to_string(e.bytes) +
                             ") leaves the region of " + std::to_string(bytes) + " bytes");
    }
  }
  return Status::Ok();
}

void ApplyPieces(const uint8_t* src_base, uint8_t* dst_base, std::span<const CopyPiece> pieces) {
  for (const CopyPiece& p : pieces)
    std::memcpy(dst_base + p.dst_offset, src_base + p.src_offset, p.bytes);
}

}  // namespace kdn::kvbus
