// The KV chunk object against docs/kvbus.md, "KV chunk object": the header
// bytes, the payload layout, what Parse verifies, and the copies to and from
// the engine's paged KV cache.
#include "kdn/kvbus/chunk.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "kdn/kvbus/codec.h"

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
ChunkInfo GoldenInfo() { return ChunkInfo{kKey, kFingerprint, 2, 1, 2, 1, DType::kBF16, 256}; }
std::vector<uint8_t> GoldenPayload() {
  std::vector<uint8_t> p(16);
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<uint8_t>(i);
  return p;
}
// Computed from the spec with Python's struct and xxhash, not from chunk.cpp.
const char* const kGoldenHeaderHex =
    "4b444e4348554e4b0400000002000000"   //   0: "KDNCHUNK", version 4, dtype 2 (bf16)
    "00112233445566778899aabbccddeeff"   //  16: key
    "0123456789abcdeffedcba9876543210"   //  32: model fingerprint
    "02000000010000000200000001000000"   //  48: layers, kv_heads, head_dim, tokens
    "00010000000000001000000000000000"   //  64: position 256, payload_bytes 16
    "db7017f6a6e355830000000000000000"   //  80: payload XXH3-64, codec, codec_level
    "00000000000000000000000000000000"   //  96: raw_bytes, logical_tokens, kept_kind
    "0000000000000000bcd9c6a5319e5f68";  // 112: flags, reserved, header XXH3-64 of [0, 120)
// The same chunk as version 1, as kdn wrote it before version 4.
const char* const kGoldenVersion1HeaderHex =
    "4b444e4348554e4b0100000002000000"   //   0: "KDNCHUNK", version 1, dtype 2 (bf16)
    "00112233445566778899aabbccddeeff"   //  16: key
    "0123456789abcdeffedcba9876543210"   //  32: model fingerprint
    "02000000010000000200000001000000"   //  48: layers, kv_heads, head_dim, tokens
    "00010000000000001000000000000000"   //  64: position 256, payload_bytes 16
    "db7017f6a6e355830000000000000000"   //  80: payload XXH3-64, reserved
    "00000000000000000000000000000000"   //  96: reserved
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

  // Both the version 4 header and the version 1 one kdn wrote before parse
  // to the golden chunk.
  for (const char* header : {kGoldenHeaderHex, kGoldenVersion1HeaderHex}) {
    std::vector<uint8_t> golden = FromHex(header);
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
    EXPECT_EQ(info.dtype, DType::kBF16);
    EXPECT_EQ(info.position, 256);
    EXPECT_FALSE(info.pruned());
    EXPECT_EQ(info.codec, KvCodec::kRaw);
    EXPECT_EQ(ToHex((*parsed)->payload()), "000102030405060708090a0b0c0d0e0f");
  }
}

