#include "kdn/engine/kv_cache.h"

#include <gtest/gtest.h>

namespace kdn::engine {
namespace {

TEST(PagedKvCache, ReservesWholeBlocksAndGivesThemBackOnDestruction) {
  PagedKvCache cache(2, 2, 8, 10);
  {
    KvSequence s = cache.NewSequence();
    ASSERT_TRUE(cache.Reserve(s, 17).ok());
    EXPECT_EQ(s.blocks().size(), 2u);
    EXPECT_EQ(cache.free_blocks(), 8);
    ASSERT_TRUE(cache.Reserve(s, 32).ok());  // still two blocks
    EXPECT_EQ(cache.free_blocks(), 8);
  }
  EXPECT_EQ(cache.free_blocks(), 10);
}

TEST(PagedKvCache, ExhaustionIsAStatusAndChangesNothing) {
  PagedKvCache cache(1, 1, 4, 3);
  KvSequence a = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(a, 32).ok());
  KvSequence b = cache.NewSequence();
  Status st = cache.Reserve(b, 17);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(b.blocks().empty());
  EXPECT_EQ(cache.free_blocks(), 1);
}

TEST(PagedKvCache, TruncateFreesBlocksPastTheNewEnd) {
  PagedKvCache cache(1, 1, 4, 8);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 64).ok());
  cache.SetLength(s, 64);
  s.Truncate(17);
  EXPECT_EQ(s.length(), 17);
  EXPECT_EQ(s.blocks().size(), 2u);
  EXPECT_EQ(cache.free_blocks(), 6);
}

TEST(PagedKvCache, MovedSequenceOwnsItsBlocksOnce) {
  PagedKvCache cache(1, 1, 4, 4);
  KvSequence a = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(a, 20).ok());
  KvSequence b = std::move(a);
  EXPECT_TRUE(a.blocks().empty());  // NOLINT: checking the moved-from state
  EXPECT_EQ(b.blocks().size(), 2u);
  b = KvSequence();
  EXPECT_EQ(cache.free_blocks(), 4);
}

TEST(PagedKvCache, TokenSlotsOfABlockAreContiguousTokenMajor) {
  PagedKvCache cache(2, 3, 4, 2);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 16).ok());
  EXPECT_EQ(cache.KeyAt(s, 1, 5), cache.Key(1, s.blocks()[0]) + 5 * 3 * 4);
  EXPECT_EQ(cache.block_stride(), 16 * 3 * 4);
}

}  // namespace
}  // namespace kdn::engine
