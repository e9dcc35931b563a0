// The KV chunk object against docs/kvbus.md, "KV chunk object": the header
// bytes, the payload layout, what Parse verifies, and the copies to and from
// the engine's paged KV cache.
#include "kdn/kvbus/chunk.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "../engine/test_util.h"
#include "kdn/engine/model.h"
#include "kdn/engine/tensor.h"

namespace kdn::kvbus {
namespace {

constexpr ChunkKey kKey{0x0011223344556677ull, 0x8899aabbccddeeffull};
constexpr ChunkKey kFingerprint{0x0123456789abcdefull, 0xfedcba9876543210ull};

std::vector<uint8_t> FromHex(const std::string& hex) {
  std::vector<uint8_t> out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<uint8_t>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

std::string ToHex(std::span<const uint8_t> bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string s;
  for (uint8_t b : bytes) {
    s += kDigits[b >> 4];
    s += kDigits[b & 15];
  }
  return s;
}

// The golden chunk of docs/kvbus.md: 2 layers x 1 KV head x head_dim 2,
// 1 token, bf16, rotated for position 256, payload bytes 00 01 .. 0f.
ChunkInfo GoldenInfo() {
  return ChunkInfo{kKey, kFingerprint, 2, 1, 2, 1, KvDType::kBF16, 256};
}
std::vector<uint8_t> GoldenPayload() {
  std::vector<uint8_t> p(16);
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<uint8_t>(i);
  return p;
}
// Computed from the spec with Python's struct and xxhash, not from chunk.cpp.
const char* const kGoldenHeaderHex =
    "4b444e4348554e4b0100000002000000"  //   0: "KDNCHUNK", version 1, dtype 2 (bf16)
    "00112233445566778899aabbccddeeff"  //  16: key
    "0123456789abcdeffedcba9876543210"  //  32: model fingerprint
    "02000000010000000200000001000000"  //  48: layers, kv_heads, head_dim, tokens
    "00010000000000001000000000000000"  //  64: position 256, payload_bytes 16
    "db7017f6a6e355830000000000000000"  //  80: payload XXH3-64, reserved
    "00000000000000000000000000000000"  //  96: reserved
    "000000000000000021fff694b5bd7af7";  // 112: reserved, header XXH3-64 of [0, 120)

std::shared_ptr<const Chunk> MakeOrDie(const ChunkInfo& info, std::vector<uint8_t> payload) {
  auto c = Chunk::Make(info, std::move(payload));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : nullptr;
}

// Rewrites the header checksum after an edit, so that Parse's later checks
// (not the checksum) are what must catch the edit.
void Reseal(std::vector<uint8_t>& bytes) {
  const uint64_t sum = XXH3_64bits(bytes.data(), 120);
  for (int i = 0; i < 8; ++i) bytes[120 + i] = static_cast<uint8_t>(sum >> (8 * i));
}

TEST(Chunk, HeaderBytesMatchTheSpecsGoldenChunk) {
  auto c = MakeOrDie(GoldenInfo(), GoldenPayload());
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(c->size(), Chunk::kHeaderBytes + 16);
  EXPECT_EQ(ToHex(c->bytes().first(Chunk::kHeaderBytes)), kGoldenHeaderHex);
  EXPECT_EQ(ToHex(c->payload()), "000102030405060708090a0b0c0d0e0f");

  std::vector<uint8_t> golden = FromHex(kGoldenHeaderHex);
  const auto payload = GoldenPayload();
  golden.insert(golden.end(), payload.begin(), payload.end());
  auto parsed = Chunk::Parse(golden);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const ChunkInfo& info = (*parsed)->info();
  EXPECT_EQ(info.key, kKey);
  EXPECT_EQ(info.model_fingerprint, kFingerprint);
  EXPECT_EQ(info.layers, 2u);
  EXPECT_EQ(info.kv_heads, 1u);
  EXPECT_EQ(info.head_dim, 2u);
  EXPECT_EQ(info.tokens, 1u);
  EXPECT_EQ(info.dtype, KvDType::kBF16);
  EXPECT_EQ(info.position, 256);
}

TEST(Chunk, MakeThenParseRoundTrips) {
  ChunkInfo info{kKey, kFingerprint, 3, 2, 4, 5, KvDType::kF32, -7};
  std::vector<uint8_t> payload(info.payload_bytes());
  ASSERT_EQ(payload.size(), 3u * 2 * 5 * 2 * 4 * 4);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 31 + 1);
  auto made = MakeOrDie(info, payload);
  ASSERT_NE(made, nullptr);
  EXPECT_EQ(made->key(), kKey);
  EXPECT_TRUE(std::equal(payload.begin(), payload.end(), made->payload().begin()));

  auto parsed = Chunk::Parse(std::vector<uint8_t>(made->bytes().begin(), made->bytes().end()));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  const ChunkInfo& got = (*parsed)->info();
  EXPECT_EQ(got.key, info.key);
  EXPECT_EQ(got.model_fingerprint, info.model_fingerprint);
  EXPECT_EQ(got.layers, info.layers);
  EXPECT_EQ(got.kv_heads, info.kv_heads);
  EXPECT_EQ(got.head_dim, info.head_dim);
  EXPECT_EQ(got.tokens, info.tokens);
  EXPECT_EQ(got.dtype, info.dtype);
  EXPECT_EQ(got.position, info.position);
  EXPECT_TRUE(std::equal(made->bytes().begin(), made->bytes().end(), (*parsed)->bytes().begin(),
                         (*parsed)->bytes().end()));
}

TEST(Chunk, MakeRefusesAPayloadOfTheWrongSize) {
  const ChunkInfo info = GoldenInfo();
  for (size_t n : {0, 15, 17}) {
    auto c = Chunk::Make(info, std::vector<uint8_t>(n));
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << n;
  }
}

TEST(Chunk, EverySingleByteFlipIsCorruption) {
  ChunkInfo info{kKey, kFingerprint, 2, 1, 2, 3, KvDType::kF16, 32};
  std::vector<uint8_t> payload(info.payload_bytes());
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7);
  auto c = MakeOrDie(info, payload);
  ASSERT_NE(c, nullptr);
  const std::vector<uint8_t> good(c->bytes().begin(), c->bytes().end());
  ASSERT_EQ(good.size(), Chunk::kHeaderBytes + 48);
  for (size_t i = 0; i < good.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80, 0xff}) {
      std::vector<uint8_t> bad = good;
      bad[i] ^= mask;
      auto parsed = Chunk::Parse(std::move(bad));
      EXPECT_EQ(parsed.status().code(), StatusCode::kCorruption)
          << "byte " << i << " ^ " << int{mask} << " parsed as " << parsed.status().ToString();
    }
  }
}