TEST(Chunk, MakeThenParseRoundTrips) {
  ChunkInfo info{kKey, kFingerprint, 3, 2, 4, 5, DType::kF32, -7};
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
  ChunkInfo info{kKey, kFingerprint, 2, 1, 2, 3, DType::kF16, 32};
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
  EXPECT_EQ(edited(8, 2).code(), StatusCode::kCorruption);    // version 2: encoded, no codec
  EXPECT_EQ(edited(12, 0).code(), StatusCode::kCorruption);   // f32: shape implies 32 bytes
  EXPECT_EQ(edited(60, 2).code(), StatusCode::kCorruption);   // 2 tokens
  EXPECT_EQ(edited(72, 17).code(), StatusCode::kCorruption);  // payload_bytes 17
  EXPECT_EQ(edited(8, 3).code(), StatusCode::kCorruption);    // version 3: no logical length
  EXPECT_EQ(edited(112, 1).code(), StatusCode::kCorruption);  // flagged encoded, no codec
  EXPECT_EQ(edited(112, 2).code(), StatusCode::kCorruption);  // flagged pruned, no logical length
  EXPECT_EQ(edited(96, 1).code(), StatusCode::kCorruption);   // raw_bytes of a raw chunk
  EXPECT_EQ(edited(108, 1).code(), StatusCode::kCorruption);  // kept_kind of an unpruned one
  EXPECT_EQ(edited(116, 4).code(), StatusCode::kCorruption);  // a description, not flagged
  EXPECT_EQ(edited(112, 4).code(), StatusCode::kCorruption);  // flagged steering, no description
  // A version, flag, codec or dtype this kdn does not know (a newer
  // writer's) is UNIMPLEMENTED, told from damage by its code.
  const Status newer = edited(8, 5);
  EXPECT_EQ(newer.code(), StatusCode::kUnimplemented);
  EXPECT_NE(newer.message().find("format version 5"), std::string::npos) << newer.ToString();
  EXPECT_EQ(edited(88, 9).code(), StatusCode::kUnimplemented) << "codec 9";
  EXPECT_EQ(edited(112, 16).code(), StatusCode::kUnimplemented) << "flag 16";
  EXPECT_EQ(edited(112, 8).code(), StatusCode::kUnimplemented) << "per-head, not pruned";
  EXPECT_EQ(edited(112, 3).code(), StatusCode::kUnimplemented) << "encoded and pruned";
  EXPECT_EQ(edited(112, 5).code(), StatusCode::kUnimplemented) << "steering and encoded";
  EXPECT_EQ(edited(112, 6).code(), StatusCode::kUnimplemented) << "steering and pruned";
  EXPECT_EQ(edited(12, 3).code(), StatusCode::kUnimplemented) << "dtype 3 in version 4";
  // Versions 1-3 had three dtypes and no flags: anything else there is damage.
  {
    std::vector<uint8_t> v1 = FromHex(kGoldenVersion1HeaderHex);
    const auto payload = GoldenPayload();
    v1.insert(v1.end(), payload.begin(), payload.end());
    for (auto [offset, value] : {std::pair<size_t, uint8_t>{12, 3}, {112, 1}, {112, 4}}) {
      std::vector<uint8_t> b = v1;
      b[offset] = value;
      Reseal(b);
      EXPECT_EQ(Chunk::Parse(std::move(b)).status().code(), StatusCode::kCorruption)
          << "version 1, byte " << offset << " = " << int{value};
    }
  }
  // The reseal itself is right: an unchanged byte still parses.
  EXPECT_TRUE(edited(0, 'K').ok());
}

// Pruned KV: 3 tokens of KV standing for 10 tokens of text.
ChunkInfo PrunedInfo() {
  ChunkInfo info{kKey, kFingerprint, 2, 1, 2, 3, DType::kF32, 0};
  info.logical_tokens = 10;
  info.kept = {0, 4, 9};
  return info;
}

TEST(Chunk, APrunedChunkIsFlaggedPrunedAndKeepsItsPositionsAndLogicalLength) {
  std::vector<uint8_t> kv(PrunedInfo().payload_bytes());
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<uint8_t>(3 * i);
  auto c = MakeOrDie(PrunedInfo(), kv);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->bytes()[8], 4);    // format version
  EXPECT_EQ(c->bytes()[112], 2);  // flags: pruned
  EXPECT_EQ(c->size(), Chunk::kHeaderBytes + 3 * 4 + kv.size());
  EXPECT_TRUE(std::equal(c->payload().begin(), c->payload().end(), kv.begin(), kv.end()));
  auto back = Chunk::Parse(std::vector<uint8_t>(c->bytes().begin(), c->bytes().end()));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  const ChunkInfo& info = (*back)->info();
  EXPECT_TRUE(info.pruned());
  EXPECT_EQ(info.tokens, 3u);
  EXPECT_EQ(info.logical(), 10u);
  EXPECT_EQ(info.kept, (std::vector<uint32_t>{0, 4, 9}));
  EXPECT_TRUE(std::equal((*back)->payload().begin(), (*back)->payload().end(), kv.begin()));
  // The kept positions are under the payload checksum.
  std::vector<uint8_t> damaged(c->bytes().begin(), c->bytes().end());
  damaged[Chunk::kHeaderBytes + 4] ^= 1;
  EXPECT_EQ(Chunk::Parse(std::move(damaged)).status().code(), StatusCode::kCorruption);
  // The header alone says what it is; it cannot land in place or be encoded.
  auto header = Chunk::ParseHeader(c->bytes().first(Chunk::kHeaderBytes));
  ASSERT_TRUE(header.ok());
  EXPECT_EQ(header->info.logical(), 10u);
  EXPECT_EQ(header->payload_bytes, 3 * 4 + kv.size());
  EXPECT_EQ(Chunk::SealedHeader(PrunedInfo(), 0).status().code(), StatusCode::kInvalidArgument);
  ChunkInfo encoded = PrunedInfo();
  encoded.codec = KvCodec::kKvc;
  EXPECT_FALSE(Chunk::FromEncoded(encoded, std::vector<uint8_t>(200)).ok());
}

