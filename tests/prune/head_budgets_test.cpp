// kvzip's profiled scoring (kdn/prune/head_budgets.h): a prefill that stops
// after a few layers, KVzip's scores of those layers, the model's head
// budgets and the choice they make, and PruneText with them; and its
// combined scoring (prune.h's Rerank and MeanRanks).
#include "kdn/prune/head_budgets.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "kdn/prune/expected_attention.h"
#include "kdn/prune/prune_text.h"
#include "kdn/testing/tiny_model.h"

namespace kdn::prune {
namespace {

using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;

const KvzipPrompts kPrompts{{11, 12, 13}, {14, 15}, {16}};

// One layer's KV of slots [0, n) of `seq`, in f32.
std::vector<float> LayerKv(engine::KvCache& cache, const engine::KvSequence& seq, int layer,
                           int64_t n) {
  std::vector<float> kv(2 * n * cache.token_stride());
  EXPECT_TRUE(cache
                  .Read(seq, layer, 0, n, DType::kF32,
                        {reinterpret_cast<uint8_t*>(kv.data()), kv.size() * sizeof(float)})
                  .ok());
  return kv;
}

TEST(PrefillLayers, AScoringPassComputesTheFirstLayersAsAWholePrefillDoes) {
  auto model = MakeModel("small");
  const auto& c = model->config();
  engine::KvCache& cache = model->kv_cache();
  const auto tokens = RandomTokens(24, c.vocab_size, 1);
  engine::KvSequence whole = cache.NewSequence(), first = cache.NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(whole, tokens, {}, &logits).ok());
  ASSERT_FALSE(logits.empty());
  std::vector<int> seen;
  engine::PrefillOptions po;
  po.layers = 3;
  po.on_queries = [&](int layer, const float*, int64_t, const int32_t*) { seen.push_back(layer); };
  ASSERT_TRUE(model->Prefill(first, tokens, po, &logits).ok());
  EXPECT_TRUE(logits.empty());
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(first.length(), 24);
  for (int l = 0; l < 3; ++l) EXPECT_EQ(LayerKv(cache, first, l, 24), LayerKv(cache, whole, l, 24));
  EXPECT_NE(LayerKv(cache, first, 3, 24), LayerKv(cache, whole, 3, 24));
  // Past the model's layers: a whole prefill.
  engine::KvSequence again = cache.NewSequence();
  po.layers = c.num_layers + 5;
  ASSERT_TRUE(model->Prefill(again, tokens, po, &logits).ok());
  EXPECT_EQ(logits.size(), size_t(c.vocab_size));
}

TEST(KvzipScores, OfTheFirstLayersAreTheWholeScoresThere) {
  auto model = MakeModel("small");
  const auto& c = model->config();
  const auto context = RandomTokens(30, c.vocab_size, 2);
  engine::KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, context, {}, &logits).ok());
  auto all = KvzipScores(*model, seq, context, kPrompts, {.sinks = 4});
  auto two = KvzipScores(*model, seq, context, kPrompts, {.sinks = 4, .layers = 2});
  ASSERT_TRUE(all.ok() && two.ok());
  EXPECT_EQ(seq.length(), 30);
  const size_t split = size_t(2) * c.num_kv_heads * 30;
  EXPECT_TRUE(std::equal(two->v.begin(), two->v.begin() + split, all->v.begin()));
  EXPECT_TRUE(std::all_of(two->v.begin() + split, two->v.end(), [](float v) { return v == 0; }));
  EXPECT_FALSE(KvzipScores(*model, seq, context, kPrompts, {.layers = -1}).ok());
}

// Scores of one text: `layers` x `heads` x `tokens`, head h's tokens
// scored `base[h]` plus a little by position.
Scores Made(int layers, int heads, int64_t tokens, const std::vector<float>& base) {
  Scores s{layers, heads, tokens, {}};
  for (int i = 0; i < layers * heads; ++i) {
    for (int64_t t = 0; t < tokens; ++t) s.v.push_back(base[i] + 0.001f * float(t));
  }
  return s;
}

