// kvc, the KV codec (kdn/kvbus/codec.h): exact round trips at "lossless",
// the error bound of every quantized level, the header an encoded chunk
// carries, the bad input a decoder must refuse without crashing, and
// CodecTier over a tier.
#include "kdn/kvbus/codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kdn/common/half.h"
#include "kdn/kvbus/host_tier.h"

namespace kdn::kvbus {
namespace {

constexpr ChunkKey kKey{0x1111, 0x2222};
constexpr ChunkKey kModel{0x3333, 0x4444};

float Element(const Chunk& c, size_t i) {
  const uint8_t* p = c.payload().data() + i * DTypeSize(c.info().dtype);
  uint16_t h = static_cast<uint16_t>(p[0] | p[1] << 8);
  switch (c.info().dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBF16: return Bf16ToF32(h);
    case DType::kF16: return F16ToF32(h);
  }
  return 0;
}

// KV-like values: per-channel offsets of different sizes (K's outlier
// channels), a slow drift along tokens, and noise.
std::shared_ptr<const Chunk> MakeKv(DType dtype, uint32_t layers = 3, uint32_t tokens = 40,
                                    uint32_t heads = 2, uint32_t dim = 8, uint64_t seed = 1,
                                    float noise_sd = 0.05f) {
  const ChunkInfo info{kKey, kModel, layers, heads, dim, tokens, dtype, 512};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> noise(0, noise_sd);
  const uint32_t C = heads * dim;
  auto c = Chunk::Build(info, [&](uint8_t* out) {
    const int es = DTypeSize(dtype);
    for (size_t i = 0; i < size_t{layers} * 2 * tokens * C; ++i) {
      const size_t ch = i % C, t = (i / C) % tokens;
      const float v = (ch % 5 == 0 ? 6.0f : 0.5f) * std::sin(0.7f * static_cast<float>(ch)) +
                      0.3f * std::sin(0.05f * static_cast<float>(t) + static_cast<float>(ch)) +
                      noise(rng);
      if (dtype == DType::kF32) {
        std::memcpy(out + i * es, &v, 4);
      } else {
        const uint16_t h = dtype == DType::kBF16 ? F32ToBf16(v) : F32ToF16(v);
        out[i * es] = static_cast<uint8_t>(h);
        out[i * es + 1] = static_cast<uint8_t>(h >> 8);
      }
    }
  });
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return *c;
}

CodecLevel Level(const char* name) { return *ParseCodecLevel(name); }

// An encoded chunk whose stream is `stream`, sealed with valid checksums, so
// that only the decoder can find what is wrong.
std::shared_ptr<const Chunk> Forge(const ChunkInfo& info, const std::vector<uint8_t>& stream) {
  std::vector<uint8_t> bytes(Chunk::kHeaderBytes);
  bytes.insert(bytes.end(), stream.begin(), stream.end());
  return *Chunk::FromEncoded(info, std::move(bytes));
}

TEST(CodecTest, LevelsParseAndName) {
  for (const char* n : {"raw", "lossless", "q2", "q4", "q8"}) {
    auto l = ParseCodecLevel(n);
    ASSERT_TRUE(l.ok()) << n;
    EXPECT_EQ(CodecLevelName(*l), n);
  }
  for (const char* n : {"", "q1", "q9", "zstd", "Q4", "q44"}) {
    auto l = ParseCodecLevel(n);
    ASSERT_FALSE(l.ok()) << n;
    EXPECT_NE(l.status().message().find("q2 ... q8"), std::string::npos);
  }
  // Thirds of 12 layers: 0-3 get +2, 4-7 +1, 8-11 as the level; capped at 8.
  EXPECT_EQ(LayerBits(4, 0, 12), 6);
  EXPECT_EQ(LayerBits(4, 3, 12), 6);
  EXPECT_EQ(LayerBits(4, 4, 12), 5);
  EXPECT_EQ(LayerBits(4, 8, 12), 4);
  EXPECT_EQ(LayerBits(8, 0, 12), 8);
  EXPECT_EQ(LayerBits(7, 0, 12), 8);
  EXPECT_EQ(LayerBits(0, 0, 12), 0);
}

TEST(CodecTest, APrunedChunkStaysRaw) {
  const auto raw = MakeKv(DType::kF32, 3, 256);
  ChunkInfo info = raw->info();
  info.logical_tokens = 1000;
  for (uint32_t j = 0; j < info.tokens; ++j) info.kept.push_back(3 * j);
  auto pruned =
      Chunk::Make(info, std::vector<uint8_t>(raw->payload().begin(), raw->payload().end()));
  ASSERT_TRUE(pruned.ok()) << pruned.status().ToString();
  auto enc = EncodeChunk(*pruned, Level("q4"));
  ASSERT_TRUE(enc.ok());
  EXPECT_EQ(*enc, *pruned);  // the codec has no kept positions: stored as it is
}

TEST(CodecTest, LosslessIsExactForEveryDType) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    const auto raw = MakeKv(dt, 3, 256);
    auto enc = EncodeChunk(raw, Level("lossless"));
    ASSERT_TRUE(enc.ok()) << enc.status().ToString();
    EXPECT_TRUE((*enc)->encoded());
    EXPECT_LT((*enc)->payload().size(), raw->payload().size()) << DTypeName(dt);
    // Through the bytes, as a reader in another process would get it.
    auto parsed =
        Chunk::Parse(std::vector<uint8_t>((*enc)->bytes().begin(), (*enc)->bytes().end()));
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ((*parsed)->info().codec, KvCodec::kKvc);
    EXPECT_EQ((*parsed)->info().codec_level, 0u);
    auto dec = DecodeChunk(*parsed);
    ASSERT_TRUE(dec.ok()) << dec.status().ToString();
    EXPECT_FALSE((*dec)->encoded());
    EXPECT_EQ((*dec)->key(), raw->key());
    EXPECT_EQ((*dec)->info().position, raw->info().position);
    ASSERT_EQ((*dec)->size(), raw->size());
    EXPECT_EQ(std::memcmp((*dec)->bytes().data(), raw->bytes().data(), raw->size()), 0)
        << DTypeName(dt);
  }
}

