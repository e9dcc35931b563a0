#include "kdn/prune/prune.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "kdn/testing/tiny_model.h"
#include "kdn/engine/cpu_ops.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/prune/expected_attention.h"

namespace kdn::prune {
namespace {

using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;
using kdn::testing::RelError;

TEST(QueryStats, APrefillInPiecesSumsWhatOneCallSums) {
  auto model = MakeModel("tiny");
  const auto& c = model->config();
  const auto tokens = RandomTokens(50, c.vocab_size, 1);
  engine::QueryStats one{.skip = 4}, pieces{.skip = 4};
  engine::KvSequence a = model->kv_cache().NewSequence(), b = model->kv_cache().NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(a, tokens, {.on_queries = one.Hook(model->config())}, &logits).ok());
  // The first piece ends inside the sinks, so its rows are partly skipped.
  ASSERT_TRUE(model
                  ->Prefill(b, std::span(tokens).first(3),
                            {.on_queries = pieces.Hook(model->config())}, &logits)
                  .ok());
  ASSERT_TRUE(model
                  ->Prefill(b, std::span(tokens).subspan(3, 30),
                            {.on_queries = pieces.Hook(model->config())}, &logits)
                  .ok());
  ASSERT_TRUE(model
                  ->Prefill(b, std::span(tokens).subspan(33),
                            {.on_queries = pieces.Hook(model->config())}, &logits)
                  .ok());
  EXPECT_EQ(one.count, 46);
  EXPECT_EQ(pieces.count, 46);
  ASSERT_EQ(one.sum.size(), size_t(c.num_layers) * c.num_heads * c.head_dim);
  ASSERT_EQ(one.outer.size(), one.sum.size() * c.head_dim);
  double scale = 0, err = 0;
  for (size_t i = 0; i < one.outer.size(); ++i) {
    scale = std::max(scale, std::fabs(one.outer[i]));
    err = std::max(err, std::fabs(one.outer[i] - pieces.outer[i]));
  }
  EXPECT_GT(scale, 0);
  EXPECT_LT(err / scale, 1e-5);
  // Every diagonal entry of a sum of q q^T is a sum of squares.
  for (size_t i = 0; i < one.sum.size(); ++i) {
    EXPECT_GE(one.outer[i * c.head_dim + i % c.head_dim], 0.0);
  }
}

// Expected Attention's closed form against a Monte Carlo estimate of the
// attention Gaussian queries pay. With one future position the averaged
// rotation is that position's exactly, so E[exp(R q . k / sqrt(d))] over q ~
// N(mu, S) is the closed form's exponent, exactly.
TEST(ExpectedAttention, ScoresAreTheExpectedAttentionOfGaussianQueries) {
  auto model = MakeModel("tiny");
  const auto& c = model->config();
  const int hd = c.head_dim, H = c.num_heads, G = c.num_kv_heads, group = H / G;
  const int sinks = 2;
  const int64_t T = 12;
  engine::CpuKvCache& cache = model->kv_cache();
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, T).ok());
  cache.SetLength(seq, T);
  std::mt19937 rng(5);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int l = 0; l < c.num_layers; ++l) {
    for (int64_t t = 0; t < T; ++t) {
      for (int i = 0; i < c.kv_dim(); ++i) {
        cache.KeyAt(seq, l, t)[i] = static_cast<float>(0.3 * normal(rng));
        cache.ValueAt(seq, l, t)[i] = static_cast<float>(normal(rng));
      }
    }
  }
  // Per head: a mean and a covariance L L^T of small entries.
  const int64_t rows = 1000;
  engine::QueryStats stats{.skip = sinks, .count = rows};
  stats.sum.assign(size_t(c.num_layers) * H * hd, 0.0);
  stats.outer.assign(stats.sum.size() * hd, 0.0);
  std::vector<std::vector<double>> mus, chols;  // [layer * H + h]
  for (int l = 0; l < c.num_layers; ++l) {
    for (int h = 0; h < H; ++h) {
      std::vector<double> mu(hd), L(size_t(hd) * hd, 0.0);
      for (double& m : mu) m = normal(rng);
      for (int i = 0; i < hd; ++i) {
        for (int j = 0; j <= i; ++j) L[i * hd + j] = 0.25 * normal(rng) / std::sqrt(hd);
      }
      const size_t at = (size_t(l) * H + h) * hd;
      for (int i = 0; i < hd; ++i) {
        stats.sum[at + i] = mu[i] * rows;
        for (int j = 0; j < hd; ++j) {
          double s = 0;
          for (int k = 0; k < hd; ++k) s += L[i * hd + k] * L[j * hd + k];
          stats.outer[at * hd + i * hd + j] = (s + mu[i] * mu[j]) * rows;
        }
      }
      mus.push_back(mu);
      chols.push_back(L);
    }
  }
  auto scores =
      ExpectedAttentionScores(c, cache, seq, T, stats, {.sinks = sinks, .future_positions = 1});
  ASSERT_TRUE(scores.ok()) << scores.status().ToString();

  // Monte Carlo: draw q, rotate it as the engine does for position T, and
  // average exp(q . k / sqrt(d)).
  const std::vector<float> inv_freq = engine::RopeInvFreq(c);
  const engine::RopeParams rope = engine::RopeParamsFor(c);
  std::vector<float> cs(hd / 2), sn(hd / 2);
  for (int i = 0; i < hd / 2; ++i) {
    const double a = engine::RopeAngle(rope, inv_freq.data(), i, T);
    cs[i] = static_cast<float>(std::cos(a)) * rope.attention_scaling;
    sn[i] = static_cast<float>(std::sin(a)) * rope.attention_scaling;
  }
  const int draws = 20000;
  for (int l = 0; l < c.num_layers; ++l) {
    for (int g = 0; g < G; ++g) {
      std::vector<double> mc(T, 0.0);
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const auto& mu = mus[l * H + h];
        const auto& L = chols[l * H + h];
        std::vector<double> e(T, 0.0);
        std::vector<float> q(hd);
        std::vector<double> z(hd);
        for (int n = 0; n < draws; ++n) {
          for (double& x : z) x = normal(rng);
          for (int i = 0; i < hd; ++i) {
            double v = mu[i];
            for (int k = 0; k <= i; ++k) v += L[i * hd + k] * z[k];
            q[i] = static_cast<float>(v);
          }
          engine::RotateByAngles(q.data(), 1, hd, cs.data(), sn.data());
          for (int64_t t = sinks; t < T; ++t) {
            const float* k = cache.KeyAt(seq, l, t) + g * hd;
            double dot = 0;
            for (int i = 0; i < hd; ++i) dot += double{q[i]} * k[i];
            e[t] += std::exp(dot / std::sqrt(hd)) / draws;
          }
        }
        double total = 0;
        for (int64_t t = sinks; t < T; ++t) total += e[t];
        for (int64_t t = sinks; t < T; ++t) mc[t] += e[t] / total / group;
      }
      float best = 0;
      for (int64_t t = sinks; t < T; ++t) {
        const float* v = cache.ValueAt(seq, l, t) + g * hd;
        double norm = 0;
        for (int i = 0; i < hd; ++i) norm += double{v[i]} * v[i];
        const double want = mc[t] * std::sqrt(norm);
        EXPECT_NEAR(scores->at(l, g, t), want, 0.02 * want) << "layer " << l << " head " << g;
        best = std::max(best, scores->at(l, g, t));
      }
      for (int t = 0; t < sinks; ++t) EXPECT_GT(scores->at(l, g, t), best);
    }
  }
}