TEST(Chunk, ASteeringChunkIsFlaggedAndKeepsItsDescriptionUnderThePayloadChecksum) {
  ChunkInfo info = GoldenInfo();
  info.steering = {1, 2, 3, 4, 5, 6};
  info.steering_bytes = 6;
  auto c = MakeOrDie(info, GoldenPayload());
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->bytes()[112], 4);  // flags: steering
  EXPECT_EQ(c->bytes()[116], 6);  // the description's length
  EXPECT_EQ(c->size(), Chunk::kHeaderBytes + 6 + 16);
  EXPECT_EQ(ToHex(c->payload()), ToHex(GoldenPayload()));
  auto back = Chunk::Parse(std::vector<uint8_t>(c->bytes().begin(), c->bytes().end()));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE((*back)->info().is_steering());
  EXPECT_EQ((*back)->info().steering, info.steering);
  EXPECT_EQ(ToHex((*back)->payload()), ToHex(GoldenPayload()));
  std::vector<uint8_t> damaged(c->bytes().begin(), c->bytes().end());
  damaged[Chunk::kHeaderBytes + 2] ^= 1;
  EXPECT_EQ(Chunk::Parse(std::move(damaged)).status().code(), StatusCode::kCorruption);
  // The header alone says how long the description is; it cannot land in
  // place, be encoded or pruned, or claim a length it does not have.
  auto header = Chunk::ParseHeader(c->bytes().first(Chunk::kHeaderBytes));
  ASSERT_TRUE(header.ok());
  EXPECT_EQ(header->info.steering_bytes, 6u);
  EXPECT_EQ(header->payload_bytes, 6u + 16u);
  EXPECT_EQ(Chunk::SealedHeader(info, 0).status().code(), StatusCode::kInvalidArgument);
  ChunkInfo encoded = info;
  encoded.codec = KvCodec::kKvc;
  EXPECT_FALSE(Chunk::FromEncoded(encoded, std::vector<uint8_t>(200)).ok());
  ChunkInfo pruned = info;
  pruned.logical_tokens = 2;
  pruned.kept = {1};
  EXPECT_EQ(Chunk::Make(pruned, GoldenPayload()).status().code(), StatusCode::kInvalidArgument);
  ChunkInfo short_of = info;
  short_of.steering_bytes = 7;
  EXPECT_EQ(Chunk::Make(short_of, GoldenPayload()).status().code(), StatusCode::kInvalidArgument);
}

TEST(Chunk, MakeRefusesKeptPositionsThatDoNotFit) {
  const std::vector<uint8_t> kv(PrunedInfo().payload_bytes());
  for (std::vector<uint32_t> kept :
       {std::vector<uint32_t>{0, 4}, {0, 9, 4}, {0, 4, 10}, {1, 1, 2}}) {
    ChunkInfo info = PrunedInfo();
    info.kept = kept;
    EXPECT_EQ(Chunk::Make(info, kv).status().code(), StatusCode::kInvalidArgument);
  }
  ChunkInfo info = PrunedInfo();
  info.logical_tokens = 2;  // fewer than the tokens it holds
  EXPECT_EQ(Chunk::Make(info, kv).status().code(), StatusCode::kInvalidArgument);
  info = GoldenInfo();
  info.kept = {0};  // positions without a logical length
  EXPECT_EQ(Chunk::Make(info, GoldenPayload()).status().code(), StatusCode::kInvalidArgument);
}

