// Chunk keys against docs/kvbus.md, "Chunk keys". The golden values were
// computed once from the spec with the Python xxhash package (not from this
// code), so a change to the hashed byte layout fails here; parity with the
// spec over random inputs is tests/parity/test_chunk_keys.py.
#include "kdn/kvbus/key.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <functional>
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

TEST(ChunkKey, SteeringKeysMatchTheSpecsGoldenVectors) {
  const ChunkKey vector = SteeringVectorKey(Ctx(), "trust-the-text");
  EXPECT_EQ(vector.ToHex(), "3448a35906e5a311d3acce1f1cdbfafd");
  EXPECT_EQ(SteeringVectorKey(Ctx("tenant-a"), "trust-the-text").ToHex(),
            "0b8c85c25ea4144fc35e1983f8a62e83");
  const ChunkKey doc = SegmentKey(Ctx(), Iota(600));
  EXPECT_EQ(SteeredKey(doc, vector, 1.0f).ToHex(), "51a5aaa541d0074e4396bfc1cf167016");
  EXPECT_EQ(SteeredKey(doc, vector, 2.0f).ToHex(), "88814e55dec7558b2f85455c74c46ba6");
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
  for (const char* bad :
       {"", "0123", "0123456789abcdeffedcba987654321", "0123456789abcdeffedcba98765432100",
        "0x23456789abcdeffedcba9876543210", "0123456789abcdeffedcba987654321g",
        " 123456789abcdeffedcba9876543210", "0123456789abcdef-edcba9876543210"}) {
    auto k = ChunkKey::FromHex(bad);
    EXPECT_FALSE(k.ok()) << '"' << bad << '"';
    EXPECT_EQ(k.status().code(), StatusCode::kInvalidArgument) << '"' << bad << '"';
  }
}

// ---- tail keys (docs/kvbus.md, "Tail keys") --------------------------------

// Spans as "first+count:key", so that a failure prints readably.
std::vector<std::string> Desc(std::span<const KeyedSpan> spans) {
  std::vector<std::string> out;
  for (const KeyedSpan& s : spans) {
    out.push_back(std::to_string(s.first) + "+" + std::to_string(s.count) + ":" + s.key.ToHex());
  }
  return out;
}

std::vector<KeyedSpan> TailOf(const KeyContext& ctx, std::span<const int32_t> tokens) {
  return TailSpans(ctx, tokens, PrefixKeys(ctx, tokens));
}

std::vector<int32_t> RandomTokens(std::mt19937& rng, size_t n) {
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % (1u << 30));
  return t;
}

// The probes a tail lookup may make: the anchor, then one per piece size.
int MaxTailProbes(int chunk_tokens) {
  return 1 + std::bit_width(static_cast<unsigned>(std::max(chunk_tokens - 2, 0)));
}

// A store of keys (what a tier's Contains answers) that counts and checks the
// probes MatchTail and MatchPrefix make.
struct ProbedStore {
  std::set<ChunkKey> keys;
  std::vector<KeyedSpan> probes;

  void Add(std::span<const ChunkKey> ks) { keys.insert(ks.begin(), ks.end()); }
  void Add(std::span<const KeyedSpan> spans) {
    for (const KeyedSpan& s : spans) keys.insert(s.key);
  }
  std::function<bool(const KeyedSpan&)> Held() {
    probes.clear();
    return [this](const KeyedSpan& s) {
      EXPECT_TRUE(probes.empty() || s.first >= probes.back().first)
          << "probes out of position order";
      probes.push_back(s);
      return keys.count(s.key) > 0;
    };
  }
};

// The longest run of `stored`'s leading pieces that ends at or before `end`.
std::vector<KeyedSpan> PiecesUpTo(const std::vector<KeyedSpan>& stored, int64_t end) {
  std::vector<KeyedSpan> out;
  for (const KeyedSpan& s : stored) {
    if (s.first + s.count > end) break;
    out.push_back(s);
  }
  return out;
}

