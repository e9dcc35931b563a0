// SplitExtents: the host half of the device copy (kvbus/cuda, CopyExtents),
// checked against a byte-by-byte reference on random extent lists.
#include "kdn/kvbus/copy_plan.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <vector>

namespace kdn::kvbus {
namespace {

// `total` bytes cut into random extents scattered (without overlap, in a
// random order) over a region of `region` bytes.
std::vector<Extent> RandomExtents(uint64_t total, uint64_t region, std::mt19937_64& rng) {
  std::vector<uint64_t> sizes;
  for (uint64_t left = total; left > 0;) {
    const uint64_t n = std::min<uint64_t>(left, 1 + rng() % 300);
    sizes.push_back(n);
    left -= n;
  }
  // Each extent gets a slot of 512 bytes; the slots are shuffled.
  std::vector<uint64_t> slots(region / 512);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<Extent> out;
  for (size_t i = 0; i < sizes.size(); ++i) out.push_back({slots[i] * 512 + rng() % 200, sizes[i]});
  return out;
}

// The i-th byte of the concatenation of `extents`, as (offset in region).
std::vector<uint64_t> ByteOffsets(const std::vector<Extent>& extents) {
  std::vector<uint64_t> out;
  for (const Extent& e : extents)
    for (uint64_t b = 0; b < e.bytes; ++b) out.push_back(e.offset + b);
  return out;
}

TEST(SplitExtents, CutsBothListsAtEveryBoundary) {
  const std::vector<Extent> src = {{0, 10}, {100, 6}};
  const std::vector<Extent> dst = {{50, 4}, {200, 12}};
  std::vector<CopyPiece> pieces;
  ASSERT_TRUE(SplitExtents(src, dst, 0, &pieces).ok());
  const std::vector<CopyPiece> want = {{0, 50, 4}, {4, 200, 6}, {100, 206, 6}};
  EXPECT_EQ(pieces, want);
}

TEST(SplitExtents, MergesRunsThatContinueOnBothSides) {
  const std::vector<Extent> src = {{0, 8}, {8, 8}, {16, 8}};
  const std::vector<Extent> dst = {{64, 12}, {76, 12}};
  std::vector<CopyPiece> pieces;
  ASSERT_TRUE(SplitExtents(src, dst, 0, &pieces).ok());
  EXPECT_EQ(pieces, (std::vector<CopyPiece>{{0, 64, 24}}));
}

TEST(SplitExtents, CapsPiecesAtMaxPieceBytes) {
  const std::vector<Extent> src = {{0, 100}};
  const std::vector<Extent> dst = {{1000, 100}};
  std::vector<CopyPiece> pieces;
  ASSERT_TRUE(SplitExtents(src, dst, 32, &pieces).ok());
  EXPECT_EQ(pieces,
            (std::vector<CopyPiece>{{0, 1000, 32}, {32, 1032, 32}, {64, 1064, 32}, {96, 1096, 4}}));
}

TEST(SplitExtents, SkipsEmptyExtents) {
  const std::vector<Extent> src = {{0, 0}, {5, 3}, {9, 0}};
  const std::vector<Extent> dst = {{7, 0}, {0, 3}};
  std::vector<CopyPiece> pieces;
  ASSERT_TRUE(SplitExtents(src, dst, 0, &pieces).ok());
  EXPECT_EQ(pieces, (std::vector<CopyPiece>{{5, 0, 3}}));
  ASSERT_TRUE(SplitExtents({}, {}, 0, &pieces).ok());
  EXPECT_TRUE(pieces.empty());
}

TEST(SplitExtents, RefusesListsOfDifferentTotals) {
  const std::vector<Extent> src = {{0, 10}};
  const std::vector<Extent> dst = {{0, 9}};
  std::vector<CopyPiece> pieces = {{1, 2, 3}};
  const Status st = SplitExtents(src, dst, 0, &pieces);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(pieces.empty());
}

TEST(SplitExtents, RefusesAnExtentPastTwoToTheSixtyFour) {
  const std::vector<Extent> src = {{~uint64_t{0} - 2, 8}};
  const std::vector<Extent> dst = {{0, 8}};
  std::vector<CopyPiece> pieces;
  EXPECT_EQ(SplitExtents(src, dst, 0, &pieces).code(), StatusCode::kInvalidArgument);
}

TEST(PagedSliceExtents, GivesKRowsThenVRowsBlockByBlock) {
  const std::vector<int32_t> blocks = {5, 2, 3, 9};
  // 16-token blocks of 8-byte rows (128 bytes a block); 50 tokens use 3 whole
  // blocks and 2 rows of the fourth. V starts at 10,000.
  const std::vector<Extent> got = PagedSliceExtents(blocks, 50, 16, 8, 0, 10000);
  const std::vector<Extent> want = {{640, 128},   {256, 256},   {1152, 16},
                                    {10640, 128}, {10256, 256}, {11152, 16}};
  EXPECT_EQ(got, want);
  EXPECT_TRUE(PagedSliceExtents(blocks, 0, 16, 8, 0, 10000).empty());
}

TEST(CheckExtentsWithin, RefusesAnExtentThatLeavesTheRegion) {
  EXPECT_TRUE(CheckExtentsWithin(std::vector<Extent>{{0, 10}, {90, 10}}, 100, "dst").ok());
  EXPECT_EQ(CheckExtentsWithin(std::vector<Extent>{{91, 10}}, 100, "dst").code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckExtentsWithin(std::vector<Extent>{{~uint64_t{0}, 2}}, 100, "dst").code(),
            StatusCode::kInvalidArgument);
}

TEST(SplitExtents, MovesEveryByteToItsPlaceOnRandomLists) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 50; ++round) {
    const uint64_t total = 1 + rng() % 20000;
    const uint64_t region = 512 * (total + 1);
    const std::vector<Extent> src = RandomExtents(total, region, rng);
    const std::vector<Extent> dst = RandomExtents(total, region, rng);
    std::vector<CopyPiece> pieces;
    const uint64_t cap = round % 2 ? 64 : 0;
    ASSERT_TRUE(SplitExtents(src, dst, cap, &pieces).ok());
    std::vector<uint8_t> a(region), b(region, 0), want(region, 0);
    for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i * 131 + i / 251 + round);
    const std::vector<uint64_t> s = ByteOffsets(src), d = ByteOffsets(dst);
    ASSERT_EQ(s.size(), d.size());
    for (size_t i = 0; i < s.size(); ++i) want[d[i]] = a[s[i]];
    ApplyPieces(a.data(), b.data(), pieces);
    ASSERT_EQ(b, want) << "round " << round;
    uint64_t sum = 0;
    for (const CopyPiece& p : pieces) {
      if (cap) {
        EXPECT_LE(p.bytes, cap);
      }
      EXPECT_GT(p.bytes, 0u);
      sum += p.bytes;
    }
    EXPECT_EQ(sum, total);
  }
}

}  // namespace
}  // namespace kdn::kvbus
