// A sequence's attention bias (KvSequence::SetAttentionBias): what it adds
// to the scores, on the CPU engine's passes (a prefill's rows, decode
// steps, blend's row passes), checked against the engine's own holes (a
// bias that drives a span's weights to zero is that span left out), against
// itself (prefill and decode agree; zero is no bias) and against its
// arguments.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kdn/engine/cpu_engine.h"
#include "kdn/testing/tiny_model.h"

namespace kdn::engine {
namespace {

using model::ModelConfig;
using testing::AnswerOver;
using testing::MakeModel;
using testing::MaxDiff;
using testing::RandomTokens;

KvSequence::AttentionBias Uniform(const ModelConfig& c,
                                  std::vector<std::pair<int64_t, int64_t>> spans, float value) {
  return {std::move(spans), c.num_heads,
          std::vector<float>(static_cast<size_t>(c.num_layers) * c.num_heads, value)};
}

TEST(AttentionBias, AVeryNegativeBiasOnASpanIsAHoleThereInEveryHead) {
  auto model = MakeModel("tiny");
  const ModelConfig& c = model->config();
  CpuKvCache& cache = model->kv_cache();
  const auto context = RandomTokens(40, c.vocab_size, 1),
             question = RandomTokens(20, c.vocab_size, 2);
  std::vector<float> logits;
  KvSequence holed = cache.NewSequence(), biased = cache.NewSequence(), plain = cache.NewSequence();
  for (KvSequence* s : {&holed, &biased, &plain}) {
    ASSERT_TRUE(model->Prefill(*s, context, {}, &logits).ok());
  }
  // Slots [30, 40) hidden from every head, two ways.
  ASSERT_TRUE(
      holed.SetHeadTokens(40, std::vector<int32_t>(size_t(c.num_layers) * c.num_kv_heads, 30))
          .ok());
  ASSERT_TRUE(biased.SetAttentionBias(Uniform(c, {{30, 40}}, -1e4f)).ok());
  const std::vector<float> want = AnswerOver(*model, holed, question);
  const std::vector<float> got = AnswerOver(*model, biased, question);
  EXPECT_LT(MaxDiff(want, got), 1e-5f);
  // And it is not the plain answer: the span mattered.
  EXPECT_GT(MaxDiff(want, AnswerOver(*model, plain, question)), 1e-3f);
}

TEST(AttentionBias, ZeroIsNoBiasAndOneHeadsBiasMovesTheAnswer) {
  auto model = MakeModel("tiny");
  const ModelConfig& c = model->config();
  CpuKvCache& cache = model->kv_cache();
  const auto context = RandomTokens(40, c.vocab_size, 3),
             question = RandomTokens(12, c.vocab_size, 4);
  auto answer = [&](const KvSequence::AttentionBias* bias) {
    KvSequence s = cache.NewSequence();
    std::vector<float> logits;
    EXPECT_TRUE(model->Prefill(s, context, {}, &logits).ok());
    if (bias != nullptr) {
      EXPECT_TRUE(s.SetAttentionBias(*bias).ok());
    }
    return AnswerOver(*model, s, question);
  };
  const std::vector<float> base = answer(nullptr);
  const KvSequence::AttentionBias zero = Uniform(c, {{4, 20}, {25, 30}}, 0.0f);
  EXPECT_LT(MaxDiff(base, answer(&zero)), 1e-5f);
  KvSequence::AttentionBias one = zero;
  one.bias[1] = 3.0f;  // layer 0, query head 1
  EXPECT_GT(MaxDiff(base, answer(&one)), 1e-3f);
}

TEST(AttentionBias, PrefillRowsDecodeStepsAndAFullRowPassAgree) {
  auto model = MakeModel("tiny");
  const ModelConfig& c = model->config();
  CpuKvCache& cache = model->kv_cache();
  const auto tokens = RandomTokens(48, c.vocab_size, 5);
  KvSequence::AttentionBias bias = Uniform(c, {{2, 9}, {16, 30}}, 1.5f);
  for (size_t i = 0; i < bias.bias.size(); ++i) bias.bias[i] += 0.25f * static_cast<float>(i % 5);
  // One prefill of every token, all logits.
  KvSequence whole = cache.NewSequence();
  ASSERT_TRUE(whole.SetAttentionBias(bias).ok());
  std::vector<float> want;
  ASSERT_TRUE(model->Prefill(whole, tokens, {.all_logits = true}, &want).ok());
  const size_t vocab = static_cast<size_t>(c.vocab_size);
  // The first 32 prefilled, the rest one decode step at a time.
  KvSequence steps = cache.NewSequence();
  ASSERT_TRUE(steps.SetAttentionBias(bias).ok());
  std::vector<float> got, step;
  ASSERT_TRUE(model->Prefill(steps, std::span(tokens).first(32), {.all_logits = true}, &got).ok());
  KvSequence* batch[] = {&steps};
  for (size_t i = 32; i < tokens.size(); ++i) {
    const int32_t tok[] = {tokens[i]};
    ASSERT_TRUE(model->DecodeStep(batch, tok, &step).ok());
    got.insert(got.end(), step.begin(), step.end());
  }
  EXPECT_LT(MaxDiff(want, got), 1e-4f);
  // Every position at every layer of a row pass over the biased sequence
  // is the biased prefill.
  std::vector<int64_t> all(tokens.size());
  std::iota(all.begin(), all.end(), 0);
  auto pass = model->BeginRowPass(whole, tokens, all);
  ASSERT_TRUE(pass.ok()) << pass.status().ToString();
  for (int l = 0; l < c.num_layers; ++l) ASSERT_TRUE((*pass)->RunLayer().ok());
  std::vector<float> last;
  ASSERT_TRUE((*pass)->Logits(&last).ok());
  EXPECT_LT(MaxDiff(std::vector<float>(want.end() - static_cast<std::ptrdiff_t>(vocab), want.end()),
                    last),
            1e-4f);
}

TEST(AttentionBias, BadArgumentsAreRefusedAndResetClearsIt) {
  auto model = MakeModel("tiny");
  const ModelConfig& c = model->config();
  KvSequence s = model->kv_cache().NewSequence();
  EXPECT_EQ(s.SetAttentionBias(Uniform(c, {{5, 5}}, 1)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.SetAttentionBias(Uniform(c, {{5, 9}, {8, 12}}, 1)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(s.SetAttentionBias(Uniform(c, {{-1, 3}}, 1)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.SetAttentionBias(Uniform(c, {{0, 3}}, NAN)).code(), StatusCode::kInvalidArgument);
  KvSequence::AttentionBias short_bias = Uniform(c, {{0, 3}}, 1);
  short_bias.bias.pop_back();
  EXPECT_EQ(s.SetAttentionBias(short_bias).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.attention_bias(), nullptr);
  // A bias for another number of query heads: refused by the engine at use.
  KvSequence::AttentionBias other = Uniform(c, {{0, 3}}, 1);
  other.heads = c.num_heads + 1;
  other.bias.assign(static_cast<size_t>(c.num_layers) * other.heads, 1);
  ASSERT_TRUE(s.SetAttentionBias(other).ok());
  std::vector<float> logits;
  EXPECT_EQ(model->Prefill(s, RandomTokens(4, c.vocab_size, 6), {}, &logits).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(s.SetAttentionBias(Uniform(c, {{0, 3}}, 1)).ok());
  ASSERT_NE(s.attention_bias(), nullptr);
  KvSequence moved = std::move(s);
  EXPECT_NE(moved.attention_bias(), nullptr);
  moved.Reset();
  EXPECT_EQ(moved.attention_bias(), nullptr);
}

// A batch's biases laid out for one launch (the CUDA engine's kernels read
// this layout): each row its values, or zeros, and its spans.
TEST(AttentionBias, ABatchsBiasesAreLaidOutRowByRow) {
  auto model = MakeModel("tiny");
  const ModelConfig& c = model->config();
  const size_t per_row = static_cast<size_t>(c.num_layers) * c.num_heads;
  KvCache& cache = model->kv_cache();
  KvSequence a = cache.NewSequence(), none = cache.NewSequence(), b = cache.NewSequence();
  std::vector<float> va(per_row), vb(per_row, 0.0f);
  std::iota(va.begin(), va.end(), 1.0f);
  vb[3] = -2.0f;
  ASSERT_TRUE(a.SetAttentionBias({{{0, 4}, {9, 12}}, c.num_heads, va}).ok());
  ASSERT_TRUE(b.SetAttentionBias({{{5, 6}}, c.num_heads, vb}).ok());
  const KvSequence* seqs[] = {&a, &none, &b};
  const BatchBias laid = LayOutBias(seqs, c.num_layers, c.num_heads);
  EXPECT_TRUE(laid.any);
  std::vector<float> want = va;
  want.resize(2 * per_row, 0.0f);
  want.insert(want.end(), vb.begin(), vb.end());
  EXPECT_EQ(laid.head_bias, want);
  EXPECT_EQ(laid.spans, (std::vector<int64_t>{0, 4, 9, 12, 5, 6}));
  EXPECT_EQ(laid.span_first, (std::vector<int32_t>{0, 2, 2, 3}));
  const KvSequence* plain[] = {&none};
  const BatchBias nothing = LayOutBias(plain, c.num_layers, c.num_heads);
  EXPECT_FALSE(nothing.any);
  EXPECT_TRUE(nothing.spans.empty());
  EXPECT_EQ(nothing.span_first, (std::vector<int32_t>{0, 0}));
}

}  // namespace
}  // namespace kdn::engine