TEST(CodecTest, QuantizedLevelsStayWithinHalfAStep) {
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const auto raw = MakeKv(dt, 6, 37);
    const ChunkInfo& info = raw->info();
    const uint32_t C = info.kv_heads * info.head_dim;
    for (const char* name : {"q2", "q4", "q6", "q8"}) {
      const CodecLevel level = Level(name);
      auto enc = EncodeChunk(raw, level);
      ASSERT_TRUE(enc.ok());
      auto dec = DecodeChunk(*enc);
      ASSERT_TRUE(dec.ok()) << dec.status().ToString();
      for (uint32_t plane = 0; plane < info.layers * 2; ++plane) {
        const int bits = LayerBits(level.level, plane / 2, info.layers);
        for (uint32_t c = 0; c < C; ++c) {
          float lo = INFINITY, hi = -INFINITY;
          for (uint32_t t = 0; t < info.tokens; ++t) {
            const float v = Element(*raw, (size_t{plane} * info.tokens + t) * C + c);
            lo = std::min(lo, v);
            hi = std::max(hi, v);
          }
          const float step = (hi - lo) / static_cast<float>((1 << bits) - 1);
          // Half a step, plus the rounding of a 16-bit result.
          const float mag = std::max(std::fabs(lo), std::fabs(hi));
          const float bound = step / 2 + (dt == DType::kF32 ? 1e-5f * mag : mag / 128);
          for (uint32_t t = 0; t < info.tokens; ++t) {
            const size_t i = (size_t{plane} * info.tokens + t) * C + c;
            ASSERT_LE(std::fabs(Element(**dec, i) - Element(*raw, i)), bound)
                << name << " " << DTypeName(dt) << " plane " << plane << " channel " << c;
          }
        }
      }
    }
  }
}

TEST(CodecTest, FewerBitsGiveSmallerChunks) {
  const auto raw = MakeKv(DType::kF32, 6, 256, 2, 16, 1, 0.002f);
  size_t last = raw->payload().size();
  for (const char* name : {"lossless", "q8", "q6", "q4", "q2"}) {
    auto enc = EncodeChunk(raw, Level(name));
    ASSERT_TRUE(enc.ok());
    EXPECT_LT((*enc)->payload().size(), last) << name;
    last = (*enc)->payload().size();
  }
  // Plain 8-bit quantization would be 1 byte per element: on values that
  // change slowly along the tokens, q8's anchor deltas and rANS beat it.
  EXPECT_LT((*EncodeChunk(raw, Level("q8")))->payload().size(), raw->payload().size() / 4 * 3 / 4);
}

