#include "kdn/blend/blend.h"
#include "kdn/kvbridge/paged_chunks.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <numeric>

#include "blend_prompts.h"
#include "kdn/testing/tiny_model.h"

namespace kdn::blend {
namespace {

using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;
using kdn::testing::RelError;

TEST(Blend, RatioOneIsAFullPrefill) {
  auto model = MakeModel("tiny");
  const Prompt p = MakePrompt(*model, 3, 40, 1);
  engine::KvSequence seq = model->kv_cache().NewSequence();
  auto r = BlendPrefill(*model, seq, p.segments, p.suffix,
                        {.spec = {.recompute_ratio = 1.0, .check_layer = 0}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->cached_tokens, 120);
  EXPECT_EQ(r->recomputed_tokens, 120);
  EXPECT_EQ(r->computed_tokens, 13);
  const auto want = FullPrefill(*model, p.all);
  EXPECT_LT(RelError(r->logits.data(), want.data(), want.size()), 1e-5);
}

// Boundary selection recomputes each document's first K tokens at every
// layer and nothing else: K covering every document is a full prefill; a
// smaller K recomputes K per document and lands between full reuse and it.
// A segment's chunk pruned to the tokens at `kept` (as kdn/prune stores a
// document): the same KV, those tokens only.
std::shared_ptr<const kvbus::Chunk> Pruned(const kvbus::Chunk& whole, std::vector<uint32_t> kept) {
  kvbus::ChunkInfo info = whole.info();
  const size_t row = size_t{info.kv_heads} * info.head_dim * sizeof(float);
  const size_t plane = row * info.tokens;
  info.tokens = static_cast<uint32_t>(kept.size());
  info.logical_tokens = whole.info().tokens;
  info.kept = kept;
  std::vector<uint8_t> payload;
  for (uint32_t l = 0; l < info.layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const uint8_t* from = whole.payload().data() + (2 * l + kv) * plane;
      for (uint32_t t : kept) payload.insert(payload.end(), from + t * row, from + (t + 1) * row);
    }
  }
  auto c = kvbus::Chunk::Make(info, std::move(payload));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? *c : nullptr;
}

// Over a pruned segment every token keeps its position: recomputing all
// of them is a prefill of the tokens kept, each at its own position (built
// here token by token with SetNextPosition), and reusing them is not.
TEST(Blend, APrunedSegmentsTokensKeepTheirPositions) {
  auto model = MakeModel("tiny");
  Prompt p = MakePrompt(*model, 2, 40, 3);
  std::vector<uint32_t> kept;
  for (uint32_t t = 0; t < 40; ++t) {
    if (t < 4 || t % 3 == 0) kept.push_back(t);
  }
  p.segments[1].kv = Pruned(*p.segments[1].kv, kept);
  ASSERT_NE(p.segments[1].kv, nullptr);
  engine::CpuKvCache& cache = model->kv_cache();
  engine::KvSequence want_seq = cache.NewSequence();
  std::vector<float> want;
  ASSERT_TRUE(model->Prefill(want_seq, p.segments[0].tokens, {}, &want).ok());
  for (uint32_t t : kept) {
    ASSERT_TRUE(want_seq.SetNextPosition(1 + t).ok());
    ASSERT_TRUE(model->Prefill(want_seq, std::span(&p.segments[1].tokens[t], 1), {}, &want).ok());
  }
  ASSERT_TRUE(want_seq.SetNextPosition(41).ok());
  ASSERT_TRUE(model->Prefill(want_seq, p.segments[2].tokens, {}, &want).ok());
  ASSERT_TRUE(model->Prefill(want_seq, p.suffix, {}, &want).ok());

  const size_t n = kept.size();
  for (double ratio : {1.0, 0.0}) {
    engine::KvSequence seq = cache.NewSequence();
    auto r = BlendPrefill(*model, seq, p.segments, p.suffix,
                          {.spec = {.recompute_ratio = ratio, .check_layer = 0}});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->cached_tokens, static_cast<int>(n + 40));
    EXPECT_EQ(r->dropped_tokens, static_cast<int>(40 - n));
    EXPECT_EQ(seq.length(), static_cast<int64_t>(1 + n + 40 + p.suffix.size()));
    EXPECT_EQ(seq.next_position(), static_cast<int64_t>(81 + p.suffix.size()));
    const double err = RelError(r->logits.data(), want.data(), want.size());
    if (ratio == 1.0) {
      EXPECT_LT(err, 1e-5);
    } else {
      EXPECT_GT(err, 1e-3);
    }
  }
}

TEST(Blend, BoundarySelectionRecomputesEachDocumentsFirstTokens) {
  auto model = MakeModel("tiny");
  const Prompt p = MakePrompt(*model, 3, 40, 5);
  const auto full = FullPrefill(*model, p.all);
  auto blend = [&](std::string_view selection, double ratio = 0.15) {
    engine::KvSequence seq = model->kv_cache().NewSequence();
    auto r = BlendPrefill(
        *model, seq, p.segments, p.suffix,
        {.spec = {.recompute_ratio = ratio, .selection = *blend::ParseBlendSelection(selection)}});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return *r;
  };
  const BlendResult all = blend("boundary:40");
  EXPECT_EQ(all.recomputed_tokens, 120);
  EXPECT_LT(RelError(all.logits.data(), full.data(), full.size()), 1e-5);
  const BlendResult four = blend("boundary:4");
  EXPECT_EQ(four.recomputed_tokens, 12);
  EXPECT_EQ(four.kept_at_check, std::vector<int>{12});
  const BlendResult reuse = blend("deviation", 0.0);
  const double kl_four = KlDivergence(full, four.logits),
               kl_reuse = KlDivergence(full, reuse.logits);
  EXPECT_GT(kl_four, 0);
  EXPECT_LT(kl_four, kl_reuse);
  // boundary+deviation keeps the boundary rows at each check and fills the
  // budget (0.15 of 120 = 18) by deviation.
  const BlendResult both = blend("boundary+deviation:4");
  EXPECT_EQ(both.recomputed_tokens, 18);
}

// A quality target raises the ratio where deviation is spread over many
// tokens and keeps it where a few hold it.
TEST(Blend, TargetRatioClimbsWhereDeviationIsSpread) {
  std::vector<float> concentrated(20, 0.01f), spread(20, 1.0f);
  concentrated[3] = 100;
  // keep 1 of 20: the rest hold 0.19 of 100.19 / 19 of 20.
  EXPECT_NEAR(ResidualShare(concentrated, 1), 0.19 / 100.19, 1e-6);
  EXPECT_NEAR(ResidualShare(spread, 1), 0.95, 1e-6);
  EXPECT_EQ(ResidualShare(spread, 20), 0);
  EXPECT_EQ(ResidualShare(std::vector<float>(5, 0.0f), 1), 0);
  // max_kl 0.1 at 0.5 KL per residual: a residual of at most 0.2.
  EXPECT_EQ(TargetRatio(concentrated, 0.05, 0.1, 0.5), 0.05);
  // Needs 16 of 20 (0.8): 0.75 keeps 15 (residual 0.25), so 1.
  EXPECT_EQ(TargetRatio(spread, 0.05, 0.1, 0.5), 1.0);
  EXPECT_EQ(TargetRatio(spread, 0.05, 0.25, 0.5), 0.5);   // residual 0.5
  EXPECT_EQ(TargetRatio(spread, 0.15, 0.45, 0.5), 0.15);  // 0.85 * 0.5 <= 0.45: the start
  // The steeper the slope, the higher the ratio.
  EXPECT_GT(TargetRatio(spread, 0.05, 0.25, 2.0), TargetRatio(spread, 0.05, 0.25, 0.5));
}

// In a blend: a target nothing but a full prefill meets recomputes every
// token; a loose one keeps the starting ratio; the ratio used is reported.
TEST(Blend, AQualityTargetChoosesTheRatioAtTheFirstCheck) {
  auto model = MakeModel("tiny");
  const Prompt p = MakePrompt(*model, 3, 40, 6);
  auto blend = [&](double max_kl) {
    engine::KvSequence seq = model->kv_cache().NewSequence();
    auto r = BlendPrefill(*model, seq, p.segments, p.suffix,
                          {.spec = {.recompute_ratio = 0.05, .max_kl = max_kl}});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return *r;
  };
  const BlendResult tight = blend(1e-9);
  EXPECT_EQ(tight.recompute_ratio, 1.0);
  EXPECT_EQ(tight.recomputed_tokens, 120);
  EXPECT_EQ(tight.residual, 0);
  const auto full = FullPrefill(*model, p.all);
  EXPECT_LT(RelError(tight.logits.data(), full.data(), full.size()), 1e-5);
  const BlendResult loose = blend(10);
  EXPECT_EQ(loose.recompute_ratio, 0.05);
  EXPECT_EQ(loose.recomputed_tokens, 6);
  EXPECT_GT(loose.residual, 0);
  EXPECT_LT(loose.residual, 1);
  // Without a target: the request's ratio, its residual reported.
  engine::KvSequence seq = model->kv_cache().NewSequence();
  auto fixed = BlendPrefill(*model, seq, p.segments, p.suffix, {.spec = {.recompute_ratio = 0.05}});
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(fixed->recompute_ratio, 0.05);
  EXPECT_DOUBLE_EQ(fixed->residual, loose.residual);
}

TEST(Blend, RatioZeroIsFullReuse) {
  auto model = MakeModel("tiny-qwen2");
  const Prompt p = MakePrompt(*model, 3, 40, 2);
  engine::KvSequence seq = model->kv_cache().NewSequence();
  auto r = BlendPrefill(*model, seq, p.segments, p.suffix, {.spec = {.recompute_ratio = 0.0}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->recomputed_tokens, 0);

  // Full reuse by hand: BOS computed, each document's KV placed and rotated,
  // then the question prefilled on top.
  engine::CpuKvCache& cache = model->kv_cache();
  engine::KvSequence ref = cache.NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(ref, p.segments[0].tokens, {}, &logits).ok());
  for (size_t i = 1; i < p.segments.size(); ++i) {
    const int64_t at = ref.length();
    const int64_t len = static_cast<int64_t>(p.segments[i].tokens.size());
    ASSERT_TRUE(cache.Reserve(ref, at + len).ok());
    ASSERT_TRUE(kvbridge::ChunkToPagedKv(*p.segments[i].kv, cache, ref, at).ok());
    cache.SetLength(ref, at + len);
    ASSERT_TRUE(model->RotateCachedKeys(ref, at, len, at).ok());
  }
  ASSERT_TRUE(model->Prefill(ref, p.suffix, {}, &logits).ok());
  EXPECT_LT(RelError(r->logits.data(), logits.data(), logits.size()), 1e-5);
  // And reuse is not free: it differs from the full prefill.
  const auto full = FullPrefill(*model, p.all);
  EXPECT_GT(RelError(r->logits.data(), full.data(), full.size()), 1e-3);
}

// Placing layer l+1 on the loader thread while layer l computes changes
// nothing in the result, and the fused KV of layer l is final when on_layer(l)
// runs.
TEST(Blend, OverlappedLoadingGivesTheSameResultAndLayersInOrder) {
  auto model = MakeModel("tiny");
  const Prompt p = MakePrompt(*model, 4, 40, 3);
  for (double ratio : {0.0, 0.3}) {
    std::vector<std::vector<float>> logits;
    std::vector<std::vector<float>> last_key;  // the last token's K at each layer, as pushed
    for (bool overlap : {false, true}) {
      engine::KvSequence seq = model->kv_cache().NewSequence();
      std::vector<int> layers;
      std::vector<float> keys;
      BlendOptions o{.spec = {.recompute_ratio = ratio, .check_layer = 1}, .overlap_load = overlap};
      o.on_layer = [&](int l) -> Status {
        layers.push_back(l);
        const float* k = model->kv_cache().KeyAt(seq, l, 41);  // inside document 2
        keys.insert(keys.end(), k, k + model->kv_cache().token_stride());
        return Status::Ok();
      };
      auto r = BlendPrefill(*model, seq, p.segments, p.suffix, o);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      std::vector<int> want(model->config().num_layers);
      std::iota(want.begin(), want.end(), 0);
      EXPECT_EQ(layers, want);
      // What on_layer saw is what the cache holds at the end.
      const int64_t stride = model->kv_cache().token_stride();
      for (int l = 0; l < model->config().num_layers; ++l) {
        EXPECT_EQ(std::memcmp(keys.data() + l * stride, model->kv_cache().KeyAt(seq, l, 41),
                              stride * sizeof(float)),
                  0)
            << "layer " << l;
      }
      logits.push_back(r->logits);
      last_key.push_back(keys);
    }
    EXPECT_EQ(logits[0], logits[1]) << "ratio " << ratio;
    EXPECT_EQ(last_key[0], last_key[1]) << "ratio " << ratio;
  }
}

TEST(Blend, AnOnLayerErrorStopsTheBlendAndFreesTheSequence) {
  auto model = MakeModel("tiny");
  const Prompt p = MakePrompt(*model, 2, 40, 4);
  const int free_before = model->kv_cache().free_blocks();
  engine::KvSequence seq = model->kv_cache().NewSequence();
  BlendOptions o;
  o.on_layer = [](int l) { return l == 1 ? Unavailable("decode worker gone") : Status::Ok(); };
  auto r = BlendPrefill(*model, seq, p.segments, p.suffix, o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(seq.length(), 0);
  EXPECT_EQ(model->kv_cache().free_blocks(), free_before);
}

// The point of CacheBlend: recomputing the tokens whose KV deviates most
// brings the next-token distribution closer to the full prefill's than
// recomputing as many tokens chosen at random.
TEST(Blend, DeviationChosenTokensBeatRandomOnesAtFifteenPercent) {
  double kl_dev_sum = 0, kl_rand_sum = 0;
  int wins = 0, runs = 0;
  for (uint64_t model_seed : {1, 2, 3}) {
    auto model = MakeModel("small", model_seed, {.kv_tokens = 4096, .threads = 1});
    for (uint32_t prompt_seed : {1, 2}) {
      const Prompt p = MakePrompt(*model, 4, 64, prompt_seed);
      const auto full = FullPrefill(*model, p.all);
      engine::KvSequence a = model->kv_cache().NewSequence();
      auto dev = BlendPrefill(*model, a, p.segments, p.suffix, {.spec = {.recompute_ratio = 0.15}});
      engine::KvSequence b = model->kv_cache().NewSequence();
      auto rnd =
          BlendPrefill(*model, b, p.segments, p.suffix,
                       {.spec = {.recompute_ratio = 0.15,
                                 .selection = {.kind = blend::BlendSelection::Kind::kRandom}},
                        .seed = prompt_seed});
      ASSERT_TRUE(dev.ok() && rnd.ok());
      ASSERT_EQ(dev->recomputed_tokens, rnd->recomputed_tokens);
      const double kd = KlDivergence(full, dev->logits), kr = KlDivergence(full, rnd->logits);
      kl_dev_sum += kd;
      kl_rand_sum += kr;
      wins += kd < kr;
      ++runs;
      std::printf("model seed %llu, prompt seed %u: KL deviation %.3g, random %.3g\n",
                  static_cast<unsigned long long>(model_seed), prompt_seed, kd, kr);
    }
  }
  EXPECT_LT(kl_dev_sum, kl_rand_sum);
  EXPECT_GT(wins, runs / 2);
}

// One check given as a list is kdn's one-layer choice, exactly.
TEST(Blend, ProgressiveWithOneCheckIsTheOneLayerChoice) {
  auto model = MakeModel("small", 1, {.kv_tokens = 2048, .threads = 1});
  const Prompt p = MakePrompt(*model, 3, 48, 5);
  engine::KvSequence a = model->kv_cache().NewSequence();
  auto one = BlendPrefill(*model, a, p.segments, p.suffix,
                          {.spec = {.recompute_ratio = 0.3, .check_layer = 2}});
  engine::KvSequence b = model->kv_cache().NewSequence();
  auto listed =
      BlendPrefill(*model, b, p.segments, p.suffix,
                   {.spec = {.recompute_ratio = 0.3, .check_layers = {2}, .check_ratios = {0.3}}});
  ASSERT_TRUE(one.ok() && listed.ok());
  EXPECT_EQ(one->logits, listed->logits);
  EXPECT_EQ(listed->kept_at_check, std::vector<int>{44});  // ceil(0.3 * 144)
}

// Each check keeps its share of the cached tokens, the last the target
// ratio; the result is not the one-layer choice's at that ratio.
TEST(Blend, ProgressiveFilteringNarrowsAtEachCheck) {
  auto model = MakeModel("small", 2, {.kv_tokens = 2048, .threads = 1});
  const Prompt p = MakePrompt(*model, 4, 50, 6);  // 200 cached tokens
  engine::KvSequence a = model->kv_cache().NewSequence();
  auto prog = BlendPrefill(
      *model, a, p.segments, p.suffix,
      {.spec = {
           .recompute_ratio = 0.15, .check_layers = {1, 3, 5}, .check_ratios = {0.5, 0.3, 0.15}}});
  ASSERT_TRUE(prog.ok()) << prog.status().ToString();
  EXPECT_EQ(prog->kept_at_check, (std::vector<int>{100, 60, 30}));
  EXPECT_EQ(prog->recomputed_tokens, 30);
  EXPECT_EQ(prog->cached_tokens, 200);
  engine::KvSequence b = model->kv_cache().NewSequence();
  auto one = BlendPrefill(*model, b, p.segments, p.suffix, {.spec = {.recompute_ratio = 0.15}});
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->recomputed_tokens, 30);
  EXPECT_GT(RelError(prog->logits.data(), one->logits.data(), one->logits.size()), 1e-6);
  // The default ratios when none are given: 0.3, 0.225, 0.15 of 200.
  engine::KvSequence c = model->kv_cache().NewSequence();
  auto dflt = BlendPrefill(*model, c, p.segments, p.suffix,
                           {.spec = {.recompute_ratio = 0.15, .check_layers = {1, 3, 5}}});
  ASSERT_TRUE(dflt.ok());
  EXPECT_EQ(dflt->kept_at_check, (std::vector<int>{60, 45, 30}));
}

TEST(Blend, ProgressiveAtRatioOneIsAFullPrefill) {
  auto model = MakeModel("tiny");
  const Prompt p = MakePrompt(*model, 3, 40, 7);
  engine::KvSequence seq = model->kv_cache().NewSequence();
  auto r = BlendPrefill(
      *model, seq, p.segments, p.suffix,
      {.spec = {.recompute_ratio = 1.0, .check_layers = {0, 1}, .check_ratios = {1, 1}}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->recomputed_tokens, 120);
  const auto want = FullPrefill(*model, p.all);
  EXPECT_LT(RelError(r->logits.data(), want.data(), want.size()), 1e-5);
}

// A check keeps every uncached row and the cached ones with the largest
// deviation, as indices into the rows still recomputed.
TEST(Blend, DeviationRowsKeepUncachedRowsAndTheLargestDeviations) {
  //                   position: 0     1     2     3     4     5     6     7
  const std::vector<bool> cached{false, true, true, true, true, true, true, false};
  // After an earlier check: rows at positions 0, 2, 3, 5, 6, 7.
  const std::vector<int64_t> positions{0, 2, 3, 5, 6, 7};
  const std::vector<float> deviation{9, 1, 5, 4, 5, 0};
  auto in = [&](int64_t keep, uint64_t seed = 0) {
    return SelectionInput{.positions = positions,
                          .cached = cached,
                          .deviation = deviation,
                          .keep = keep,
                          .seed = seed};
  };
  EXPECT_EQ(DeviationRows(in(2)), (std::vector<int64_t>{0, 2, 4, 5}));  // ties to the earlier row
  EXPECT_EQ(DeviationRows(in(0)), (std::vector<int64_t>{0, 5}));
  EXPECT_EQ(DeviationRows(in(9)), (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  const auto rnd = RandomRows(in(3, 7));
  ASSERT_EQ(rnd.size(), 5u);
  EXPECT_EQ(rnd.front(), 0);
  EXPECT_EQ(rnd.back(), 5);
  EXPECT_TRUE(std::is_sorted(rnd.begin(), rnd.end()));
  EXPECT_EQ(rnd, RandomRows(in(3, 7)));
  // PolicyFor gives the same functions by name.
  EXPECT_EQ(PolicyFor({})(in(2)), DeviationRows(in(2)));
  EXPECT_EQ(PolicyFor(*blend::ParseBlendSelection("random"))(in(3, 7)), rnd);
}

// EPIC's choice: the first K tokens of each document, whatever the
// deviation and the budget; with deviation, the budget's rest by deviation.
TEST(Blend, BoundaryRowsAreEachDocumentsFirstTokens) {
  // A head (0-1), documents at 2-6 and 7-9, a question (10-11).
  std::vector<bool> cached(12, false);
  for (int p = 2; p < 10; ++p) cached[static_cast<size_t>(p)] = true;
  const std::vector<DocumentSpan> docs{{2, 5}, {7, 3}};
  std::vector<int64_t> all(12);
  std::iota(all.begin(), all.end(), 0);
  //                                 0  1  2  3  4  5  6  7  8  9  10 11
  const std::vector<float> deviation{0, 0, 1, 2, 9, 8, 3, 0, 7, 6, 0, 0};
  SelectionInput in{.positions = all, .cached = cached, .documents = docs, .keep = 0};
  // K = 2: positions 2, 3 and 7, 8; uncached rows always.
  EXPECT_EQ(BoundaryRows(in, 2), (std::vector<int64_t>{0, 1, 2, 3, 7, 8, 10, 11}));
  // K past a document's length: all of it, nothing of the next one's span.
  EXPECT_EQ(BoundaryRows(in, 4), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11}));
  in.deviation = deviation;
  in.keep = 6;  // 4 boundary rows (K = 2), then the 2 largest deviations of the rest: 4, 5
  EXPECT_EQ(BoundaryDeviationRows(in, 2), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 7, 8, 10, 11}));
  in.keep = 2;  // under the boundary's count: the boundary rows alone
  EXPECT_EQ(BoundaryDeviationRows(in, 2), (std::vector<int64_t>{0, 1, 2, 3, 7, 8, 10, 11}));
  // After a check, among the rows still recomputed (positions, not rows).
  const std::vector<int64_t> later{0, 3, 4, 8, 9, 10, 11};
  const std::vector<float> later_dev{0, 5, 1, 2, 9, 0, 0};
  SelectionInput after{
      .positions = later, .cached = cached, .deviation = later_dev, .documents = docs, .keep = 3};
  // Boundary positions 3 and 8 (rows 1, 3), then the largest of the rest: row 4.
  EXPECT_EQ(BoundaryDeviationRows(after, 2), (std::vector<int64_t>{0, 1, 3, 4, 5, 6}));
  auto name = [](std::string_view t) {
    return blend::BlendSelectionName(*blend::ParseBlendSelection(t));
  };
  EXPECT_EQ(PolicyFor(*blend::ParseBlendSelection("boundary:2"))(in), BoundaryRows(in, 2));
  EXPECT_EQ(name("boundary+deviation"), "boundary+deviation:8");
  EXPECT_EQ(name("boundary:4"), "boundary:4");
  for (const char* bad :
       {"boundary:0", "boundary:x", "boundary:", "deviation:3", "epic", "boundary:100000"}) {
    EXPECT_EQ(blend::ParseBlendSelection(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

TEST(CheckSchedule, OneCheckWithoutLayersAndDefaultRatiosWithThem) {
  auto one = blend::CheckSchedule(0.15, 2, {}, {}, 30);
  ASSERT_TRUE(one.ok());
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0].layer, 2);
  EXPECT_EQ((*one)[0].ratio, 0.15);
  const std::vector<int> layers{1, 4, 8};
  auto prog = blend::CheckSchedule(0.15, 1, layers, {}, 30);
  ASSERT_TRUE(prog.ok());
  ASSERT_EQ(prog->size(), 3u);
  EXPECT_EQ((*prog)[2].layer, 8);
  EXPECT_NEAR((*prog)[0].ratio, 0.3, 1e-12);
  EXPECT_NEAR((*prog)[1].ratio, 0.225, 1e-12);
  EXPECT_NEAR((*prog)[2].ratio, 0.15, 1e-12);
  EXPECT_EQ(blend::DefaultCheckRatios(0.7, 2), (std::vector<double>{1.0, 0.7}));
}

TEST(CheckSchedule, RefusesBadLayersAndRatios) {
  auto bad = [](double ratio, std::vector<int> layers, std::vector<double> ratios) {
    auto r = blend::CheckSchedule(ratio, 1, layers, ratios, 10);
    return !r.ok() && r.status().code() == StatusCode::kInvalidArgument;
  };
  EXPECT_TRUE(bad(0.15, {2, 2}, {}));   // not ascending
  EXPECT_TRUE(bad(0.15, {1, 10}, {}));  // past the last layer
  EXPECT_TRUE(bad(0.15, {-1, 3}, {}));
  EXPECT_TRUE(bad(0.15, {1, 3}, {0.15, 0.3}));  // increasing
  EXPECT_TRUE(bad(0.15, {1, 3}, {0.3, 0.2}));   // last is not the target
  EXPECT_TRUE(bad(0.15, {1, 3}, {0.15}));       // one ratio short
  EXPECT_TRUE(bad(0.15, {}, {0.15}));           // ratios without layers
  EXPECT_TRUE(bad(1.5, {1, 3}, {}));
  EXPECT_FALSE(bad(0.15, {1, 3}, {0.3, 0.15}));
  EXPECT_FALSE(bad(0.0, {1, 3}, {}));
}

TEST(Blend, RefusesBadSettingsAndMismatchedKv) {
  auto model = MakeModel("tiny");
  Prompt p = MakePrompt(*model, 1, 20, 3);
  engine::KvSequence seq = model->kv_cache().NewSequence();
  EXPECT_EQ(BlendPrefill(*model, seq, p.segments, p.suffix, {.spec = {.recompute_ratio = 1.5}})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      BlendPrefill(*model, seq, p.segments, p.suffix, {.spec = {.check_layer = 2}}).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(BlendPrefill(*model, seq, p.segments, p.suffix, {.spec = {.check_layers = {0, 2}}})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(BlendPrefill(*model, seq, p.segments, {}, {}).status().code(),
            StatusCode::kInvalidArgument);
  p.segments[1].tokens.push_back(5);  // the KV no longer fits its segment
  EXPECT_EQ(BlendPrefill(*model, seq, p.segments, p.suffix, {}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(seq.length(), 0);
}

}  // namespace
}  // namespace kdn::blend
