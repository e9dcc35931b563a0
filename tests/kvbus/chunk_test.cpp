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
ChunkInfo GoldenInfo() { return ChunkInfo{kKey, kFingerprint, 2, 1, 2, 1, KvDType::kBF16, 256}; }
std::vector<uint8_t> GoldenPayload() {
  std::vector<uint8_t> p(16);
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<uint8_t>(i);
  return p;
}
// Computed from the spec with Python's struct and xxhash, not from chunk.cpp.
const char* const kGoldenHeaderHex =
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

}  // namespace
}  // namespace kdn::kvbus
