// The bridge between chunks and an engine's paged KV (kvbridge/paged_chunks.h).
#include "kdn/kvbridge/paged_chunks.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kdn/testing/tiny_model.h"
#include "kdn/engine/cpu_engine.h"
#include "kdn/engine/tensor.h"
#include "kdn/kvbus/codec.h"

namespace kdn::kvbridge {
namespace {

using kdn::DType;
using kvbus::Chunk;
using kvbus::ChunkInfo;
using kvbus::ChunkKey;

constexpr ChunkKey kKey{0x0011223344556677ull, 0x8899aabbccddeeffull};
constexpr ChunkKey kFingerprint{0x0123456789abcdefull, 0xfedcba9876543210ull};

// A cache whose every float says where it is: layer, K or V, block, slot,
// head, dim, so a misplaced copy cannot go unnoticed.
float Marker(int layer, int kv, int64_t block, int64_t slot, int64_t i) {
  return static_cast<float>(layer * 1000000 + kv * 500000 + block * 10000 + slot * 100 + i) *
             0.001f +
         0.123f;
}

void FillCache(engine::CpuKvCache& cache) {
  const int64_t stride = cache.token_stride();
  for (int l = 0; l < cache.num_layers(); ++l) {
    for (int32_t b = 0; b < cache.num_blocks(); ++b) {
      for (int64_t s = 0; s < engine::kKvBlockTokens; ++s) {
        for (int64_t i = 0; i < stride; ++i) {
          cache.Key(l, b)[s * stride + i] = Marker(l, 0, b, s, i);
          cache.Value(l, b)[s * stride + i] = -Marker(l, 1, b, s, i);
        }
      }
    }
  }
}

float RoundTrip(DType t, float x) {
  const engine::DType e = t == DType::kF16    ? engine::DType::kF16
                          : t == DType::kBF16 ? engine::DType::kBF16
                                              : engine::DType::kF32;
  uint8_t buf[4];
  float y;
  engine::FromFloat(e, &x, 1, buf);
  engine::ToFloat(e, buf, 1, &y);
  return y;
}

// The relative error bound of one rounding to nearest, 2^-p for p significant
// bits: bf16 has 8, f16 11 (for normal numbers), f32 is not rounded at all.
double Unit(DType t) { return t == DType::kBF16 ? 0x1p-8 : t == DType::kF16 ? 0x1p-11 : 0.0; }

TEST(ChunkFromPagedKv, PayloadIsLayerMajorKThenVTokenHeadDim) {
  engine::CpuKvCache cache(2, 2, 3, 4);
  FillCache(cache);
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 40).ok());
  cache.SetLength(seq, 40);
  auto c = ChunkFromPagedKv(cache, seq, 13, 5, kKey, kFingerprint, DType::kF32);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const ChunkInfo& info = (*c)->info();
  EXPECT_EQ(info.layers, 2u);
  EXPECT_EQ(info.kv_heads, 2u);
  EXPECT_EQ(info.head_dim, 3u);
  EXPECT_EQ(info.tokens, 5u);
  EXPECT_EQ(info.position, 13);
  EXPECT_EQ(info.key, kKey);
  EXPECT_EQ(info.model_fingerprint, kFingerprint);
  ASSERT_EQ((*c)->payload().size(), 2u * 2 * 5 * 2 * 3 * 4);
  std::vector<float> p((*c)->payload().size() / 4);
  std::memcpy(p.data(), (*c)->payload().data(), (*c)->payload().size());  // little-endian host
  size_t n = 0;
  for (int l = 0; l < 2; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      for (int64_t t = 13; t < 18; ++t) {
        for (int h = 0; h < 2; ++h) {
          for (int d = 0; d < 3; ++d) {
            const int64_t b = seq.blocks()[t / engine::kKvBlockTokens];
            const float want =
                (kv == 0 ? 1.0f : -1.0f) * Marker(l, kv, b, t % engine::kKvBlockTokens, h * 3 + d);
            ASSERT_EQ(p[n++], want) << "layer " << l << " kv " << kv << " token " << t;
          }
        }
      }
    }
  }
}

