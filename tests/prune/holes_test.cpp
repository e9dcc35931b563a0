// Pruned KV whose heads kept different numbers of tokens (prune's
// Granularity::kGlobal): the sequence's holes (KvSequence::SetHeadTokens),
// attention over them (a prefill's rows and decode steps), the global
// selection and KVzip's scores.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "kdn/testing/tiny_model.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/prune/kvzip.h"
#include "kdn/prune/prune.h"

namespace kdn::prune {
namespace {

using kdn::testing::AnswerOver;
using kdn::testing::MakeModel;
using kdn::testing::MaxDiff;
using kdn::testing::RandomTokens;

// Every (layer, KV head) keeps `index` (ascending), `slots` slots; the
// first `count` of them are kept, the rest are other tokens.
KeptTokens Kept(const engine::CpuEngine& model, int64_t logical, const std::vector<int32_t>& index,
                const std::vector<int32_t>& counts) {
  const auto& c = model.config();
  KeptTokens k{c.num_layers,
               c.num_kv_heads,
               logical,
               static_cast<int64_t>(index.size()),
               Granularity::kGlobal,
               {},
               counts};
  for (int i = 0; i < c.num_layers * c.num_kv_heads; ++i) {
    k.index.insert(k.index.end(), index.begin(), index.end());
  }
  return k;
}

// Layer l's KV head g's holes as one run of slots [begin, end) ({0, 0}:
// none); a test failure unless they are one run ending at the holes' end.
std::pair<int64_t, int64_t> HoleRun(const engine::KvSequence& s, int l, int g) {
  const std::span<const uint8_t> holes = s.Holes(l, g);
  const auto first = std::find(holes.begin(), holes.end(), uint8_t{1});
  EXPECT_TRUE(std::all_of(first, holes.end(), [](uint8_t b) { return b != 0; }));
  if (first == holes.end()) return {0, 0};
  return {first - holes.begin(), static_cast<int64_t>(holes.size())};
}

// Fills layer l's KV head g, slots [from, to), with large random K and V.
void Scribble(engine::CpuKvCache& cache, engine::KvSequence& seq, int l, int g, int64_t from,
              int64_t to, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> big(-30.0f, 30.0f);
  const int hd = cache.head_dim();
  for (int64_t s = from; s < to; ++s) {
    for (int i = 0; i < hd; ++i) {
      cache.KeyAt(seq, l, s)[g * hd + i] = big(rng);
      cache.ValueAt(seq, l, s)[g * hd + i] = big(rng);
    }
  }
}

TEST(Holes, AHoleInEveryHeadIsAsIfItsSlotsWereNotThere) {
  auto model = MakeModel("tiny");
  const auto& c = model->config();
  engine::CpuKvCache& cache = model->kv_cache();
  const auto context = RandomTokens(40, c.vocab_size, 1),
             question = RandomTokens(20, c.vocab_size, 2);
  engine::KvSequence full = cache.NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(full, context, {}, &logits).ok());
  std::vector<int32_t> kept(16);
  std::iota(kept.begin(), kept.end(), 0);
  for (int32_t& t : kept) t = t * 2 + (t % 3 == 0);  // 0, 3, 4, 7, 8, ...
  engine::KvSequence shorter = cache.NewSequence(), holed = cache.NewSequence();
  ASSERT_TRUE(CompactKv(cache, full, Kept(*model, 40, kept, {}), &shorter).ok());
  // The same tokens, then four slots every head leaves empty.
  std::vector<int32_t> index = kept;
  for (int32_t t : {1, 2, 5, 6}) index.push_back(t);
  const std::vector<int32_t> counts(size_t(c.num_layers) * c.num_kv_heads, 16);
  ASSERT_TRUE(CompactKv(cache, full, Kept(*model, 40, index, counts), &holed).ok());
  ASSERT_TRUE(holed.has_holes());
  EXPECT_EQ(holed.length(), 20);
  EXPECT_EQ(holed.next_position(), 40);
  EXPECT_EQ(HoleRun(holed, 0, 0), std::make_pair(int64_t{16}, int64_t{20}));
  for (int l = 0; l < c.num_layers; ++l) {
    for (int g = 0; g < c.num_kv_heads; ++g) Scribble(cache, holed, l, g, 16, 20, 10 * l + g);
  }
  const std::vector<float> want = AnswerOver(*model, shorter, question);
  const std::vector<float> got = AnswerOver(*model, holed, question);
  EXPECT_LT(MaxDiff(want, got), 1e-4f);
  // Pruning it again is refused.
  engine::KvSequence again = cache.NewSequence();
  EXPECT_EQ(CompactKv(cache, holed, Kept(*model, 20, kept, {}), &again).code(),
            StatusCode::kInvalidArgument);
  // A chunk holds every head's KV of each token: none is made of holes.
  EXPECT_EQ(kvbridge::ChunkFromPagedKv(cache, holed, 0, 20, {1, 2}, {3, 4}, kdn::DType::kF32)
                .status()
                .code(),
            StatusCode::kInvalidArgument);
}

// A row pass (blend's) computes its rows' K and V in every head: at each
// layer it runs, their slots' holes are filled before attention reads them.
TEST(Holes, ARowPassFillsTheHolesOfTheRowsItComputes) {
  auto model = MakeModel("tiny");
  const auto& c = model->config();
  engine::CpuKvCache& cache = model->kv_cache();
  const auto tokens = RandomTokens(20, c.vocab_size, 5);
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 20).ok());
  cache.SetLength(seq, 20);
  // Every head of every layer holds slots 0..15 only; all 20 hold garbage.
  for (int l = 0; l < c.num_layers; ++l) {
    for (int g = 0; g < c.num_kv_heads; ++g) Scribble(cache, seq, l, g, 0, 20, 7 * l + g);
  }
  ASSERT_TRUE(
      seq.SetHeadTokens(20, std::vector<int32_t>(size_t(c.num_layers) * c.num_kv_heads, 16)).ok());
  {
    const std::vector<int64_t> rows = {16, 17};
    auto pass = model->BeginRowPass(seq, tokens, rows);
    ASSERT_TRUE(pass.ok()) << pass.status().ToString();
    ASSERT_TRUE((*pass)->RunLayer().ok());
    for (int g = 0; g < c.num_kv_heads; ++g) {
      EXPECT_EQ(seq.Holes(0, g)[16], 0);
      EXPECT_EQ(seq.Holes(0, g)[17], 0);
      EXPECT_NE(seq.Holes(0, g)[18], 0);
      EXPECT_NE(seq.Holes(1, g)[16], 0) << "layer 1 has not run";
    }
  }
  // Every row at every layer: a prefill of the 20 tokens, whatever the
  // holes and the garbage held before.
  std::vector<int64_t> all(20);
  std::iota(all.begin(), all.end(), 0);
  auto pass = model->BeginRowPass(seq, tokens, all);
  ASSERT_TRUE(pass.ok());
  for (int l = 0; l < c.num_layers; ++l) ASSERT_TRUE((*pass)->RunLayer().ok());
  EXPECT_FALSE(seq.has_holes());
  std::vector<float> got, want;
  ASSERT_TRUE((*pass)->Logits(&got).ok());
  engine::KvSequence plain = cache.NewSequence();
  ASSERT_TRUE(model->Prefill(plain, tokens, {}, &want).ok());
  EXPECT_LT(MaxDiff(got, want), 1e-4f);
}

