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

TEST(KvCache, LayersInOneCallAreTheLayersOneByOne) {
  CpuKvCache cache(3, 2, 4, 4);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 40).ok());
  const size_t layer = cache.LayerBytes(21, DType::kBF16);
  std::vector<float> rows(3 * layer / 2);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = 0.5f * static_cast<float>(i % 301) - 60.0f;
  std::vector<uint8_t> in(3 * layer);
  FromFloat(DType::kBF16, rows.data(), rows.size(), in.data());
  // Layers 1 and 2 in one call, from position 7 (across blocks).
  ASSERT_TRUE(cache.WriteLayers(s, 1, 2, 7, 21, DType::kBF16,
                                std::span<const uint8_t>(in).subspan(layer, 2 * layer))
                  .ok());
  for (int l = 1; l < 3; ++l) {
    std::vector<uint8_t> one(layer);
    ASSERT_TRUE(cache.Read(s, l, 7, 21, DType::kBF16, one).ok());
    EXPECT_TRUE(std::equal(one.begin(), one.end(), in.begin() + l * layer)) << "layer " << l;
  }
  ASSERT_TRUE(cache.Write(s, 0, 7, 21, DType::kBF16, std::span<const uint8_t>(in).first(layer)).ok());
  std::vector<uint8_t> all(3 * layer);
  ASSERT_TRUE(cache.ReadLayers(s, 0, 3, 7, 21, DType::kBF16, all).ok());
  EXPECT_EQ(all, in);
  // A range past the last layer, or a buffer for another count of layers.
  EXPECT_EQ(cache.ReadLayers(s, 2, 2, 7, 21, DType::kBF16, all).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.ReadLayers(s, 0, 2, 7, 21, DType::kBF16, all).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.ReadLayers(s, 0, 0, 7, 21, DType::kBF16, {}).code(),
            StatusCode::kInvalidArgument);
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