TEST(TailKey, TailSpansMatchTheSpecsGoldenVectors) {
  // docs/kvbus.md, tail golden vector 1: tokens 0..599, 256 per chunk, empty
  // namespace; the 88 tokens past chunk 1 are pieces 1, 64, 16, 4, 2, 1.
  const auto tokens = Iota(600);
  EXPECT_EQ(
      Desc(TailOf(Ctx(), tokens)),
      (std::vector<std::string>{
          "512+1:29ebceeee2bf877370b81e28879ed04a", "513+64:935daff95c143c6dfa7dab35a7f8ea93",
          "577+16:6b4187cfd3fffb4789d69d0fd990e0a3", "593+4:33b5e0a2c645c310a397ce7e08c22b31",
          "597+2:bd0300a257cdabe853a30aa4c08d34b2", "599+1:7d8a1172448b7b665513e7d43867d4b3"}));
  // Golden vector 2: tokens 1..7, 16 per chunk, namespace "tenant-a": no full
  // chunk, so the anchor's parent is the zero key.
  EXPECT_EQ(Desc(TailOf(Ctx("tenant-a", 16), Iota(7, 1))),
            (std::vector<std::string>{"0+1:cc99c856111780c39d4860397e8b833c",
                                      "1+4:d30659f3e801fd5665e90085ab094a27",
                                      "5+2:9dda399e390a8041de03587edb3f4727"}));
}

TEST(TailKey, AnchorHashesTheSpecsBytes) {
  // "tail" || parent (chunk 1's prefix key) || F || u32le(0) (namespace) ||
  // u32le(1) (count) || u32le(512): 48 bytes, seed 1.
  const auto tokens = Iota(600);
  const auto prefix = PrefixKeys(Ctx(), tokens);
  ASSERT_EQ(prefix.size(), 2u);
  uint8_t bytes[48] = {'t', 'a', 'i', 'l'};
  prefix[1].ToBytes(bytes + 4);
  kFingerprint.ToBytes(bytes + 20);
  const uint8_t rest[12] = {0, 0, 0, 0, 1, 0, 0, 0, 0x00, 0x02, 0, 0};
  std::copy(rest, rest + 12, bytes + 36);
  const XXH128_hash_t h = XXH3_128bits_withSeed(bytes, sizeof(bytes), kChunkKeyVersion);
  const ChunkKey want{h.high64, h.low64};
  EXPECT_EQ(want.ToHex(), "29ebceeee2bf877370b81e28879ed04a");
  EXPECT_EQ(TailKey(Ctx(), prefix[1], std::span(tokens).subspan(512, 1)), want);
}

TEST(TailKey, PiecesAreAnAnchorThenTheBinaryDigitsOfTheRestLargestFirst) {
  for (int C : {2, 3, 16, 100}) {
    for (int full : {0, 2}) {
      for (int L = 0; L < C; ++L) {
        const auto tokens = Iota(full * C + L, 5);
        const auto spans = TailOf(Ctx("", C), tokens);
        if (L == 0) {
          EXPECT_TRUE(spans.empty()) << C;
          continue;
        }
        ASSERT_FALSE(spans.empty());
        EXPECT_EQ(spans[0].count, 1);
        std::vector<int64_t> want_rest;
        for (int b = 30; b >= 0; --b) {
          if (((L - 1) >> b) & 1) want_rest.push_back(int64_t{1} << b);
        }
        std::vector<int64_t> rest;
        int64_t pos = int64_t{full} * C;
        ChunkKey parent = full > 0 ? PrefixKeys(Ctx("", C), tokens)[full - 1] : ChunkKey{};
        for (size_t i = 0; i < spans.size(); ++i) {
          EXPECT_EQ(spans[i].first, pos) << C << " " << L;
          if (i > 0) rest.push_back(spans[i].count);
          // Each piece chains over the key before it.
          EXPECT_EQ(spans[i].key,
                    TailKey(Ctx("", C), parent, std::span(tokens).subspan(pos, spans[i].count)));
          parent = spans[i].key;
          pos += spans[i].count;
        }
        EXPECT_EQ(rest, want_rest) << "C " << C << ", L " << L;
        EXPECT_EQ(pos, static_cast<int64_t>(tokens.size()));
        EXPECT_EQ(SpannedTokens(spans), static_cast<int64_t>(tokens.size()));
      }
    }
  }
  // A prompt that ends on a chunk boundary, or one-token chunks: no tail.
  EXPECT_TRUE(TailOf(Ctx("", 16), Iota(32)).empty());
  EXPECT_TRUE(TailOf(Ctx("", 16), {}).empty());
  EXPECT_TRUE(TailOf(Ctx("", 1), Iota(5)).empty());
}