TEST(CodecTest, NoiseIsPackedAtItsWidth) {
  // White noise: entropy coding cannot save 10%, so each plane is packed at
  // its bits (q8: one byte an element) plus 8 bytes of scale per channel.
  const ChunkInfo info{kKey, kModel, 3, 2, 16, 128, DType::kF32, 0};
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1, 1);
  auto raw = *Chunk::Build(info, [&](uint8_t* out) {
    for (size_t i = 0; i < info.payload_bytes() / 4; ++i) {
      const float v = u(rng);
      std::memcpy(out + 4 * i, &v, 4);
    }
  });
  const size_t planes = 6, channels = 32, elements = info.payload_bytes() / 4;
  auto enc = *EncodeChunk(raw, Level("q8"));
  EXPECT_EQ(enc->payload().size(), elements + planes * (2 + 8 * channels));
  auto dec = DecodeChunk(enc);
  ASSERT_TRUE(dec.ok());
  for (size_t i = 0; i < elements; ++i) {
    ASSERT_NEAR(Element(**dec, i), Element(*raw, i), 2.0 / 255 / 2 + 1e-6);
  }
  // A scale no encoder writes (here the first channel's lo, after the mode
  // and bits bytes, made NaN) is refused, even under good checksums.
  std::vector<uint8_t> stream(enc->payload().begin(), enc->payload().end());
  ASSERT_EQ(stream[0], 3);  // packed
  const float nan = NAN;
  std::memcpy(stream.data() + 2, &nan, 4);
  auto bad = DecodeChunk(Forge(enc->info(), stream));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("not finite"), std::string::npos)
      << bad.status().ToString();
}

TEST(CodecTest, ConstantValuesRoundTripAtEveryLevel) {
  // One symbol with all the probability (a byte plane or a channel that
  // never changes) is the coder's edge case.
  for (float v : {0.0f, 1.5f, -3.0f}) {
    const ChunkInfo info{kKey, kModel, 2, 1, 4, 33, DType::kF32, 0};
    auto raw = *Chunk::Build(info, [&](uint8_t* out) {
      for (size_t i = 0; i < info.payload_bytes() / 4; ++i) std::memcpy(out + 4 * i, &v, 4);
    });
    for (const char* name : {"lossless", "q8", "q4", "q2"}) {
      auto dec = DecodeChunk(*EncodeChunk(raw, Level(name)));
      ASSERT_TRUE(dec.ok()) << name << " " << v << ": " << dec.status().ToString();
      EXPECT_EQ(std::memcmp((*dec)->bytes().data(), raw->bytes().data(), raw->size()), 0) << name;
    }
  }
}

TEST(CodecTest, NonFinitePlanesAreKeptExactly) {
  const auto clean = MakeKv(DType::kF32, 2, 20);
  std::vector<float> values(clean->payload().size() / 4);
  std::memcpy(values.data(), clean->payload().data(), clean->payload().size());
  values[7] = NAN;
  values[20] = INFINITY;
  values[33] = -INFINITY;
  std::vector<uint8_t> payload(values.size() * 4);
  std::memcpy(payload.data(), values.data(), payload.size());
  auto raw = Chunk::Make(clean->info(), payload);
  ASSERT_TRUE(raw.ok());
  auto dec = DecodeChunk(*EncodeChunk(*raw, Level("q4")));
  ASSERT_TRUE(dec.ok()) << dec.status().ToString();
  // Plane 0 holds the specials and is coded losslessly.
  const size_t plane = size_t{20} * 16 * 4;
  EXPECT_EQ(std::memcmp((*dec)->payload().data(), (*raw)->payload().data(), plane), 0);
  EXPECT_TRUE(std::isnan(Element(**dec, 7)));
  // Other planes are quantized: not all exact.
  EXPECT_NE(std::memcmp((*dec)->payload().data() + plane, (*raw)->payload().data() + plane, plane),
            0);
}

