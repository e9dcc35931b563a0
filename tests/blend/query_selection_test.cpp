// The query selections (docs/blend.md, "Selection policies"): the policies
// on hand-made attention, QuestionAttention against a plain computation of
// the same weights, and blends that recompute by the question's attention.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include "blend_prompts.h"
#include "kdn/blend/blend.h"
#include "kdn/engine/cpu_ops.h"
#include "kdn/testing/tiny_model.h"

namespace kdn::blend {
namespace {

using kdn::testing::MakeModel;
using kdn::testing::RelError;

// A head (0-1), documents at 2-6 and 7-9, a question (10-11).
struct Layout {
  std::vector<bool> cached = std::vector<bool>(12, false);
  std::vector<DocumentSpan> docs{{2, 5}, {7, 3}};
  std::vector<int64_t> all = std::vector<int64_t>(12);
  Layout() {
    for (int p = 2; p < 10; ++p) cached[static_cast<size_t>(p)] = true;
    std::iota(all.begin(), all.end(), 0);
  }
};

TEST(QuerySelection, TheBudgetGoesToTheTokensTheQuestionAttendsTo) {
  const Layout l;
  //                                 0  1  2  3  4  5  6  7  8  9  10 11
  const std::vector<float> attention{0, 0, 1, 7, 9, 3, 2, 8, 0, 6, 0, 0};
  SelectionInput in{.positions = l.all,
                    .cached = l.cached,
                    .documents = l.docs,
                    .keep = 3,
                    .attention = attention};
  // The 3 most attended cached positions (4, 7, 3), uncached rows always.
  EXPECT_EQ(QueryRows(in), (std::vector<int64_t>{0, 1, 3, 4, 7, 10, 11}));
  // Boundary K = 1 (positions 2 and 7), then the most attended of the rest: 4.
  EXPECT_EQ(QueryBoundaryRows(in, 1), (std::vector<int64_t>{0, 1, 2, 4, 7, 10, 11}));
  // A document the question ignores gets none of the budget.
  const std::vector<float> one_doc{0, 0, 1, 5, 4, 3, 2, 0, 0, 0, 0, 0};
  in.attention = one_doc;
  in.keep = 5;
  EXPECT_EQ(QueryRows(in), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 10, 11}));
  EXPECT_EQ(PolicyFor(*ParseBlendSelection("query"))(in), QueryRows(in));
  EXPECT_EQ(PolicyFor(*ParseBlendSelection("query+boundary:1"))(in), QueryBoundaryRows(in, 1));
  EXPECT_EQ(BlendSelectionName(*ParseBlendSelection("query+boundary")), "query+boundary:8");
  EXPECT_FALSE(ParseBlendSelection("query")->checks());
  EXPECT_EQ(ParseBlendSelection("query:3").status().code(), StatusCode::kInvalidArgument);
}