TEST(ExpectedAttention, RefusesStatisticsThatDoNotFitTheContext) {
  auto model = MakeModel("tiny");
  engine::KvSequence seq = model->kv_cache().NewSequence();
  const auto tokens = RandomTokens(20, 256, 2);
  engine::QueryStats stats{.skip = 4};
  std::vector<float> logits;
  ASSERT_TRUE(
      model->Prefill(seq, tokens, {.on_queries = stats.Hook(model->config())}, &logits).ok());
  const auto& c = model->config();
  auto& kv = model->kv_cache();
  EXPECT_TRUE(ExpectedAttentionScores(c, kv, seq, 20, stats).ok());
  EXPECT_FALSE(ExpectedAttentionScores(c, kv, seq, 20, stats, {.sinks = 2}).ok());
  EXPECT_FALSE(ExpectedAttentionScores(c, kv, seq, 21, stats).ok());
  EXPECT_FALSE(ExpectedAttentionScores(c, kv, seq, 4, stats).ok());
  EXPECT_FALSE(ExpectedAttentionScores(c, kv, seq, 20, engine::QueryStats{.skip = 4}).ok());
}

Scores Ramp(int layers, int heads, int64_t tokens) {
  Scores s{layers, heads, tokens, std::vector<float>(size_t(layers) * heads * tokens)};
  std::mt19937 rng(3);
  for (float& v : s.v) v = std::uniform_real_distribution<float>(0, 1)(rng);
  return s;
}