TEST(MeasureHeadBudgets, AShareIsWhatTheGlobalChoiceKeepsOfAHeadOnAverage) {
  // Two heads of 10 tokens, 2 of them sinks. Text A scores head 0 above
  // head 1 everywhere, text B the reverse.
  const std::vector<Scores> texts = {Made(1, 2, 10, {0.9f, 0.1f}), Made(1, 2, 10, {0.1f, 0.9f})};
  auto b = MeasureHeadBudgets(texts, 2);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->documents, 2);
  ASSERT_EQ(b->share.size(), size_t{HeadBudgets::kKeeps} * 2);
  // Keep 1/2 (the 32nd ratio): KeptCount 5 a head, 2 x 3 past the sinks,
  // all six to the better head of each text: 6/8 of it, half the time.
  EXPECT_DOUBLE_EQ(b->share[31 * 2 + 0], 0.375);
  EXPECT_DOUBLE_EQ(b->share[31 * 2 + 1], 0.375);
  // Keep 1: everything.
  EXPECT_DOUBLE_EQ(b->share[63 * 2 + 0], 1.0);
  // A text where head 0 always wins gives it all at every ratio up to half.
  auto one = MeasureHeadBudgets(std::span(texts).first(1), 2);
  ASSERT_TRUE(one.ok());
  EXPECT_DOUBLE_EQ(one->share[31 * 2 + 0], 0.75);
  EXPECT_DOUBLE_EQ(one->share[31 * 2 + 1], 0.0);
  EXPECT_EQ(MeasureHeadBudgets({}, 2).status().code(), StatusCode::kInvalidArgument);
  const std::vector<Scores> mixed = {Made(1, 2, 10, {1, 2}), Made(2, 1, 10, {1, 2})};
  EXPECT_EQ(MeasureHeadBudgets(mixed, 2).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(MeasureHeadBudgets(texts, 10).status().code(), StatusCode::kInvalidArgument);
}

// Budgets giving each of `shares.size()` heads (one layer) the same
// proportions at every ratio.
HeadBudgets Budgets(const std::vector<double>& shares) {
  HeadBudgets b{1, static_cast<int>(shares.size()), 1, {}};
  for (int k = 0; k < HeadBudgets::kKeeps; ++k)
    b.share.insert(b.share.end(), shares.begin(), shares.end());
  return b;
}

Scores Random(int heads, int64_t tokens, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0, 1);
  Scores s{1, heads, tokens, std::vector<float>(size_t(heads) * tokens)};
  for (float& v : s.v) v = u(rng);
  return s;
}

