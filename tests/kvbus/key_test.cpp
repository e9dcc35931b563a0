// Chunk keys against docs/kvbus.md, "Chunk keys". The golden values were
// computed once from the spec with the Python xxhash package (not from this
// code), so a change to the hashed byte layout fails here; parity with the
// spec over random inputs is tests/parity/test_chunk_keys.py.
#include "kdn/kvbus/key.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <numeric>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../engine/test_util.h"
#include "kdn/engine/presets.h"

namespace kdn::kvbus {
namespace {

using engine::testing::TempDir;

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

std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
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
  const auto tokens = engine::testing::RandomTokens(16 * 10 + 7, 1 << 30, 3);
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

TEST(ModelFingerprint, MatchesTheSpecsGoldenVectorForTheTinyPreset) {
  // docs/kvbus.md lists the canonical text this hashes.
  auto p = engine::FindPreset("tiny");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(ModelFingerprint(p->config, "BF16", "f32", 0x0123456789abcdefull).ToHex(),
            "1687497894cb9b8d42e8d8798f30e5d8");
}

TEST(ModelFingerprint, ChangesWithEveryFieldThatShapesTheKv) {
  auto p = engine::FindPreset("tiny");
  ASSERT_TRUE(p.ok());
  const engine::ModelConfig base = p->config;
  const auto fp = [](const engine::ModelConfig& c, std::string_view w = "BF16",
                     std::string_view kv = "f32", uint64_t digest = 42) {
    return ModelFingerprint(c, w, kv, digest);
  };
  using Edit = std::pair<const char*, std::function<void(engine::ModelConfig&)>>;
  const std::vector<Edit> edits = {
      {"architecture", [](auto& c) { c.architecture = engine::Architecture::kMistral; }},
      {"vocab_size", [](auto& c) { c.vocab_size += 1; }},
      {"hidden_size", [](auto& c) { c.hidden_size *= 2; }},
      {"intermediate_size", [](auto& c) { c.intermediate_size += 16; }},
      {"num_layers", [](auto& c) { c.num_layers += 1; }},
      {"num_heads", [](auto& c) { c.num_heads *= 2; }},
      {"num_kv_heads", [](auto& c) { c.num_kv_heads = 1; }},
      {"head_dim", [](auto& c) { c.head_dim = 8; }},
      {"rms_norm_eps", [](auto& c) { c.rms_norm_eps = 1e-6; }},
      {"rope_theta", [](auto& c) { c.rope_theta = 500000.0; }},
      {"rope_scaling.llama3", [](auto& c) { c.rope_scaling.llama3 = false; }},
      {"rope_scaling.factor", [](auto& c) { c.rope_scaling.factor = 8.0; }},
      {"rope_scaling.low_freq_factor", [](auto& c) { c.rope_scaling.low_freq_factor = 2.0; }},
      {"rope_scaling.high_freq_factor", [](auto& c) { c.rope_scaling.high_freq_factor = 8.0; }},
      {"rope_scaling.original_max", [](auto& c) { c.rope_scaling.original_max_position_embeddings = 256; }},
      {"qkv_bias", [](auto& c) { c.qkv_bias = true; }},
      {"o_bias", [](auto& c) { c.o_bias = true; }},
      {"tie_word_embeddings", [](auto& c) { c.tie_word_embeddings = false; }},
      // The smallest change a double can make.
      {"rope_theta + 1 ulp", [](auto& c) { c.rope_theta = std::nextafter(c.rope_theta, 1e9); }},
  };
  std::set<ChunkKey> seen{fp(base)};
  for (const auto& [what, edit] : edits) {
    engine::ModelConfig c = base;
    edit(c);
    EXPECT_TRUE(seen.insert(fp(c)).second) << what << " does not change the fingerprint";
  }
  EXPECT_TRUE(seen.insert(fp(base, "F16")).second) << "weight dtype";
  EXPECT_TRUE(seen.insert(fp(base, "F32")).second) << "weight dtype";
  EXPECT_TRUE(seen.insert(fp(base, "BF16", "bf16")).second) << "kv dtype";
  EXPECT_TRUE(seen.insert(fp(base, "BF16", "f16")).second) << "kv dtype";
  EXPECT_TRUE(seen.insert(fp(base, "BF16", "f32", 43)).second) << "weights digest";
  EXPECT_TRUE(seen.insert(fp(base, "BF16", "f32", uint64_t{42} << 32)).second) << "weights digest";
}

TEST(ModelFingerprint, IgnoresFieldsThatDoNotShapeTheKv) {
  auto p = engine::FindPreset("tiny");
  ASSERT_TRUE(p.ok());
  engine::ModelConfig c = p->config;
  const ChunkKey before = ModelFingerprint(c, "BF16", "f32", 1);
  c.max_context *= 2;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  c.torch_dtype = "float16";
  EXPECT_EQ(ModelFingerprint(c, "BF16", "f32", 1), before);
}

TEST(WeightsDigest, IsStableForOneSeedAndChangesWithTheSeed) {
  auto p = engine::FindPreset("tiny");
  ASSERT_TRUE(p.ok());
  TempDir a, b, c;
  ASSERT_TRUE(engine::WriteModelFolder(a.path(), p->config, 1, p->dtype).ok());
  ASSERT_TRUE(engine::WriteModelFolder(b.path(), p->config, 1, p->dtype).ok());
  ASSERT_TRUE(engine::WriteModelFolder(c.path(), p->config, 2, p->dtype).ok());
  auto da = WeightsDigest(a.path()), db = WeightsDigest(b.path()), dc = WeightsDigest(c.path());
  ASSERT_TRUE(da.ok()) << da.status().ToString();
  ASSERT_TRUE(db.ok() && dc.ok());
  EXPECT_EQ(*da, *db);
  EXPECT_NE(*da, *dc);
  auto again = WeightsDigest(a.path());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *da);
  // The spec: XXH3-64, seed 0, over the one file's bytes.
  const std::string bytes = ReadFile(a.path() / "model.safetensors");
  EXPECT_EQ(*da, XXH3_64bits(bytes.data(), bytes.size()));
}

TEST(WeightsDigest, HashesSafetensorsFilesInNameOrderAndNothingElse) {
  TempDir d;
  const auto write = [&](const char* name, const std::string& text) {
    std::ofstream(d.path() / name, std::ios::binary) << text;
  };
  write("model-00002-of-00002.safetensors", "second");
  write("model-00001-of-00002.safetensors", "first-");
  write("model.safetensors.index.json", "{}");
  write("config.json", "{}");
  auto digest = WeightsDigest(d.path());
  ASSERT_TRUE(digest.ok()) << digest.status().ToString();
  EXPECT_EQ(*digest, XXH3_64bits("first-second", 12));
  write("config.json", "{\"changed\": true}");
  auto same = WeightsDigest(d.path());
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(*same, *digest);
}

TEST(WeightsDigest, FolderWithoutWeightsIsNotFound) {
  TempDir d;
  EXPECT_EQ(WeightsDigest(d.path()).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(WeightsDigest(d.path() / "missing").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kdn::kvbus