TEST(TailKey, TailsAreSeparatedLikeChunks) {
  const auto tokens = Iota(16 + 5);
  const auto base = TailOf(Ctx("", 16), tokens);
  ASSERT_EQ(base.size(), 2u);  // 1, 4
  // The namespace, the fingerprint, the parent chain and the tokens all count.
  EXPECT_NE(TailOf(Ctx("tenant-a", 16), tokens)[0].key, base[0].key);
  KeyContext other = Ctx("", 16);
  other.model_fingerprint.hi ^= 1;
  EXPECT_NE(TailOf(other, tokens)[0].key, base[0].key);
  auto changed = tokens;
  changed[3] += 1;  // inside the full chunk: every tail piece changes
  for (size_t i = 0; i < base.size(); ++i)
    EXPECT_NE(TailOf(Ctx("", 16), changed)[i].key, base[i].key);
  // A tail piece is not a prefix or a segment key of the same tokens.
  const auto one = Iota(1);
  EXPECT_NE(TailKey(Ctx("", 1), ChunkKey{}, one), PrefixKeys(Ctx("", 1), one)[0]);
  EXPECT_NE(TailKey(Ctx(), ChunkKey{}, one), SegmentKey(Ctx(), one));
  // The count is hashed: pieces [1, 2] then [3] differ from [1] then [2, 3].
  const std::vector<int32_t> a{1, 2}, b{3}, c{1}, d{2, 3};
  EXPECT_NE(TailKey(Ctx(), TailKey(Ctx(), ChunkKey{}, a), b),
            TailKey(Ctx(), TailKey(Ctx(), ChunkKey{}, c), d));
}

// Tail lengths to try for a chunk size: all of them for small chunks, a
// sample (the ends, around each power of two, some random) for large ones.
std::vector<int> TailLengths(int C, std::mt19937& rng) {
  std::vector<int> out;
  if (C <= 32) {
    for (int L = 1; L < C; ++L) out.push_back(L);
    return out;
  }
  std::set<int> s{1, 2, 3, C - 2, C - 1};
  for (int p = 1; p < C; p *= 2) {
    for (int L : {p - 1, p, p + 1, p + 2}) {
      if (L >= 1 && L < C) s.insert(L);
    }
  }
  for (int i = 0; i < 10; ++i) s.insert(1 + static_cast<int>(rng() % (C - 1)));
  return {s.begin(), s.end()};
}

TEST(MatchTail, FindsAStoredConversationsTailWhenThePromptExtendsIt) {
  std::mt19937 rng(11);
  for (int C : {16, 256}) {
    const KeyContext ctx = Ctx("tenant-a", C);
    for (int full : {0, 1, 3}) {
      for (int L : TailLengths(C, rng)) {
        SCOPED_TRACE("C " + std::to_string(C) + ", full " + std::to_string(full) + ", L " +
                     std::to_string(L));
        const auto convo = RandomTokens(rng, static_cast<size_t>(full * C + L));
        const auto stored = TailOf(ctx, convo);
        ProbedStore store;
        store.Add(PrefixKeys(ctx, convo));
        store.Add(stored);
        // The next turn: a few new tokens, or enough to fill chunks past it.
        for (size_t extra : {size_t{1}, size_t{7}, static_cast<size_t>(2 * C + 3)}) {
          auto prompt = convo;
          const auto more = RandomTokens(rng, extra);
          prompt.insert(prompt.end(), more.begin(), more.end());
          const auto pk = PrefixKeys(ctx, prompt);
          const auto got = MatchTail(ctx, prompt, pk, full, INT64_MAX, store.Held());
          EXPECT_EQ(Desc(got), Desc(stored)) << extra << " new tokens";
          EXPECT_EQ(SpannedTokens(got), static_cast<int64_t>(convo.size()));
          EXPECT_LE(static_cast<int>(store.probes.size()), MaxTailProbes(C));
        }
        // The same prompt again: the whole tail too.
        const auto again =
            MatchTail(ctx, convo, PrefixKeys(ctx, convo), full, INT64_MAX, store.Held());
        EXPECT_EQ(Desc(again), Desc(stored));
        EXPECT_LE(static_cast<int>(store.probes.size()), MaxTailProbes(C));
      }
    }
  }
}