// Chunks of versions 1-3 as kdn wrote them before version 4 (written once,
// by kdn at 19e6924; tests/kvbus/golden/README.md): each reads back to the
// info and KV it was written from.
std::vector<uint8_t> ReadGolden(const std::string& name) {
  std::ifstream in(std::string(KDN_GOLDEN_DIR) + "/" + name, std::ios::binary);
  EXPECT_TRUE(in.good()) << name;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
// The bytes the writer filled the KV with.
std::vector<uint8_t> CountingBytes(size_t n) {
  std::vector<uint8_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(i * 29 + 7);
  return b;
}

void ExpectInfo(const ChunkInfo& got, const ChunkInfo& want) {
  EXPECT_EQ(got.key, want.key);
  EXPECT_EQ(got.model_fingerprint, want.model_fingerprint);
  EXPECT_EQ(got.layers, want.layers);
  EXPECT_EQ(got.kv_heads, want.kv_heads);
  EXPECT_EQ(got.head_dim, want.head_dim);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.dtype, want.dtype);
  EXPECT_EQ(got.position, want.position);
  EXPECT_EQ(got.codec, want.codec);
  EXPECT_EQ(got.codec_level, want.codec_level);
  EXPECT_EQ(got.logical_tokens, want.logical_tokens);
  EXPECT_EQ(got.kept, want.kept);
}

TEST(ChunkGolden, Version1RawF16ReadsBack) {
  const std::vector<uint8_t> bytes = ReadGolden("chunk-v1-raw-f16.bin");
  ASSERT_EQ(bytes.size(), 320u);
  ASSERT_EQ(bytes[8], 1);
  auto c = Chunk::Parse(bytes);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const ChunkInfo want{kKey, kFingerprint, 2, 2, 4, 3, DType::kF16, 32};
  ExpectInfo((*c)->info(), want);
  const auto kv = CountingBytes(want.payload_bytes());
  EXPECT_TRUE(std::ranges::equal((*c)->payload(), kv));
  // Written again today it differs only in its version, flags and checksum.
  auto again = MakeOrDie(want, kv);
  ASSERT_NE(again, nullptr);
  EXPECT_TRUE(std::ranges::equal(again->payload(), (*c)->payload()));
}

TEST(ChunkGolden, Version2LosslessKvcF32DecodesBack) {
  const std::vector<uint8_t> bytes = ReadGolden("chunk-v2-kvc-lossless-f32.bin");
  ASSERT_EQ(bytes.size(), 2060u);
  ASSERT_EQ(bytes[8], 2);
  auto c = Chunk::Parse(bytes);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ChunkInfo want{kKey, kFingerprint, 3, 2, 8, 5, DType::kF32, 256};
  want.codec = KvCodec::kKvc;
  ExpectInfo((*c)->info(), want);
  auto raw = DecodeChunk(*c);
  ASSERT_TRUE(raw.ok()) << raw.status().ToString();
  std::vector<float> kv(want.payload_bytes() / 4);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<float>(int((i * 37) % 101) - 50) / 16;
  ASSERT_EQ((*raw)->payload().size(), kv.size() * 4);
  EXPECT_EQ(std::memcmp((*raw)->payload().data(), kv.data(), kv.size() * 4), 0);
}

TEST(ChunkGolden, Version3PrunedBf16ReadsBack) {
  const std::vector<uint8_t> bytes = ReadGolden("chunk-v3-pruned-bf16.bin");
  ASSERT_EQ(bytes.size(), 236u);
  ASSERT_EQ(bytes[8], 3);
  auto c = Chunk::Parse(bytes);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ChunkInfo want{kKey, kFingerprint, 2, 1, 4, 3, DType::kBF16, 64};
  want.logical_tokens = 10;
  want.kept = {0, 4, 9};
  ExpectInfo((*c)->info(), want);
  EXPECT_TRUE(std::ranges::equal((*c)->payload(), CountingBytes(want.payload_bytes())));
}

}  // namespace
}  // namespace kdn::kvbus
