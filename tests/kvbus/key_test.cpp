// Chunk keys against docs/kvbus.md, "Chunk keys". The golden values were
// computed once from the spec with the Python xxhash package (not from this
// code), so a change to the hashed byte layout fails here; parity with the
// spec over random inputs is tests/parity/test_chunk_keys.py.
#include "kdn/kvbus/key.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>


namespace kdn::kvbus {
namespace {

constexpr ChunkKey kFingerprint{0x0123456789abcdefull, 0xfedcba9876543210ull};

std::vector<int32_t> Iota(int n, int32_t first = 0) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<std::string> Hex(const std::vector<ChunkKey>& keys) {
  std::vector<std::string> out;
  for (const ChunkKey& k : keys) out.push_back(k.ToHex());
  return out;
}

KeyContext Ctx(std::string ns = "", int chunk_tokens = 256) {
  return KeyContext{kFingerprint, std::move(ns), chunk_tokens};
}


TEST(ChunkKey, PrefixKeysMatchTheSpecsGoldenVectors) {
  // docs/kvbus.md, golden vector 1: tokens 0..599, 256 per chunk, empty
  // namespace. 600 tokens make two full chunks; the last 88 get no key.
  EXPECT_EQ(Hex(PrefixKeys(Ctx(), Iota(600))),
            (std::vector<std::string>{"c7f372821dabfc2fd853fa08da623fda",
                                      "6025feeff63c2e352687aa39f73ba3b6"}));
  // Golden vector 2: the same under namespace "tenant-a".
  EXPECT_EQ(Hex(PrefixKeys(Ctx("tenant-a"), Iota(600))),
            (std::vector<std::string>{"7118da890b978f88f9252b53ff9b2694",
                                      "66ac7c17a0a6d4e65aca03cf305a9140"}));
  // Golden vector 3: tokens 1..8, 4 per chunk.
  EXPECT_EQ(Hex(PrefixKeys(Ctx("", 4), Iota(8, 1))),
            (std::vector<std::string>{"1c8405b9e0ba4e4f6144728b6086669b",
                                      "c80d5cf42b921b68c932cfebf9f3758e"}));
}

TEST(ChunkKey, SegmentKeysMatchTheSpecsGoldenVectors) {
  EXPECT_EQ(SegmentKey(Ctx(), Iota(600)).ToHex(), "34aeb3cfd5d5e2484c43ed91b04cf25f");
  EXPECT_EQ(SegmentKey(Ctx("tenant-a"), Iota(600)).ToHex(), "9fcd4eecfd5456c305e629ba32d6d1bc");
  EXPECT_EQ(SegmentKey(Ctx(), {}).ToHex(), "d7b1dbf6593abdcf4a235926e2629dd7");
}

TEST(ChunkKey, NamespacesNeverShareKeys) {
  const auto tokens = Iota(600);
  const auto a = PrefixKeys(Ctx(), tokens);
  const auto b = PrefixKeys(Ctx("tenant-a"), tokens);
  const auto c = PrefixKeys(Ctx("tenant-b"), tokens);
  ASSERT_EQ(a.size(), 2u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NE(a[i], b[i]);
    EXPECT_NE(b[i], c[i]);
  }
  EXPECT_NE(SegmentKey(Ctx(), tokens), SegmentKey(Ctx("tenant-a"), tokens));
}

TEST(ChunkKey, NamespaceIsLengthPrefixedSoItCannotBorrowTokenBytes) {
  // Namespace "\x01\0\0\0" with tokens [2] against namespace "" with
  // tokens [1, 2]: without the length prefix both would hash the same bytes
  // (01 00 00 00 02 00 00 00) after the fingerprint.
  const std::vector<int32_t> one{2}, two{1, 2};
  EXPECT_NE(SegmentKey(Ctx(std::string("\x01\0\0\0", 4)), one), SegmentKey(Ctx(), two));
}

TEST(ChunkKey, ModelFingerprintSeparatesKeys) {
  KeyContext other = Ctx();
  other.model_fingerprint.lo ^= 1;
  EXPECT_NE(PrefixKeys(Ctx(), Iota(256)), PrefixKeys(other, Iota(256)));
  EXPECT_NE(SegmentKey(Ctx(), Iota(10)), SegmentKey(other, Iota(10)));
}

TEST(ChunkKey, SegmentKeyIsNotAPrefixKey) {
  // A one-chunk prompt and a segment of the same tokens are different objects.
  EXPECT_NE(PrefixKeys(Ctx("", 8), Iota(8))[0], SegmentKey(Ctx(), Iota(8)));
}

TEST(ChunkKey, PartialLastChunkGetsNoKey) {
  EXPECT_TRUE(PrefixKeys(Ctx(), Iota(255)).empty());
  EXPECT_EQ(PrefixKeys(Ctx(), Iota(256)).size(), 1u);
  EXPECT_EQ(PrefixKeys(Ctx(), Iota(511)).size(), 1u);
  EXPECT_EQ(PrefixKeys(Ctx(), Iota(512)).size(), 2u);
  EXPECT_TRUE(PrefixKeys(Ctx(), {}).empty());
  EXPECT_TRUE(PrefixKeys(Ctx("", 0), Iota(10)).empty());
  EXPECT_TRUE(PrefixKeys(Ctx("", -4), Iota(10)).empty());
}

TEST(ChunkKey, KeysOfAPrefixArePrefixOfTheKeys) {
  std::mt19937 rng(3);
  std::vector<int32_t> tokens(16 * 10 + 7);
  for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % (1u << 30));
  const auto all = PrefixKeys(Ctx("", 16), tokens);
  ASSERT_EQ(all.size(), 10u);
  for (size_t n = 0; n <= tokens.size(); ++n) {
    const auto part = PrefixKeys(Ctx("", 16), std::span(tokens).first(n));
    ASSERT_EQ(part.size(), n / 16);
    EXPECT_TRUE(std::equal(part.begin(), part.end(), all.begin())) << n << " tokens";
  }
}

TEST(ChunkKey, ChangingATokenChangesItsChunksKeyAndEveryLaterOne) {
  const auto tokens = Iota(16 * 6);
  const auto base = PrefixKeys(Ctx("", 16), tokens);
  for (int changed : {0, 3, 15, 40, 95}) {
    auto t = tokens;
    t[changed] += 1;
    const auto keys = PrefixKeys(Ctx("", 16), t);
    ASSERT_EQ(keys.size(), base.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      if (static_cast<int>(i) < changed / 16) {
        EXPECT_EQ(keys[i], base[i]) << "token " << changed << ", chunk " << i;
      } else {
        EXPECT_NE(keys[i], base[i]) << "token " << changed << ", chunk " << i;
      }
    }
  }
}

TEST(ChunkKey, EqualChunksAtDifferentPlacesHaveDifferentPrefixKeys) {
  // The chain: a chunk's key depends on everything before it.
  std::vector<int32_t> t(32, 7);
  const auto keys = PrefixKeys(Ctx("", 16), t);
  EXPECT_NE(keys[0], keys[1]);
}

TEST(ChunkKey, TokenIdsAreHashedAsUnsigned32Bit) {
  // The largest id a tokenizer can produce, and the bit pattern of -1.
  const std::vector<int32_t> big{0x7fffffff, 0, 1, -1};
  const std::vector<int32_t> small{0x7ffffffe, 0, 1, -1};
  EXPECT_NE(SegmentKey(Ctx(), big), SegmentKey(Ctx(), small));
}

TEST(ChunkKey, HexRoundTripsAndIsCanonicalBigEndian) {
  EXPECT_EQ(kFingerprint.ToHex(), "0123456789abcdeffedcba9876543210");
  auto k = ChunkKey::FromHex("0123456789abcdeffedcba9876543210");
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_EQ(*k, kFingerprint);
  auto upper = ChunkKey::FromHex("0123456789ABCDEFFEDCBA9876543210");
  ASSERT_TRUE(upper.ok());
  EXPECT_EQ(*upper, kFingerprint);

  for (const auto& key : PrefixKeys(Ctx(), Iota(600))) {
    auto back = ChunkKey::FromHex(key.ToHex());
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, key);
  }

  uint8_t b[16];
  kFingerprint.ToBytes(b);
  const uint8_t want[16] = {0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
                            0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10};
  EXPECT_TRUE(std::equal(b, b + 16, want));
  EXPECT_EQ(ChunkKey::FromBytes(b), kFingerprint);
  EXPECT_TRUE(ChunkKey{}.is_zero());
  EXPECT_EQ(ChunkKey{}.ToHex(), std::string(32, '0'));
}

TEST(ChunkKey, FromHexRefusesAnythingButThirtyTwoHexDigits) {
  for (const char* bad : {"", "0123", "0123456789abcdeffedcba987654321",
                          "0123456789abcdeffedcba98765432100", "0x23456789abcdeffedcba9876543210",
                          "0123456789abcdeffedcba987654321g", " 123456789abcdeffedcba9876543210",
                          "0123456789abcdef-edcba9876543210"}) {
    auto k = ChunkKey::FromHex(bad);
    EXPECT_FALSE(k.ok()) << '"' << bad << '"';
    EXPECT_EQ(k.status().code(), StatusCode::kInvalidArgument) << '"' << bad << '"';
  }
}

}  // namespace
}  // namespace kdn::kvbus