TEST(SelectKept, KeepsTheSinksAndTheBestOfEachHeadLayerOrTheWhole) {
  const Scores s = Ramp(3, 2, 40);
  for (Granularity g : {Granularity::kToken, Granularity::kLayer, Granularity::kHead}) {
    auto k = SelectKept(s, 0.25, 4, g);
    ASSERT_TRUE(k.ok()) << k.status().ToString();
    EXPECT_EQ(k->kept, 10);
    EXPECT_EQ(k->logical, 40);
    for (int l = 0; l < 3; ++l) {
      for (int h = 0; h < 2; ++h) {
        const int32_t* idx = k->of(l, h);
        for (int t = 0; t < 4; ++t) EXPECT_EQ(idx[t], t);
        for (int j = 1; j < 10; ++j) EXPECT_LT(idx[j - 1], idx[j]);
        if (g == Granularity::kHead) {
          // No dropped token outscores a kept non-sink one.
          std::set<int32_t> kept(idx, idx + 10);
          float worst_kept = 2, best_dropped = -1;
          for (int32_t t = 4; t < 40; ++t) {
            (kept.count(t) ? worst_kept = std::min(worst_kept, s.at(l, h, t))
                           : best_dropped = std::max(best_dropped, s.at(l, h, t)));
          }
          EXPECT_GT(worst_kept, best_dropped);
        }
        if (g != Granularity::kHead) {
          EXPECT_TRUE(std::equal(idx, idx + 10, k->of(l, 0)));
        }
        if (g == Granularity::kToken) {
          EXPECT_TRUE(std::equal(idx, idx + 10, k->of(0, 0)));
        }
      }
    }
  }
  EXPECT_EQ(SelectKept(s, 1.0, 4, Granularity::kHead)->kept, 40);
  EXPECT_EQ(SelectKept(s, 0.01, 4, Granularity::kHead)->kept, 5);  // the sinks and one more
  EXPECT_FALSE(SelectKept(s, 0.0, 4, Granularity::kHead).ok());
  EXPECT_FALSE(SelectKept(s, 1.5, 4, Granularity::kHead).ok());
  EXPECT_FALSE(SelectKept(s, 0.5, 40, Granularity::kHead).ok());
  EXPECT_FALSE(ParseGranularity("block").ok());
  EXPECT_EQ(*ParseGranularity("layer"), Granularity::kLayer);
}