TEST(Holes, AHeadsHoleHidesItsSlotsFromThatHeadOnly) {
  auto model = MakeModel("tiny");
  const auto& c = model->config();
  ASSERT_GE(c.num_kv_heads, 2);
  engine::CpuKvCache& cache = model->kv_cache();
  const auto context = RandomTokens(40, c.vocab_size, 3),
             question = RandomTokens(20, c.vocab_size, 4);
  engine::KvSequence full = cache.NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(full, context, {}, &logits).ok());
  std::vector<int32_t> index(24);
  std::iota(index.begin(), index.end(), 0);
  // Layer 0's KV head 0 keeps 18 of the 24 tokens the others keep.
  std::vector<int32_t> counts(size_t(c.num_layers) * c.num_kv_heads, 24);
  counts[0] = 18;
  const KeptTokens k = Kept(*model, 40, index, counts);
  auto answer = [&](int scribble_head) {
    engine::KvSequence s = cache.NewSequence();
    EXPECT_TRUE(CompactKv(cache, full, k, &s).ok());
    if (scribble_head >= 0) Scribble(cache, s, 0, scribble_head, 18, 24, 99);
    return AnswerOver(*model, s, question);
  };
  const std::vector<float> base = answer(-1);
  // What head 0 does not see may hold anything.
  EXPECT_LT(MaxDiff(base, answer(0)), 1e-4f);
  // Head 1 sees the same slots: writing them changes the answer.
  EXPECT_GT(MaxDiff(base, answer(1)), 1e-2f);
  // And the holed head differs from one that kept its 24.
  engine::KvSequence whole24 = cache.NewSequence();
  counts[0] = 24;
  ASSERT_TRUE(CompactKv(cache, full, Kept(*model, 40, index, counts), &whole24).ok());
  EXPECT_FALSE(whole24.has_holes());
  EXPECT_GT(MaxDiff(base, AnswerOver(*model, whole24, question)), 1e-3f);
}