TEST(Chunk, TruncatedOrPaddedBytesAreCorruption) {
  auto c = MakeOrDie(GoldenInfo(), GoldenPayload());
  ASSERT_NE(c, nullptr);
  const std::vector<uint8_t> good(c->bytes().begin(), c->bytes().end());
  for (size_t n = 0; n < good.size(); ++n) {
    auto parsed = Chunk::Parse(std::vector<uint8_t>(good.begin(), good.begin() + n));
    EXPECT_EQ(parsed.status().code(), StatusCode::kCorruption) << n << " bytes";
  }
  std::vector<uint8_t> padded = good;
  padded.push_back(0);
  EXPECT_EQ(Chunk::Parse(padded).status().code(), StatusCode::kCorruption);
}

TEST(Chunk, ParseChecksFieldsEvenUnderAValidHeaderChecksum) {
  auto c = MakeOrDie(GoldenInfo(), GoldenPayload());
  ASSERT_NE(c, nullptr);
  const std::vector<uint8_t> good(c->bytes().begin(), c->bytes().end());
  const auto edited = [&](size_t offset, uint8_t value) {
    std::vector<uint8_t> b = good;
    b[offset] = value;
    Reseal(b);
    return Chunk::Parse(std::move(b)).status();
  };
  EXPECT_EQ(edited(8, 2).code(), StatusCode::kCorruption);    // format version 2
  EXPECT_EQ(edited(12, 3).code(), StatusCode::kCorruption);   // unknown dtype
  EXPECT_EQ(edited(12, 0).code(), StatusCode::kCorruption);   // f32: shape implies 32 bytes
  EXPECT_EQ(edited(60, 2).code(), StatusCode::kCorruption);   // 2 tokens
  EXPECT_EQ(edited(72, 17).code(), StatusCode::kCorruption);  // payload_bytes 17
  // The reseal itself is right: an unchanged byte still parses.
  EXPECT_TRUE(edited(0, 'K').ok());
}

// A cache whose every float says where it is: layer, K or V, block, slot,
// head, dim, so a misplaced copy cannot go unnoticed.
float Marker(int layer, int kv, int64_t block, int64_t slot, int64_t i) {
  return static_cast<float>(layer * 1000000 + kv * 500000 + block * 10000 + slot * 100 + i) *
         0.001f + 0.123f;
}