TEST(MatchTail, ProbesAtMostOnePlusBitWidthAndAColdPromptOnce) {
  std::mt19937 rng(12);
  for (int C : {2, 3, 4, 5, 16, 17, 100, 256}) {
    const KeyContext ctx = Ctx("", C);
    // Store every tail length of one conversation: lookups then hit at every
    // step they try, the most probing case.
    const auto convo = RandomTokens(rng, static_cast<size_t>(C + C - 1));
    ProbedStore store;
    for (int L = 1; L < C; ++L) store.Add(TailOf(ctx, std::span(convo).first(C + L)));
    for (int L = 1; L < C; ++L) {
      auto prompt = std::vector<int32_t>(convo.begin(), convo.begin() + C + L);
      prompt.push_back(1);
      const auto got = MatchTail(ctx, prompt, PrefixKeys(ctx, prompt), 1, INT64_MAX, store.Held());
      EXPECT_EQ(SpannedTokens(got), C + L) << "C " << C << ", L " << L;
      EXPECT_LE(static_cast<int>(store.probes.size()), MaxTailProbes(C))
          << "C " << C << ", L " << L;
    }
    // A prompt whose tail was never stored: one probe, nothing found.
    const auto cold = RandomTokens(rng, static_cast<size_t>(C + C / 2 + 1));
    const auto got = MatchTail(ctx, cold, PrefixKeys(ctx, cold), 1, INT64_MAX, store.Held());
    EXPECT_TRUE(got.empty());
    EXPECT_EQ(store.probes.size(), 1u) << "C " << C;
    EXPECT_EQ(store.probes[0].first, C);
    EXPECT_EQ(store.probes[0].count, 1);
  }
}

TEST(MatchTail, NeverSpansMoreThanTheLimit) {
  std::mt19937 rng(13);
  for (int C : {16, 256}) {
    const KeyContext ctx = Ctx("", C);
    for (int L : TailLengths(C, rng)) {
      const int full = 2;
      const auto convo = RandomTokens(rng, static_cast<size_t>(full * C + L));
      const auto stored = TailOf(ctx, convo);
      ProbedStore store;
      store.Add(stored);
      auto prompt = convo;
      prompt.push_back(9);
      const auto pk = PrefixKeys(ctx, prompt);
      for (int64_t limit = -1; limit <= L + 2; ++limit) {
        SCOPED_TRACE("C " + std::to_string(C) + ", L " + std::to_string(L) + ", limit " +
                     std::to_string(limit));
        const auto got = MatchTail(ctx, prompt, pk, full, limit, store.Held());
        // The stored pieces that fit, in order, and not one probe past the limit.
        EXPECT_EQ(Desc(got), Desc(PiecesUpTo(stored, full * C + std::max<int64_t>(limit, 0))));
        EXPECT_LE(SpannedTokens(got), full * C + std::max<int64_t>(limit, 0));
        for (const KeyedSpan& p : store.probes) EXPECT_LE(p.first + p.count - full * C, limit);
        if (limit < 1) {
          EXPECT_TRUE(store.probes.empty());
        }
      }
    }
  }
}

TEST(MatchTail, APromptThatDivergesInsideTheTailReusesOnlyThePiecesThatMatch) {
  std::mt19937 rng(14);
  for (int C : {16, 256}) {
    const KeyContext ctx = Ctx("", C);
    for (int L : TailLengths(C, rng)) {
      const int full = 1;
      const auto convo = RandomTokens(rng, static_cast<size_t>(full * C + L));
      const auto stored = TailOf(ctx, convo);
      ProbedStore store;
      store.Add(stored);
      for (int d = 0; d < L; ++d) {  // the first tail token that differs
        auto prompt = convo;
        prompt[full * C + d] ^= 0x5a5a;
        prompt.push_back(3);
        const auto got =
            MatchTail(ctx, prompt, PrefixKeys(ctx, prompt), full, INT64_MAX, store.Held());
        EXPECT_EQ(Desc(got), Desc(PiecesUpTo(stored, full * C + d)))
            << "C " << C << ", L " << L << ", d " << d;
        EXPECT_LE(static_cast<int>(store.probes.size()), MaxTailProbes(C));
      }
    }
  }
}