TEST(ChunkFromPagedKv, RefusesTokensOutsideTheSequence) {
  engine::CpuKvCache cache(1, 1, 4, 4);
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 32).ok());
  cache.SetLength(seq, 20);  // reserved 32, holds 20
  const auto code = [&](int64_t first, int64_t count) {
    return ChunkFromPagedKv(cache, seq, first, count, kKey, kFingerprint, DType::kF32)
        .status()
        .code();
  };
  EXPECT_EQ(code(0, 20), StatusCode::kOk);
  EXPECT_EQ(code(0, 21), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(16, 5), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(-1, 4), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(4, 0), StatusCode::kInvalidArgument);
}

class ChunkPagedKvRoundTrip : public ::testing::TestWithParam<DType> {};

TEST_P(ChunkPagedKvRoundTrip, GivesBackTheKvAtTheSamePositionsInAnotherSequence) {
  const DType dtype = GetParam();
  engine::CpuKvCache cache(3, 2, 8, 16);
  FillCache(cache);
  engine::KvSequence src = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(src, 60).ok());
  cache.SetLength(src, 60);
  engine::KvSequence dst = cache.NewSequence();  // different blocks, same positions
  ASSERT_TRUE(cache.Reserve(dst, 60).ok());
  for (int l = 0; l < 3; ++l) {
    for (int64_t t = 0; t < 60; ++t) {
      std::fill_n(cache.KeyAt(dst, l, t), cache.token_stride(), 7.0f);
      std::fill_n(cache.ValueAt(dst, l, t), cache.token_stride(), 7.0f);
    }
  }
  // Crosses two block boundaries and starts mid-block.
  const int64_t first = 9, count = 35;
  auto c = ChunkFromPagedKv(cache, src, first, count, kKey, kFingerprint, dtype);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ((*c)->size(), Chunk::kHeaderBytes + 3u * 2 * 35 * 16 * DTypeSize(dtype));
  // Through the bytes, as a reader elsewhere would get them.
  auto parsed = Chunk::Parse(std::vector<uint8_t>((*c)->bytes().begin(), (*c)->bytes().end()));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_TRUE(ChunkToPagedKv(**parsed, cache, dst, first).ok());
  EXPECT_EQ(dst.length(), 0);  // ChunkToPagedKv leaves the length to the caller

  for (int l = 0; l < 3; ++l) {
    for (int64_t t = 0; t < 60; ++t) {
      const float* kd = cache.KeyAt(dst, l, t);
      const float* vd = cache.ValueAt(dst, l, t);
      const float* ks = cache.KeyAt(src, l, t);
      const float* vs = cache.ValueAt(src, l, t);
      for (int64_t i = 0; i < cache.token_stride(); ++i) {
        if (t < first || t >= first + count) {
          ASSERT_EQ(kd[i], 7.0f) << "layer " << l << " token " << t << " was written";
          ASSERT_EQ(vd[i], 7.0f) << "layer " << l << " token " << t << " was written";
          continue;
        }
        // Exactly what one rounding to the chunk's dtype gives ...
        ASSERT_EQ(kd[i], RoundTrip(dtype, ks[i])) << "layer " << l << " token " << t;
        ASSERT_EQ(vd[i], RoundTrip(dtype, vs[i])) << "layer " << l << " token " << t;
        // ... which is within the dtype's rounding (exact for f32).
        ASSERT_LE(std::fabs(kd[i] - ks[i]), Unit(dtype) * std::fabs(ks[i]));
        ASSERT_LE(std::fabs(vd[i] - vs[i]), Unit(dtype) * std::fabs(vs[i]));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ChunkPagedKvRoundTrip,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

class ChunkModelKv : public ::testing::TestWithParam<DType> {};

TEST_P(ChunkModelKv, RealKvRoundTripsAndContinuesThePrompt) {
  const DType dtype = GetParam();
  auto model = kdn::testing::MakeModel("tiny");
  ASSERT_NE(model, nullptr);
  engine::CpuKvCache& cache = model->kv_cache();
  const auto tokens = kdn::testing::RandomTokens(48, model->config().vocab_size, 5);

  engine::KvSequence a = cache.NewSequence();
  std::vector<float> logits_a;
  ASSERT_TRUE(model->Prefill(a, tokens, {}, &logits_a).ok());
  auto c = ChunkFromPagedKv(cache, a, 0, 32, kKey, kFingerprint, dtype);
  ASSERT_TRUE(c.ok()) << c.status().ToString();

  engine::KvSequence b = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(b, 32).ok());
  ASSERT_TRUE(ChunkToPagedKv(**c, cache, b, 0).ok());
  for (int l = 0; l < cache.num_layers(); ++l) {
    for (int64_t t = 0; t < 32; ++t) {
      for (int64_t i = 0; i < cache.token_stride(); ++i) {
        const float ka = cache.KeyAt(a, l, t)[i], va = cache.ValueAt(a, l, t)[i];
        ASSERT_EQ(cache.KeyAt(b, l, t)[i], RoundTrip(dtype, ka));
        ASSERT_EQ(cache.ValueAt(b, l, t)[i], RoundTrip(dtype, va));
      }
    }
  }

  // The loaded chunk stands in for a prefill of its tokens.
  cache.SetLength(b, 32);
  std::vector<float> logits_b;
  ASSERT_TRUE(model->Prefill(b, std::span(tokens).subspan(32), {}, &logits_b).ok());
  ASSERT_EQ(logits_b.size(), logits_a.size());
  const double err = kdn::testing::RelError(logits_b.data(), logits_a.data(), logits_a.size());
  // Measured: 0 for f32, ~3e-5 for f16, ~2e-4 for bf16.
  EXPECT_LT(err, dtype == DType::kF32 ? 1e-6 : 5e-3) << DTypeName(dtype);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ChunkModelKv,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(ChunkToPagedKv, RefusesAnEncodedChunkAndTakesItDecoded) {
  engine::CpuKvCache cache(2, 2, 3, 4);
  FillCache(cache);
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 32).ok());
  cache.SetLength(seq, 32);
  auto made = ChunkFromPagedKv(cache, seq, 0, 16, kKey, kFingerprint, DType::kF32);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  auto enc_r = kvbus::EncodeChunk(*made, *kvbus::ParseCodecLevel("lossless"));
  ASSERT_TRUE(enc_r.ok()) << enc_r.status().ToString();
  auto enc = *enc_r;
  engine::KvSequence other = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(other, 16).ok());
  const Status st = ChunkToPagedKv(*enc, cache, other, 0);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("encoded"), std::string::npos) << st.ToString();
  auto dec = kvbus::DecodeChunk(enc);
  ASSERT_TRUE(dec.ok()) << dec.status().ToString();
  EXPECT_TRUE(ChunkToPagedKv(**dec, cache, other, 0).ok());
}