void FillCache(engine::PagedKvCache& cache) {
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

float RoundTrip(KvDType t, float x) {
  const engine::DType e = t == KvDType::kF16    ? engine::DType::kF16
                          : t == KvDType::kBF16 ? engine::DType::kBF16
                                                : engine::DType::kF32;
  uint8_t buf[4];
  float y;
  engine::FromFloat(e, &x, 1, buf);
  engine::ToFloat(e, buf, 1, &y);
  return y;
}

// The relative error bound of one rounding to nearest, 2^-p for p significant
// bits: bf16 has 8, f16 11 (for normal numbers), f32 is not rounded at all.
double Unit(KvDType t) { return t == KvDType::kBF16 ? 0x1p-8 : t == KvDType::kF16 ? 0x1p-11 : 0.0; }

TEST(ChunkFromPagedKv, PayloadIsLayerMajorKThenVTokenHeadDim) {
  engine::PagedKvCache cache(2, 2, 3, 4);
  FillCache(cache);
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 40).ok());
  cache.SetLength(seq, 40);
  auto c = ChunkFromPagedKv(cache, seq, 13, 5, kKey, kFingerprint, KvDType::kF32);
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
            const float want = (kv == 0 ? 1.0f : -1.0f) *
                               Marker(l, kv, b, t % engine::kKvBlockTokens, h * 3 + d);
            ASSERT_EQ(p[n++], want) << "layer " << l << " kv " << kv << " token " << t;
          }
        }
      }
    }
  }
}

TEST(ChunkFromPagedKv, RefusesTokensOutsideTheSequence) {
  engine::PagedKvCache cache(1, 1, 4, 4);
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 32).ok());
  cache.SetLength(seq, 20);  // reserved 32, holds 20
  const auto code = [&](int64_t first, int64_t count) {
    return ChunkFromPagedKv(cache, seq, first, count, kKey, kFingerprint, KvDType::kF32)
        .status()
        .code();
  };
  EXPECT_EQ(code(0, 20), StatusCode::kOk);
  EXPECT_EQ(code(0, 21), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(16, 5), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(-1, 4), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(4, 0), StatusCode::kInvalidArgument);
}

class ChunkPagedKvRoundTrip : public ::testing::TestWithParam<KvDType> {};

TEST_P(ChunkPagedKvRoundTrip, GivesBackTheKvAtTheSamePositionsInAnotherSequence) {
  const KvDType dtype = GetParam();
  engine::PagedKvCache cache(3, 2, 8, 16);
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
  EXPECT_EQ((*c)->size(), Chunk::kHeaderBytes + 3u * 2 * 35 * 16 * KvDTypeSize(dtype));
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
                         ::testing::Values(KvDType::kF32, KvDType::kF16, KvDType::kBF16),
                         [](const auto& info) { return std::string(KvDTypeName(info.param)); });

class ChunkModelKv : public ::testing::TestWithParam<KvDType> {};

TEST_P(ChunkModelKv, RealKvRoundTripsAndContinuesThePrompt) {
  const KvDType dtype = GetParam();
  auto model = engine::testing::MakeModel("tiny");
  ASSERT_NE(model, nullptr);
  engine::PagedKvCache& cache = model->kv_cache();
  const auto tokens = engine::testing::RandomTokens(48, model->config().vocab_size, 5);

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
  const double err = engine::testing::RelError(logits_b.data(), logits_a.data(), logits_a.size());
  // Measured: 0 for f32, ~3e-5 for f16, ~2e-4 for bf16.
  EXPECT_LT(err, dtype == KvDType::kF32 ? 1e-6 : 5e-3) << KvDTypeName(dtype);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ChunkModelKv,
                         ::testing::Values(KvDType::kF32, KvDType::kF16, KvDType::kBF16),
                         [](const auto& info) { return std::string(KvDTypeName(info.param)); });

TEST(ChunkToPagedKv, RefusesAChunkOfAnotherShape) {
  engine::PagedKvCache cache(2, 1, 2, 4);
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 16).ok());
  const auto code = [&](uint32_t layers, uint32_t kv_heads, uint32_t head_dim) {
    ChunkInfo info{kKey, kFingerprint, layers, kv_heads, head_dim, 1, KvDType::kF32, 0};
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
  engine::PagedKvCache cache(1, 1, 2, 8);
  ChunkInfo info{kKey, kFingerprint, 1, 1, 2, 10, KvDType::kF32, 0};
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
}  // namespace kdn::kvbus