TEST(Holes, TruncateShortensThemAndSetHeadTokensChecksItsArguments) {
  auto model = MakeModel("tiny");
  const auto& c = model->config();
  engine::CpuKvCache& cache = model->kv_cache();
  engine::KvSequence s = cache.NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(s, RandomTokens(30, c.vocab_size, 5), {}, &logits).ok());
  const size_t heads = size_t(c.num_layers) * c.num_kv_heads;
  EXPECT_FALSE(s.SetHeadTokens(31, std::vector<int32_t>(heads, 3)).ok());  // past the KV
  EXPECT_FALSE(s.SetHeadTokens(20, std::vector<int32_t>(heads - 1, 3)).ok());
  EXPECT_FALSE(s.SetHeadTokens(20, std::vector<int32_t>(heads, 21)).ok());
  EXPECT_FALSE(s.has_holes());
  std::vector<int32_t> counts(heads, 12);
  counts[1] = 20;
  ASSERT_TRUE(s.SetHeadTokens(20, counts).ok());
  EXPECT_EQ(HoleRun(s, 0, 0), std::make_pair(int64_t{12}, int64_t{20}));
  EXPECT_EQ(HoleRun(s, 0, 1), std::make_pair(int64_t{0}, int64_t{0}));  // kept all 20: none
  s.Truncate(15);
  EXPECT_EQ(HoleRun(s, 0, 0), std::make_pair(int64_t{12}, int64_t{15}));
  s.Truncate(10);
  EXPECT_FALSE(s.has_holes());
  ASSERT_TRUE(s.SetHeadTokens(10, std::vector<int32_t>(heads, 4)).ok());
  engine::KvSequence moved = std::move(s);
  EXPECT_TRUE(moved.has_holes());
  moved.Reset();
  EXPECT_FALSE(moved.has_holes());
}