TEST(ChunkToPagedKv, RefusesAChunkOfAnotherShape) {
  engine::CpuKvCache cache(2, 1, 2, 4);
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 16).ok());
  const auto code = [&](uint32_t layers, uint32_t kv_heads, uint32_t head_dim) {
    ChunkInfo info{kKey, kFingerprint, layers, kv_heads, head_dim, 1, DType::kF32, 0};
    auto c = Chunk::Make(info, std::vector<uint8_t>(info.payload_bytes()));
    EXPECT_TRUE(c.ok());
    return ChunkToPagedKv(**c, cache, seq, 0).code();
  };
  EXPECT_EQ(code(2, 1, 2), StatusCode::kOk);
  EXPECT_EQ(code(3, 1, 2), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(2, 2, 2), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(2, 1, 4), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(1, 1, 4), StatusCode::kInvalidArgument);  // same payload size, other shape
}

TEST(ChunkToPagedKv, RefusesPositionsTheSequenceHasNotReserved) {
  engine::CpuKvCache cache(1, 1, 2, 8);
  ChunkInfo info{kKey, kFingerprint, 1, 1, 2, 10, DType::kF32, 0};
  auto c = Chunk::Make(info, std::vector<uint8_t>(info.payload_bytes()));
  ASSERT_TRUE(c.ok());
  engine::KvSequence seq = cache.NewSequence();
  EXPECT_EQ(ChunkToPagedKv(**c, cache, seq, 0).code(), StatusCode::kInvalidArgument);  // nothing
  ASSERT_TRUE(cache.Reserve(seq, 20).ok());  // two whole blocks: 32 slots
  EXPECT_EQ(ChunkToPagedKv(**c, cache, seq, 22).code(), StatusCode::kOk);
  EXPECT_EQ(ChunkToPagedKv(**c, cache, seq, 23).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkToPagedKv(**c, cache, seq, -1).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kdn::kvbridge