TEST(SelectBudgeted, EachHeadKeepsItsShareBestFirstAndTheTotalIsTheGlobalChoices) {
  const Scores s = Random(3, 22, 3);
  // KeptCount(22, 0.5, 2) = 11: 3 x 9 past the sinks, shared 0.6 : 0.3 :
  // 0.1 = 16.2, 8.1, 2.7; the unit left goes to the largest remainder.
  auto k = SelectBudgeted(s, 0.5, 2, Budgets({0.6, 0.3, 0.1}));
  ASSERT_TRUE(k.ok()) << k.status().ToString();
  EXPECT_EQ(k->granularity, Granularity::kGlobal);
  EXPECT_EQ(k->counts, (std::vector<int32_t>{18, 10, 5}));
  EXPECT_EQ(k->kept, 18);
  auto global = SelectKept(s, 0.5, 2, Granularity::kGlobal);
  ASSERT_TRUE(global.ok());
  EXPECT_DOUBLE_EQ(k->stored_tokens(), global->stored_tokens());
  for (int h = 0; h < 3; ++h) {
    const int32_t* kept = k->of(0, h);
    const int64_t n = k->count(0, h);
    EXPECT_EQ(kept[0], 0);
    EXPECT_EQ(kept[1], 1);
    EXPECT_TRUE(std::is_sorted(kept, kept + n));
    for (int64_t j = n; j < k->kept; ++j) EXPECT_EQ(kept[j], -1);
    // The kept beat the dropped within the head.
    float worst = 2, best = -1;
    std::vector<bool> in(22, false);
    for (int64_t j = 0; j < n; ++j) in[kept[j]] = true;
    for (int64_t t = 2; t < 22; ++t) {
      if (in[t]) {
        worst = std::min(worst, s.at(0, h, t));
      } else {
        best = std::max(best, s.at(0, h, t));
      }
    }
    EXPECT_GT(worst, best) << "head " << h;
  }
  // A head whose share passes what it has keeps all it has; the others
  // share the rest: keep 0.75 is 16 a head, 3 x 14 = 42 past the sinks,
  // 20 to head 0, 11 each to the others.
  auto clamped = SelectBudgeted(s, 0.75, 2, Budgets({0.9, 0.05, 0.05}));
  ASSERT_TRUE(clamped.ok());
  EXPECT_EQ(clamped->counts, (std::vector<int32_t>{22, 13, 13}));
  // No measured share at all: alike.
  auto alike = SelectBudgeted(s, 0.5, 2, Budgets({0, 0, 0}));
  ASSERT_TRUE(alike.ok());
  EXPECT_EQ(alike->counts, (std::vector<int32_t>{11, 11, 11}));
  EXPECT_EQ(SelectBudgeted(s, 0.5, 2, Budgets({1, 1})).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SelectBudgeted(s, 0, 2, Budgets({1, 1, 1})).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SelectBudgeted(s, 0.5, 22, Budgets({1, 1, 1})).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(SelectBudgeted, TakesTheSharesOfTheMeasuredRatiosAroundTheKeep) {
  // Head 0 has everything at ratios up to 1/2, head 1 above it; at 33/64,
  // between the two, they share alike.
  HeadBudgets b{1, 2, 1, {}};
  for (int k = 0; k < HeadBudgets::kKeeps; ++k) {
    b.share.push_back(k < 32 ? 1.0 : 0.0);
    b.share.push_back(k < 32 ? 0.0 : 1.0);
  }
  const Scores s = Random(2, 130, 4);
  auto low = SelectBudgeted(s, 0.25, 2, b), mid = SelectBudgeted(s, 32.5 / 64, 2, b),
       high = SelectBudgeted(s, 0.75, 2, b);
  ASSERT_TRUE(low.ok() && mid.ok() && high.ok());
  EXPECT_EQ(low->counts, (std::vector<int32_t>{62, 2}));  // head 1: its sinks alone
  // 2 x 95 past the sinks at 3/4: head 1 has all it has, head 0 the rest.
  EXPECT_EQ(high->counts, (std::vector<int32_t>{64, 130}));
  EXPECT_EQ(mid->counts, (std::vector<int32_t>{66, 66}));
}

TEST(ProfiledKvzipScores, RankTheFirstLayersByKvzipAndTheOthersByExpectedAttention) {
  auto model = MakeModel("small");
  const auto& c = model->config();
  ASSERT_GT(c.num_layers, kKvzipProfiledLayers);
  const auto context = RandomTokens(32, c.vocab_size, 5);
  engine::KvSequence seq = model->kv_cache().NewSequence();
  engine::QueryStats stats{.skip = 4};
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, context, {.on_queries = stats.Hook(c)}, &logits).ok());
  auto got = ProfiledKvzipScores(*model, seq, context, stats, kPrompts, 4);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  auto kvzip = KvzipScores(*model, seq, context, kPrompts, {.sinks = 4});
  auto ea = ExpectedAttentionScores(c, model->kv_cache(), seq, 32, stats, {.sinks = 4});
  ASSERT_TRUE(kvzip.ok() && ea.ok());
  const size_t split = size_t(kKvzipProfiledLayers) * c.num_kv_heads * 32;
  EXPECT_TRUE(std::equal(got->v.begin(), got->v.begin() + split, kvzip->v.begin()));
  EXPECT_TRUE(std::equal(got->v.begin() + split, got->v.end(), ea->v.begin() + split));
  EXPECT_EQ(seq.length(), 32);
}

