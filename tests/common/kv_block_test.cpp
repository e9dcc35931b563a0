// AppendPagedRuns: the one rule for where a paged sequence's rows lie (the
// engine's KvCache::LayerRanges and kvbus::PagedSliceExtents both use it).
#include "kdn/common/kv_block.h"

#include <gtest/gtest.h>

namespace kdn {
namespace {

// Blocks of 4 rows of 10 bytes; block b at 1000 + 40 * b.
uint64_t Base(int32_t b) { return 1000 + 40 * static_cast<uint64_t>(b); }

TEST(AppendPagedRuns, StartsMidBlockAndMergesRowsThatTouch) {
  const std::vector<int32_t> blocks = {3, 4, 9};
  std::vector<ByteRange> out;
  // Positions 2..9: block 3 slots 2-3, block 4 (which follows it) whole,
  // block 9 slots 0-1.
  AppendPagedRuns(blocks, 2, 8, 4, 10, Base, &out);
  const std::vector<ByteRange> want = {{Base(3) + 20, 60}, {Base(9), 20}};
  EXPECT_EQ(out, want);
  // Appended after what `out` holds, merged with its last run where they touch.
  AppendPagedRuns(blocks, 10, 2, 4, 10, Base, &out);
  const std::vector<ByteRange> merged = {{Base(3) + 20, 60}, {Base(9), 40}};
  EXPECT_EQ(out, merged);
  // Nothing for no rows.
  AppendPagedRuns(blocks, 0, 0, 4, 10, Base, &out);
  EXPECT_EQ(out, merged);
}

TEST(AppendPagedRuns, KeepsBlocksApartThatDoNotFollowEachOther) {
  const std::vector<int32_t> blocks = {5, 2};
  std::vector<ByteRange> out;
  AppendPagedRuns(blocks, 0, 7, 4, 10, Base, &out);
  const std::vector<ByteRange> want = {{Base(5), 40}, {Base(2), 30}};
  EXPECT_EQ(out, want);
}

}  // namespace
}  // namespace kdn