TEST(CompactKv, EachHeadsSlotsHoldItsKeptTokensAndTheNextPositionIsTheContexts) {
  auto model = MakeModel("tiny-mistral");
  const auto& c = model->config();
  engine::CpuKvCache& cache = model->kv_cache();
  const auto context = RandomTokens(45, c.vocab_size, 8),
             question = RandomTokens(9, c.vocab_size, 9);
  engine::KvSequence full = cache.NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(full, context, {}, &logits).ok());
  auto kept = SelectKept(Ramp(c.num_layers, c.num_kv_heads, 45), 0.5, 4, Granularity::kHead);
  ASSERT_TRUE(kept.ok());
  engine::KvSequence pruned = cache.NewSequence();
  ASSERT_TRUE(CompactKv(cache, full, *kept, &pruned).ok());
  EXPECT_EQ(pruned.length(), 22);
  EXPECT_EQ(pruned.next_position(), 45);
  const int hd = c.head_dim;
  for (int l = 0; l < c.num_layers; ++l) {
    for (int g = 0; g < c.num_kv_heads; ++g) {
      for (int64_t j = 0; j < kept->kept; ++j) {
        const int32_t t = kept->of(l, g)[j];
        EXPECT_EQ(std::memcmp(cache.KeyAt(pruned, l, j) + g * hd, cache.KeyAt(full, l, t) + g * hd,
                              hd * sizeof(float)),
                  0);
        EXPECT_EQ(std::memcmp(cache.ValueAt(pruned, l, j) + g * hd,
                              cache.ValueAt(full, l, t) + g * hd, hd * sizeof(float)),
                  0);
      }
    }
  }
  // Keeping every token changes nothing: the question's logits are the
  // full context's.
  auto all = SelectKept(Ramp(c.num_layers, c.num_kv_heads, 45), 1.0, 4, Granularity::kToken);
  engine::KvSequence same = cache.NewSequence();
  ASSERT_TRUE(CompactKv(cache, full, *all, &same).ok());
  std::vector<float> a, b;
  ASSERT_TRUE(model->Prefill(full, question, {.all_logits = true}, &a).ok());
  ASSERT_TRUE(model->Prefill(same, question, {.all_logits = true}, &b).ok());
  EXPECT_EQ(a, b);
  // A sequence that holds KV is refused.
  EXPECT_EQ(CompactKv(cache, full, *kept, &same).code(), StatusCode::kInvalidArgument);
}

// A pruned chunk, through its bytes as another process reads them, gives
// the question the logits the compacted KV in memory gives it.
TEST(PrunedChunk, ReadBackItAnswersAsTheCompactedKvInMemory) {
  auto model = MakeModel("tiny");
  const auto& c = model->config();
  engine::CpuKvCache& cache = model->kv_cache();
  const auto context = RandomTokens(70, c.vocab_size, 10),
             question = RandomTokens(8, c.vocab_size, 11);
  engine::KvSequence whole = cache.NewSequence();
  engine::QueryStats stats{.skip = 4};
  std::vector<float> logits;
  ASSERT_TRUE(
      model->Prefill(whole, context, {.on_queries = stats.Hook(model->config())}, &logits).ok());
  auto scores = ExpectedAttentionScores(c, cache, whole, 70, stats);
  ASSERT_TRUE(scores.ok());
  auto kept = SelectKept(*scores, 0.3, 4, Granularity::kToken);
  ASSERT_TRUE(kept.ok());
  engine::KvSequence pruned = cache.NewSequence();
  ASSERT_TRUE(CompactKv(cache, whole, *kept, &pruned).ok());
  const std::vector<uint32_t> offsets(kept->of(0, 0), kept->of(0, 0) + kept->kept);
  auto chunk = kvbridge::PrunedChunkFromPagedKv(cache, pruned, 70, offsets, {1, 2}, {3, 4},
                                                kdn::DType::kF32);
  ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
  auto read =
      kvbus::Chunk::Parse(std::vector<uint8_t>((*chunk)->bytes().begin(), (*chunk)->bytes().end()));
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ((*read)->info().logical(), 70u);
  EXPECT_EQ((*read)->info().kept, offsets);
  engine::KvSequence loaded = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(loaded, (*read)->info().tokens).ok());
  ASSERT_TRUE(kvbridge::ChunkToPagedKv(**read, cache, loaded, 0).ok());
  cache.SetLength(loaded, (*read)->info().tokens);
  ASSERT_TRUE(loaded.SetNextPosition((*read)->info().logical()).ok());
  std::vector<float> a, b;
  ASSERT_TRUE(model->Prefill(pruned, question, {.all_logits = true}, &a).ok());
  ASSERT_TRUE(model->Prefill(loaded, question, {.all_logits = true}, &b).ok());
  EXPECT_EQ(a, b);
  // Pruning did change the answer's distribution (the test would pass
  // trivially otherwise): the whole KV gives other logits.
  std::vector<float> full;
  ASSERT_TRUE(model->Prefill(whole, question, {.all_logits = true}, &full).ok());
  EXPECT_GT(RelError(full.data(), a.data(), a.size()), 1e-4);
  // A sequence whose next position is not the logical length is refused.
  EXPECT_FALSE(
      kvbridge::PrunedChunkFromPagedKv(cache, whole, 70, offsets, {1, 2}, {3, 4}, kdn::DType::kF32)
          .ok());
}

}  // namespace
}  // namespace kdn::prune