TEST(CodecTest, PlanesWhoseRangeOverflowsAreKeptExactly) {
  // hi - lo past the largest float (found by the fuzzer): no step exists, so
  // the plane is coded losslessly; planes of tiny range still quantize.
  const ChunkInfo info{kKey, kModel, 1, 1, 4, 8, DType::kF32, 0};
  auto raw = *Chunk::Build(info, [&](uint8_t* out) {
    for (size_t i = 0; i < info.payload_bytes() / 4; ++i) {
      const float v = i < 32 ? (i % 2 ? 3e38f : -3e38f) : 1e-38f * static_cast<float>(i % 3);
      std::memcpy(out + 4 * i, &v, 4);
    }
  });
  auto dec = DecodeChunk(*EncodeChunk(raw, Level("q4")));
  ASSERT_TRUE(dec.ok()) << dec.status().ToString();
  EXPECT_EQ(std::memcmp((*dec)->payload().data(), raw->payload().data(), 32 * 4), 0);
  for (size_t i = 32; i < 64; ++i) EXPECT_NEAR(Element(**dec, i), Element(*raw, i), 2e-38);
}

TEST(CodecTest, RawLevelAndRawChunksPassThrough) {
  const auto raw = MakeKv(DType::kBF16);
  EXPECT_EQ(*EncodeChunk(raw, Level("raw")), raw);
  EXPECT_EQ(*DecodeChunk(raw), raw);
  auto enc = *EncodeChunk(raw, Level("q4"));
  EXPECT_EQ(*EncodeChunk(enc, Level("lossless")), enc);  // already encoded
  EXPECT_EQ(raw->bytes()[112], 0);                       // flags: a raw chunk is not marked encoded
  EXPECT_EQ(enc->bytes()[112], 1);                       // flags: encoded
}

TEST(CodecTest, DamagedStreamsFailOrDecodeToTheRightSizeNeverCrash) {
  // Smooth values (entropy-coded planes) and noise (packed planes).
  for (const char* name : {"lossless", "q4", "q8"}) {
    const auto raw = MakeKv(DType::kBF16, 2, 24, 1, 8, 7, name[1] == '8' ? 1.0f : 0.002f);
    const auto enc = *EncodeChunk(raw, Level(name));
    const std::vector<uint8_t> stream(enc->payload().begin(), enc->payload().end());
    std::mt19937 rng(42);
    auto check = [&](const std::vector<uint8_t>& s) {
      auto d = DecodeChunk(Forge(enc->info(), s));
      if (d.ok()) {
        ASSERT_EQ((*d)->size(), raw->size());
      } else {
        ASSERT_EQ(d.status().code(), StatusCode::kCorruption) << d.status().ToString();
      }
    };
    // Every truncation, and a byte too many, is refused.
    for (size_t cut = 0; cut < stream.size(); ++cut) {
      EXPECT_FALSE(DecodeChunk(Forge(enc->info(),
                                     std::vector<uint8_t>(stream.begin(), stream.begin() + cut)))
                       .ok())
          << name << " cut at " << cut;
    }
    std::vector<uint8_t> longer = stream;
    longer.push_back(0);
    EXPECT_FALSE(DecodeChunk(Forge(enc->info(), longer)).ok()) << name;
    // Changed bytes: refused, or (a value changed, which only the chunk's
    // checksum can catch) decoded to the right size; never a crash.
    for (size_t i = 0; i < stream.size(); ++i) {
      for (uint8_t flip : {0x01, 0x80, 0xff}) {
        std::vector<uint8_t> s = stream;
        s[i] ^= flip;
        check(s);
      }
    }
    for (int n = 0; n < 2000; ++n) {
      std::vector<uint8_t> s = stream;
      const int edits = 1 + static_cast<int>(rng() % 8);
      for (int e = 0; e < edits; ++e) s[rng() % s.size()] = static_cast<uint8_t>(rng());
      check(s);
    }
  }
  // Random bytes, of many sizes, never pass.
  const auto raw = MakeKv(DType::kF32, 1, 16, 1, 4);
  const auto enc = *EncodeChunk(raw, Level("q8"));
  std::mt19937 rng(3);
  for (int n = 0; n < 500; ++n) {
    std::vector<uint8_t> s(rng() % 600);
    for (uint8_t& b : s) b = static_cast<uint8_t>(rng());
    EXPECT_FALSE(DecodeChunk(Forge(enc->info(), s)).ok());
  }
}