TEST(SelectKept, GlobalTakesTheBestOfEveryHeadTogetherAndKeepsEachHeadsSinks) {
  const int layers = 3, heads = 2, sinks = 4;
  const int64_t tokens = 40;
  Scores s{layers, heads, tokens, std::vector<float>(size_t(layers) * heads * tokens)};
  std::mt19937 rng(5);
  for (float& v : s.v) v = std::uniform_real_distribution<float>(0, 1)(rng);
  // Layer 1's head 0 scores high everywhere: it keeps more than the rest.
  for (int64_t t = 0; t < tokens; ++t) s.at(1, 0, t) += 1.0f;
  auto k = SelectKept(s, 0.25, sinks, Granularity::kGlobal);
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  ASSERT_EQ(k->counts.size(), size_t(layers) * heads);
  EXPECT_DOUBLE_EQ(k->stored_tokens(), 10.0);  // KeptCount(40, 0.25, 4) a head on average
  EXPECT_EQ(k->kept, *std::max_element(k->counts.begin(), k->counts.end()));
  EXPECT_EQ(k->count(1, 0), tokens);
  // Every head's sinks; every kept score beats every dropped one.
  float worst_kept = 2, best_dropped = -1;
  for (int l = 0; l < layers; ++l) {
    for (int h = 0; h < heads; ++h) {
      std::vector<bool> in(tokens, false);
      for (int64_t j = 0; j < k->count(l, h); ++j) in[k->of(l, h)[j]] = true;
      for (int64_t j = k->count(l, h); j < k->kept; ++j) EXPECT_EQ(k->of(l, h)[j], -1);
      for (int t = 0; t < sinks; ++t) EXPECT_TRUE(in[t]);
      EXPECT_TRUE(std::is_sorted(k->of(l, h), k->of(l, h) + k->count(l, h)));
      for (int64_t t = sinks; t < tokens; ++t) {
        (in[t] ? worst_kept : best_dropped) =
            in[t] ? std::min(worst_kept, s.at(l, h, t)) : std::max(best_dropped, s.at(l, h, t));
      }
    }
  }
  EXPECT_GT(worst_kept, best_dropped);
  EXPECT_EQ(*ParseGranularity("global"), Granularity::kGlobal);
}

TEST(KvzipScores, AreAttentionWeightsAndLeaveTheContextAsItWas) {
  auto model = MakeModel("tiny");
  const auto& c = model->config();
  engine::CpuKvCache& cache = model->kv_cache();
  const auto context = RandomTokens(50, c.vocab_size, 6),
             question = RandomTokens(20, c.vocab_size, 7);
  const KvzipPrompts prompts{{11, 12, 13}, {14, 15}, {16}};
  engine::KvSequence seq = cache.NewSequence();
  std::vector<float> logits, before, after;
  ASSERT_TRUE(model->Prefill(seq, context, {}, &logits).ok());
  ASSERT_TRUE(model->Prefill(seq, question, {.all_logits = true}, &before).ok());
  seq.Truncate(50);
  auto one = KvzipScores(*model, seq, context, prompts, {.sinks = 4});
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(seq.length(), 50);
  EXPECT_EQ(seq.next_position(), 50);
  ASSERT_TRUE(model->Prefill(seq, question, {.all_logits = true}, &after).ok());
  EXPECT_EQ(before, after);
  seq.Truncate(50);
  ASSERT_EQ(one->tokens, 50);
  for (float v : one->v) {
    EXPECT_GT(v, 0.0f);
    EXPECT_LE(v, 1.0f);
  }
  // In parts of 16 (each after the previous part's last tokens), the scores
  // change but stay weights; a part of the whole context is one pass.
  auto parts = KvzipScores(*model, seq, context, prompts, {.sinks = 4, .chunk_tokens = 16});
  auto whole = KvzipScores(*model, seq, context, prompts, {.sinks = 4, .chunk_tokens = 50});
  ASSERT_TRUE(parts.ok() && whole.ok());
  EXPECT_EQ(whole->v, one->v);
  EXPECT_NE(parts->v, one->v);
  for (float v : parts->v) EXPECT_GT(v, 0.0f);
  // What does not fit is refused, and the sequence stays as it was.
  EXPECT_FALSE(KvzipScores(*model, seq, std::span(context).first(49), prompts).ok());
  EXPECT_FALSE(KvzipScores(*model, seq, context, KvzipPrompts{}).ok());
  EXPECT_EQ(seq.length(), 50);
}

}  // namespace
}  // namespace kdn::prune
