#include "kdn/engine/kv_cache.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace kdn::engine {
namespace {

TEST(KvCache, ReservesWholeBlocksAndGivesThemBackOnDestruction) {
  CpuKvCache cache(2, 2, 8, 10);
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

TEST(KvCache, ExhaustionIsAStatusAndChangesNothing) {
  CpuKvCache cache(1, 1, 4, 3);
  KvSequence a = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(a, 32).ok());
  KvSequence b = cache.NewSequence();
  Status st = cache.Reserve(b, 17);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(b.blocks().empty());
  EXPECT_EQ(cache.free_blocks(), 1);
}

TEST(KvCache, TruncateFreesBlocksPastTheNewEnd) {
  CpuKvCache cache(1, 1, 4, 8);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 64).ok());
  cache.SetLength(s, 64);
  s.Truncate(17);
  EXPECT_EQ(s.length(), 17);
  EXPECT_EQ(s.blocks().size(), 2u);
  EXPECT_EQ(cache.free_blocks(), 6);
}

TEST(KvCache, MovedSequenceOwnsItsBlocksOnce) {
  CpuKvCache cache(1, 1, 4, 4);
  KvSequence a = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(a, 20).ok());
  KvSequence b = std::move(a);
  EXPECT_TRUE(a.blocks().empty());  // NOLINT: checking the moved-from state
  EXPECT_EQ(b.blocks().size(), 2u);
  b = KvSequence();
  EXPECT_EQ(cache.free_blocks(), 4);
}

TEST(KvCache, TokenSlotsOfABlockAreContiguousTokenMajor) {
  CpuKvCache cache(2, 3, 4, 2);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 16).ok());
  EXPECT_EQ(cache.KeyAt(s, 1, 5), cache.Key(1, s.blocks()[0]) + 5 * 3 * 4);
  EXPECT_EQ(cache.block_stride(), 16 * 3 * 4);
}

TEST(KvCache, ReadGivesOneLayersKRowsThenVRowsAcrossBlocks) {
  CpuKvCache cache(2, 1, 2, 4);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 40).ok());
  for (int64_t p = 0; p < 40; ++p) {
    for (int i = 0; i < 2; ++i) {
      cache.KeyAt(s, 1, p)[i] = static_cast<float>(p * 10 + i);
      cache.ValueAt(s, 1, p)[i] = -static_cast<float>(p * 10 + i);
    }
  }
  // Positions 14..18 straddle the first two blocks.
  std::vector<uint8_t> out(cache.LayerBytes(5, DType::kF32));
  ASSERT_TRUE(cache.Read(s, 1, 14, 5, DType::kF32, out).ok());
  std::vector<float> f(out.size() / 4);
  std::memcpy(f.data(), out.data(), out.size());
  for (int64_t t = 0; t < 5; ++t) {
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(f[t * 2 + i], static_cast<float>((14 + t) * 10 + i));
      EXPECT_EQ(f[10 + t * 2 + i], -static_cast<float>((14 + t) * 10 + i));
    }
  }
}

TEST(KvCache, WriteThenReadRoundTripsInBf16) {
  CpuKvCache cache(1, 2, 4, 4);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 30).ok());
  std::vector<float> rows(2 * 13 * 8);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = 0.25f * static_cast<float>(i) - 7.0f;
  std::vector<uint8_t> in(cache.LayerBytes(13, DType::kBF16));
  FromFloat(DType::kBF16, rows.data(), rows.size(), in.data());
  ASSERT_TRUE(cache.Write(s, 0, 9, 13, DType::kBF16, in).ok());
  EXPECT_EQ(s.length(), 0);  // Write leaves the length to the caller
  EXPECT_EQ(cache.KeyAt(s, 0, 9)[0], rows[0]);        // exact in bf16
  EXPECT_EQ(cache.ValueAt(s, 0, 21)[7], rows.back());  // the last V row, in the second block
  std::vector<uint8_t> back(in.size());
  ASSERT_TRUE(cache.Read(s, 0, 9, 13, DType::kBF16, back).ok());
  EXPECT_EQ(back, in);
}

TEST(KvCache, ReadAndWriteRefuseWhatTheSequenceDoesNotHold) {
  CpuKvCache cache(2, 1, 2, 4), other(2, 1, 2, 4);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 20).ok());  // two blocks: 32 positions
  std::vector<uint8_t> buf(cache.LayerBytes(4, DType::kF32));
  EXPECT_EQ(cache.Read(s, 0, 28, 4, DType::kF32, buf).code(), StatusCode::kOk);
  EXPECT_EQ(cache.Read(s, 0, 29, 4, DType::kF32, buf).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Read(s, 0, -1, 4, DType::kF32, buf).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Read(s, 2, 0, 4, DType::kF32, buf).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Read(s, 0, 0, 3, DType::kF32, buf).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Write(s, 0, 0, 4, DType::kBF16, buf).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(other.Write(s, 0, 0, 4, DType::kF32, buf).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kdn::engine