TEST(MatchTail, EveryTurnStoredFindsExactlyTheSharedTokens) {
  // A chat that stored its tail after every turn holds the tails of many
  // lengths; a prompt that shares d tail tokens with it reuses all d.
  std::mt19937 rng(15);
  for (int C : {16, 64}) {
    const KeyContext ctx = Ctx("", C);
    const auto convo = RandomTokens(rng, static_cast<size_t>(C + C - 1));
    ProbedStore store;
    for (int L = 1; L < C; ++L) store.Add(TailOf(ctx, std::span(convo).first(C + L)));
    for (int d = 0; d < C; ++d) {
      auto prompt = std::vector<int32_t>(convo.begin(), convo.begin() + C + d);
      const auto more = RandomTokens(rng, static_cast<size_t>(C));  // diverges at d (almost surely)
      prompt.insert(prompt.end(), more.begin(), more.end());
      const auto got = MatchTail(ctx, prompt, PrefixKeys(ctx, prompt), 1, INT64_MAX, store.Held());
      EXPECT_EQ(SpannedTokens(got), d == 0 ? 0 : C + d) << "C " << C << ", d " << d;
      EXPECT_LE(static_cast<int>(store.probes.size()), MaxTailProbes(C));
    }
  }
}

TEST(MatchTail, AHeldThatRefusesAPieceKeepsTheChainBeforeIt) {
  // `held` may be a load that refuses what it finds (a damaged chunk): the
  // match stops there, never skipping over a missing piece.
  const KeyContext ctx = Ctx("", 16);
  const auto convo = Iota(16 + 12);  // tail 12: 1, 8, 2, 1
  const auto stored = TailOf(ctx, convo);
  ASSERT_EQ(stored.size(), 4u);
  for (size_t refused = 0; refused < stored.size(); ++refused) {
    ProbedStore store;
    store.Add(stored);
    store.keys.erase(stored[refused].key);
    const auto got = MatchTail(ctx, convo, PrefixKeys(ctx, convo), 1, INT64_MAX, store.Held());
    EXPECT_EQ(Desc(got), Desc(std::vector<KeyedSpan>(stored.begin(), stored.begin() + refused)))
        << refused;
  }
}

TEST(MatchTail, RefusesBadArguments) {
  const KeyContext ctx = Ctx("", 16);
  const auto tokens = Iota(40);
  const auto pk = PrefixKeys(ctx, tokens);  // 2 keys
  int calls = 0;
  const auto held = [&](const KeyedSpan&) { return ++calls, true; };
  EXPECT_TRUE(MatchTail(ctx, tokens, pk, 3, INT64_MAX, held).empty());   // past the keys
  EXPECT_TRUE(MatchTail(ctx, tokens, pk, -1, INT64_MAX, held).empty());  // negative
  EXPECT_TRUE(
      MatchTail(Ctx("", 1), tokens, PrefixKeys(Ctx("", 1), tokens), 40, INT64_MAX, held).empty());
  EXPECT_TRUE(MatchTail(ctx, Iota(32), PrefixKeys(ctx, Iota(32)), 2, INT64_MAX, held)
                  .empty());  // no tail tokens
  EXPECT_EQ(calls, 0);
}

TEST(MatchPrefix, CombinesFullChunksAndTheTail) {
  std::mt19937 rng(16);
  for (int C : {16, 256}) {
    const KeyContext ctx = Ctx("tenant-a", C);
    for (int full : {0, 1, 3}) {
      for (int L : TailLengths(C, rng)) {
        SCOPED_TRACE("C " + std::to_string(C) + ", full " + std::to_string(full) + ", L " +
                     std::to_string(L));
        const auto convo = RandomTokens(rng, static_cast<size_t>(full * C + L));
        const auto convo_keys = PrefixKeys(ctx, convo);
        const auto stored = TailOf(ctx, convo);
        ProbedStore store;
        store.Add(convo_keys);
        store.Add(stored);
        auto prompt = convo;
        const auto more = RandomTokens(rng, static_cast<size_t>(C + 5));  // fills chunk `full`
        prompt.insert(prompt.end(), more.begin(), more.end());
        const auto pk = PrefixKeys(ctx, prompt);
        const auto got = MatchPrefix(ctx, prompt, pk, INT64_MAX, 1, store.Held());
        std::vector<KeyedSpan> want;
        for (int i = 0; i < full; ++i) want.push_back({convo_keys[i], int64_t{i} * C, C});
        want.insert(want.end(), stored.begin(), stored.end());
        EXPECT_EQ(Desc(got), Desc(want));
        EXPECT_EQ(SpannedTokens(got), static_cast<int64_t>(convo.size()));
        // The full chunks, the one that misses, then the tail's probes.
        EXPECT_LE(static_cast<int>(store.probes.size()), full + 1 + MaxTailProbes(C));
        // A limit inside the tail keeps the chunks and the pieces that fit.
        const int64_t limit = full * C + L / 2;
        const auto cut = MatchPrefix(ctx, prompt, pk, limit, 1, store.Held());
        want.resize(full);
        for (const KeyedSpan& s : PiecesUpTo(stored, limit)) want.push_back(s);
        EXPECT_EQ(Desc(cut), Desc(want));
        EXPECT_LE(SpannedTokens(cut), limit);
      }
    }
  }
}