// The question over the documents' KV as a full-reuse blend fuses it, its
// attention computed plainly (one dot product and exp at a time): what
// QuestionAttention gives, slot for slot.
TEST(QuerySelection, QuestionAttentionIsTheQuestionsSoftmaxWeightsSummed) {
  auto model = MakeModel("tiny");
  const model::ModelConfig& c = model->config();
  Prompt p = MakePrompt(*model, 3, 24, 11);
  p.segments.erase(p.segments.begin());  // documents only: every slot cached
  const int64_t held = 72, rows = static_cast<int64_t>(p.suffix.size());
  std::vector<PlacedSegment> placed;
  for (int i = 0; i < 3; ++i) placed.push_back({p.segments[i].kv.get(), 24 * i, 24, 24 * i});
  auto got = QuestionAttention(*model, placed, held + rows, p.suffix, held);
  ASSERT_TRUE(got.ok()) << got.status().ToString();

  engine::KvSequence seq = model->kv_cache().NewSequence();
  ASSERT_TRUE(
      BlendPrefill(*model, seq, p.segments, p.suffix, {.spec = {.recompute_ratio = 0}}).ok());
  seq.Truncate(held);
  std::vector<std::vector<float>> q(static_cast<size_t>(c.num_layers));
  std::vector<int32_t> pos;
  engine::PrefillOptions po;
  po.on_queries = [&](int layer, const float* x, int64_t n, const int32_t* at) {
    q[static_cast<size_t>(layer)].assign(x, x + n * c.q_dim());
    if (layer == 0) pos.assign(at, at + n);
  };
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, p.suffix, po, &logits).ok());
  const std::vector<float> inv_freq = engine::RopeInvFreq(c);
  std::vector<double> want(static_cast<size_t>(held + rows), 0.0);
  const int hd = c.head_dim, group = c.num_heads / c.num_kv_heads;
  const int64_t keys = held + rows;
  std::vector<float> kv(static_cast<size_t>(2 * keys * c.kv_dim()));
  for (int l = 0; l < c.num_layers; ++l) {
    ASSERT_TRUE(model->kv_cache()
                    .Read(seq, l, 0, keys, DType::kF32,
                          {reinterpret_cast<uint8_t*>(kv.data()), kv.size() * sizeof(float)})
                    .ok());
    std::vector<float>& ql = q[static_cast<size_t>(l)];
    engine::ApplyRope(ql.data(), rows, c.num_heads, hd, pos.data(), inv_freq.data(),
                      engine::RopeParamsFor(c));
    for (int h = 0; h < c.num_heads; ++h) {
      const int g = h / group;
      for (int64_t r = 0; r < rows; ++r) {
        std::vector<double> s(static_cast<size_t>(held + r + 1));
        double top = -1e300, z = 0;
        for (int64_t j = 0; j <= held + r; ++j) {
          double dot = 0;
          for (int d = 0; d < hd; ++d) {
            dot += double{ql[r * c.q_dim() + h * hd + d]} * kv[j * c.kv_dim() + g * hd + d];
          }
          s[static_cast<size_t>(j)] = dot / std::sqrt(double(hd));
          top = std::max(top, s[static_cast<size_t>(j)]);
        }
        for (double& v : s) z += (v = std::exp(v - top));
        for (int64_t j = 0; j < held; ++j) want[static_cast<size_t>(j)] += s[j] / z;
      }
    }
  }
  ASSERT_EQ(got->size(), want.size());
  double total = 0;
  for (size_t j = 0; j < want.size(); ++j) {
    EXPECT_NEAR((*got)[j], want[j], 1e-4 * (1 + want[j])) << "slot " << j;
    total += (*got)[j];
  }
  // Every row of every head and layer spreads 1 over the documents and the
  // question's own tokens: less than that total reaches the documents.
  EXPECT_GT(total, 0);
  EXPECT_LT(total, double(rows) * c.num_heads * c.num_layers);
  for (int64_t j = held; j < held + rows; ++j) EXPECT_EQ((*got)[j], 0.0f) << "uncached " << j;
}

TEST(QuerySelection, ABlendRecomputesItsBudgetByTheQuestionAndCountsItsPass) {
  auto model = MakeModel("tiny");
  const Prompt p = MakePrompt(*model, 3, 40, 5);
  const auto full = FullPrefill(*model, p.all);
  auto blend = [&](std::string_view selection, double ratio) {
    engine::KvSequence seq = model->kv_cache().NewSequence();
    auto r = BlendPrefill(
        *model, seq, p.segments, p.suffix,
        {.spec = {.recompute_ratio = ratio, .selection = *ParseBlendSelection(selection)}});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(seq.length(), static_cast<int64_t>(p.all.size()));
    return *r;
  };
  const BlendResult q = blend("query", 0.15);
  EXPECT_EQ(q.recomputed_tokens, 18);  // 0.15 of 120, at every layer
  EXPECT_EQ(q.kept_at_check, std::vector<int>{18});
  EXPECT_EQ(q.question_pass_tokens, 12);
  const BlendResult qb = blend("query+boundary:4", 0.15);
  EXPECT_EQ(qb.recomputed_tokens, 18);
  const BlendResult reuse = blend("deviation", 0.0);
  EXPECT_EQ(reuse.question_pass_tokens, 0);
  EXPECT_LT(KlDivergence(full, q.logits), KlDivergence(full, reuse.logits));
  const BlendResult all = blend("query", 1.0);
  EXPECT_EQ(all.recomputed_tokens, 120);
  EXPECT_LT(RelError(all.logits.data(), full.data(), full.size()), 1e-5);
  // The pass's KV is gone: the pool holds what it held before.
  EXPECT_EQ(model->kv_cache().free_blocks(), model->kv_cache().num_blocks());
}

}  // namespace
}  // namespace kdn::blend