TEST(PruneText, ProfiledKvzipKeepsWhatTheModelsBudgetsSay) {
  auto model = MakeModel("small");
  const auto& c = model->config();
  engine::KvCache& cache = model->kv_cache();
  const auto text = RandomTokens(40, c.vocab_size, 6);
  PruneSpec spec{.method = "kvzip", .keep = 0.5};
  spec.kvzip_first = kPrompts.first;
  spec.kvzip_next = kPrompts.next;
  spec.kvzip_suffix = kPrompts.suffix;
  ASSERT_EQ(ScoringOf(spec), KvzipScoring::kProfiled);
  engine::KvSequence pruned = cache.NewSequence();
  EXPECT_EQ(PruneText(*model, text, spec, &pruned).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(pruned.length(), 0);
  // The budgets of two other texts.
  const std::vector<std::vector<int32_t>> others = {RandomTokens(36, c.vocab_size, 7),
                                                    RandomTokens(44, c.vocab_size, 8)};
  auto budgets = MeasureHeadBudgets(*model, others, kPrompts);
  ASSERT_TRUE(budgets.ok()) << budgets.status().ToString();
  EXPECT_EQ(budgets->documents, 2);
  EXPECT_EQ(budgets->layers, c.num_layers);
  // They are the budgets of the texts' whole KVzip scores.
  std::vector<Scores> scores;
  std::vector<float> logits;
  for (const auto& t : others) {
    engine::KvSequence s = cache.NewSequence();
    ASSERT_TRUE(model->Prefill(s, t, {}, &logits).ok());
    scores.push_back(*KvzipScores(*model, s, t, kPrompts));
  }
  EXPECT_EQ(MeasureHeadBudgets(scores, kDefaultPruneSinks)->share, budgets->share);
  // What PruneText keeps is SelectBudgeted's over the profiled ranking.
  auto kept = PruneText(*model, text, spec, &pruned, &*budgets);
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  engine::KvSequence whole = cache.NewSequence();
  engine::QueryStats stats{.skip = spec.sinks};
  ASSERT_TRUE(model->Prefill(whole, text, {.on_queries = stats.Hook(c)}, &logits).ok());
  auto ranked = ProfiledKvzipScores(*model, whole, text, stats, kPrompts, spec.sinks);
  ASSERT_TRUE(ranked.ok());
  auto want = SelectBudgeted(*ranked, 0.5, spec.sinks, *budgets);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(kept->counts, want->counts);
  EXPECT_EQ(kept->index, want->index);
  // Scoring in full chooses among KVzip's whole scores.
  spec.scoring = KvzipScoring::kFull;
  engine::KvSequence full = cache.NewSequence();
  auto by_full = PruneText(*model, text, spec, &full);
  ASSERT_TRUE(by_full.ok());
  auto all = KvzipScores(*model, whole, text, kPrompts, {.sinks = spec.sinks});
  EXPECT_EQ(by_full->index, SelectKept(*all, 0.5, spec.sinks, Granularity::kGlobal)->index);
}

TEST(MeanRanks, OrdersEachHeadByTheMeanOfItsTwoRankings) {
  // One head of 5 tokens: a ranks them 0 1 2 3 4 (best first), b 4 3 0 1
  // 2; means 1, 1.5, 1.5, 2.5, 3 (token 0 ranked 0 and 2...).
  Scores a{1, 1, 5, {5, 4, 3, 2, 1}}, b{1, 1, 5, {3, 2, 1, 4, 5}};
  auto m = MeanRanks(a, b);
  ASSERT_TRUE(m.ok());
  // Ranks under a: 0 1 2 3 4; under b: 2 3 4 1 0. Means: 1 2 3 2 2.
  EXPECT_EQ(m->v, (std::vector<float>{-1, -2, -3, -2, -2}));
  // Ties in a ranking go to the earlier token.
  Scores flat{1, 1, 3, {1, 1, 1}};
  EXPECT_EQ(MeanRanks(flat, flat)->v, (std::vector<float>{0, -1, -2}));
  EXPECT_EQ(MeanRanks(a, flat).status().code(), StatusCode::kInvalidArgument);
}

TEST(Rerank, KeepsEachHeadsCountAndTakesTheBestByTheNewRanking) {
  const Scores s = Random(3, 22, 10), other = Random(3, 22, 11);
  auto kept = SelectKept(s, 0.25, 2, Granularity::kGlobal);
  ASSERT_TRUE(kept.ok());
  auto re = Rerank(*kept, other, 2);
  ASSERT_TRUE(re.ok()) << re.status().ToString();
  EXPECT_EQ(re->counts, kept->counts);
  EXPECT_EQ(re->kept, kept->kept);
  // Each head's picks are what SelectKept by head would take from `other`
  // at that count: the sinks and the best of the rest.
  for (int h = 0; h < 3; ++h) {
    const int64_t n = re->count(0, h);
    std::vector<int32_t> order(20);
    std::iota(order.begin(), order.end(), 2);
    std::sort(order.begin(), order.end(),
              [&](int32_t x, int32_t y) { return other.at(0, h, x) > other.at(0, h, y); });
    std::vector<int32_t> want(order.begin(), order.begin() + (n - 2));
    want.push_back(0);
    want.push_back(1);
    std::sort(want.begin(), want.end());
    EXPECT_EQ(std::vector<int32_t>(re->of(0, h), re->of(0, h) + n), want) << "head " << h;
    for (int64_t j = n; j < re->kept; ++j) EXPECT_EQ(re->of(0, h)[j], -1);
  }
  EXPECT_EQ(Rerank(*kept, Random(3, 21, 12), 2).status().code(), StatusCode::kInvalidArgument);
}

TEST(PruneText, CombinedKvzipRanksKvzipsCountsByBothScores) {
  auto model = MakeModel("small");
  const auto& c = model->config();
  engine::KvCache& cache = model->kv_cache();
  const auto text = RandomTokens(40, c.vocab_size, 13);
  PruneSpec spec{.method = "kvzip", .keep = 0.5, .scoring = KvzipScoring::kCombined};
  spec.kvzip_first = kPrompts.first;
  spec.kvzip_next = kPrompts.next;
  spec.kvzip_suffix = kPrompts.suffix;
  engine::KvSequence pruned = cache.NewSequence();
  auto kept = PruneText(*model, text, spec, &pruned);  // no budgets needed
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  engine::KvSequence whole = cache.NewSequence();
  engine::QueryStats stats{.skip = spec.sinks};
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(whole, text, {.on_queries = stats.Hook(c)}, &logits).ok());
  auto kvzip = KvzipScores(*model, whole, text, kPrompts, {.sinks = spec.sinks});
  auto ea = ExpectedAttentionScores(c, cache, whole, 40, stats, {.sinks = spec.sinks});
  ASSERT_TRUE(kvzip.ok() && ea.ok());
  auto global = SelectKept(*kvzip, 0.5, spec.sinks, Granularity::kGlobal);
  auto want = Rerank(*global, *MeanRanks(*kvzip, *ea), spec.sinks);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(kept->counts, global->counts);
  EXPECT_EQ(kept->index, want->index);
  EXPECT_NE(kept->index, global->index);  // the ranking moved some tokens
}