TEST(CodecTest, HeaderCodecFieldsAreChecked) {
  const auto enc = *EncodeChunk(MakeKv(DType::kF32), Level("q4"));
  std::vector<uint8_t> bytes(enc->bytes().begin(), enc->bytes().end());
  EXPECT_EQ(bytes[88], 1);  // codec kvc
  EXPECT_EQ(bytes[92], 4);  // level
  // Any change to the codec fields breaks the header checksum.
  for (size_t at : {88u, 92u, 96u}) {
    std::vector<uint8_t> b = bytes;
    b[at] ^= 1;
    auto p = Chunk::Parse(b);
    ASSERT_FALSE(p.ok());
    EXPECT_NE(p.status().message().find("header checksum"), std::string::npos);
  }
  // A shape past kMaxDecodedBytes is refused before any memory is taken.
  ChunkInfo huge = enc->info();
  huge.tokens = 1u << 30;
  auto h =
      DecodeChunk(Forge(huge, std::vector<uint8_t>(enc->payload().begin(), enc->payload().end())));
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("MiB a chunk may hold"), std::string::npos)
      << h.status().ToString();
  // A level that cannot be is refused by the decoder even with good checksums.
  ChunkInfo bad = enc->info();
  bad.codec_level = 9;
  auto d =
      DecodeChunk(Forge(bad, std::vector<uint8_t>(enc->payload().begin(), enc->payload().end())));
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("level 9"), std::string::npos);
}

TEST(CodecTest, CodecTierEncodesOnPutAndDecodesOnGet) {
  auto inner = std::make_unique<HostTier>(64 << 20);
  HostTier* host = inner.get();
  CodecTier tier(std::move(inner), {.level = Level("lossless")});
  const auto raw = MakeKv(DType::kF32, 4, 64);
  ASSERT_TRUE(tier.Put(raw).ok());
  auto held = host->Get(kKey);
  ASSERT_TRUE(held.ok());
  EXPECT_TRUE((*held)->encoded());
  EXPECT_LT(tier.Stats().bytes, raw->size());
  auto got = tier.Get(kKey);
  ASSERT_TRUE(got.ok());
  EXPECT_FALSE((*got)->encoded());
  EXPECT_EQ(std::memcmp((*got)->bytes().data(), raw->bytes().data(), raw->size()), 0);
  const CodecStats s = tier.codec_stats();
  EXPECT_EQ(s.encoded, 1u);
  EXPECT_EQ(s.decoded, 1u);
  EXPECT_EQ(s.raw_bytes, raw->payload().size());
  EXPECT_EQ(s.encoded_bytes, (*held)->payload().size());

  // A one-token tail piece: the per-channel scales would outweigh its values,
  // so it is stored raw and not counted as encoded.
  const auto tiny = MakeKv(DType::kF32, 2, 1);
  ASSERT_LT((*EncodeChunk(tiny, Level("q8")))->size(), size_t{1} << 20);
  ASSERT_GE((*EncodeChunk(tiny, Level("q8")))->size(), tiny->size());
  CodecTier small(std::make_unique<HostTier>(64 << 20), {.level = Level("q8")});
  ASSERT_TRUE(small.Put(tiny).ok());
  EXPECT_FALSE((*small.Get(kKey))->encoded());
  EXPECT_EQ(small.codec_stats().encoded, 0u);

  // Without decode_on_get the encoded chunk comes back as it is.
  CodecTier pass(std::make_unique<HostTier>(64 << 20),
                 {.level = Level("q4"), .decode_on_get = false});
  ASSERT_TRUE(pass.Put(raw).ok());
  EXPECT_TRUE((*pass.Get(kKey))->encoded());
}

TEST(CodecTest, CodecTierTurnsAnUndecodableChunkIntoACountedMiss) {
  auto inner = std::make_unique<HostTier>(64 << 20);
  HostTier* host = inner.get();
  CodecTier tier(std::move(inner), {.level = Level("q4")});
  const auto enc = *EncodeChunk(MakeKv(DType::kF32), Level("q4"));
  std::vector<uint8_t> stream(enc->payload().begin(), enc->payload().end());
  stream.resize(stream.size() / 2);
  ASSERT_TRUE(host->Put(Forge(enc->info(), stream)).ok());
  auto got = tier.Get(kKey);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kNotFound);
  const TierStats s = tier.Stats();
  EXPECT_EQ(s.corrupt, 1u);
  EXPECT_EQ(s.hits, 0u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(tier.codec_stats().decode_errors, 1u);
}

}  // namespace
}  // namespace kdn::kvbus