TEST(MatchPrefix, DropsATailMatchShorterThanTheMinimum) {
  std::mt19937 rng(18);
  const KeyContext ctx = Ctx("", 64);
  // A conversation of a chunk and 20 tokens; every prompt shares its first
  // token after the chunk (a BOS, a chat template's marker).
  const auto convo = RandomTokens(rng, 64 + 20);
  const auto convo_keys = PrefixKeys(ctx, convo);
  ProbedStore store;
  store.Add(convo_keys);
  store.Add(TailOf(ctx, convo));
  auto prompt = convo;
  prompt.push_back(7);
  const auto pk = PrefixKeys(ctx, prompt);
  EXPECT_EQ(SpannedTokens(MatchPrefix(ctx, prompt, pk, INT64_MAX, kMinTailTokens, store.Held())),
            64 + 20);
  EXPECT_EQ(SpannedTokens(MatchPrefix(ctx, prompt, pk, INT64_MAX, 21, store.Held())), 64)
      << "a 20-token tail match under a minimum of 21: the chunk alone";
  // A prompt that shares only the tail's first token: the chunk alone.
  auto other = std::vector<int32_t>(convo.begin(), convo.begin() + 65);
  const auto more = RandomTokens(rng, 30);
  other.insert(other.end(), more.begin(), more.end());
  other[65] = convo[65] + 1;
  const auto ok = PrefixKeys(ctx, other);
  EXPECT_EQ(SpannedTokens(MatchPrefix(ctx, other, ok, INT64_MAX, 1, store.Held())), 65);
  EXPECT_EQ(SpannedTokens(MatchPrefix(ctx, other, ok, INT64_MAX, kMinTailTokens, store.Held())),
            64);
}

TEST(MatchPrefix, AColdPromptCostsOneProbeMoreThanItsChunks) {
  std::mt19937 rng(17);
  const KeyContext ctx = Ctx("", 16);
  ProbedStore store;
  store.Add(TailOf(ctx, RandomTokens(rng, 16 + 9)));  // someone else's
  // Shorter than a chunk: the anchor is the only probe.
  const auto short_prompt = RandomTokens(rng, 9);
  EXPECT_TRUE(
      MatchPrefix(ctx, short_prompt, PrefixKeys(ctx, short_prompt), INT64_MAX, 1, store.Held())
          .empty());
  EXPECT_EQ(store.probes.size(), 1u);
  // Longer: the first chunk misses, then the anchor at position 0.
  const auto long_prompt = RandomTokens(rng, 16 * 3 + 2);
  EXPECT_TRUE(
      MatchPrefix(ctx, long_prompt, PrefixKeys(ctx, long_prompt), INT64_MAX, 1, store.Held())
          .empty());
  ASSERT_EQ(store.probes.size(), 2u);
  EXPECT_EQ(store.probes[1].first, 0);
  EXPECT_EQ(store.probes[1].count, 1);
  // A limit of 0 probes nothing.
  EXPECT_TRUE(
      MatchPrefix(ctx, long_prompt, PrefixKeys(ctx, long_prompt), 0, 1, store.Held()).empty());
  EXPECT_TRUE(store.probes.empty());
}

}  // namespace
}  // namespace kdn::kvbus