TEST(MeasureHeadBudgets, CutsEachTextToWhatFitsTheContextWithItsRepeatPass) {
  auto model = MakeModel("tiny");
  const auto& c = model->config();
  const auto longer = RandomTokens(kMaxBudgetTextTokens + 300, c.vocab_size, 9);
  const std::vector<std::vector<int32_t>> cut = {
      {longer.begin(), longer.begin() + kMaxBudgetTextTokens}};
  auto a = MeasureHeadBudgets(*model, std::vector<std::vector<int32_t>>{longer}, kPrompts);
  auto b = MeasureHeadBudgets(*model, cut, kPrompts);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->share, b->share);
}

TEST(PruneSpec, KvzipScoresProfiledWhenItChoosesGloballyUnlessTold) {
  PruneSpec spec{
      .method = "kvzip", .keep = 0.5, .kvzip_first = {1}, .kvzip_next = {2}, .kvzip_suffix = {3}};
  EXPECT_EQ(ScoringOf(spec), KvzipScoring::kProfiled);
  spec.granularity = Granularity::kToken;
  EXPECT_EQ(ScoringOf(spec), KvzipScoring::kFull);
  EXPECT_TRUE(ValidatePruneSpec(spec).ok());
  spec.scoring = KvzipScoring::kProfiled;  // profiled chooses globally only
  EXPECT_EQ(ValidatePruneSpec(spec).code(), StatusCode::kInvalidArgument);
  spec.granularity = Granularity::kGlobal;
  EXPECT_TRUE(ValidatePruneSpec(spec).ok());
  spec.scoring = KvzipScoring::kFull;
  EXPECT_EQ(ScoringOf(spec), KvzipScoring::kFull);
  const PruneSpec knorm{.method = "knorm", .keep = 0.5, .scoring = KvzipScoring::kFull};
  EXPECT_EQ(ValidatePruneSpec(knorm).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ScoringOf({.method = "expected_attention"}), KvzipScoring::kFull);
  EXPECT_EQ(*ParseKvzipScoring("profiled"), KvzipScoring::kProfiled);
  EXPECT_EQ(*ParseKvzipScoring("full"), KvzipScoring::kFull);
  EXPECT_EQ(*ParseKvzipScoring("combined"), KvzipScoring::kCombined);
  spec.scoring = KvzipScoring::kCombined;  // globally only, as profiled
  spec.granularity = Granularity::kLayer;
  EXPECT_EQ(ValidatePruneSpec(spec).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseKvzipScoring("fast").status().code(), StatusCode::kInvalidArgument);
  EXPECT_STREQ(KvzipScoringName(KvzipScoring::kProfiled), "profiled");
}

TEST(CalibrationTexts, AreTenPassagesOfThreeToFourHundredWords) {
  const std::vector<std::string> texts = CalibrationTexts();
  ASSERT_EQ(texts.size(), 10u);
  for (const std::string& t : texts) {
    const auto words = std::count(t.begin(), t.end(), ' ') + 1;
    EXPECT_GE(words, 300) << t.substr(0, 40);
    EXPECT_LE(words, 420) << t.substr(0, 40);
  }
}

}  // namespace
}  // namespace kdn::prune
