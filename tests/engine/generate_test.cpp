#include "kdn/engine/generate.h"

#include <gtest/gtest.h>

#include "kdn/testing/tiny_model.h"

namespace kdn::engine {
namespace {

using testing::MakeModel;
using testing::RandomTokens;

TEST(Generate, GreedyEqualsArgmaxOfAFullForwardAtEveryStep) {
  auto model = MakeModel("tiny-qwen2");
  auto prompt = RandomTokens(30, 258, 1);
  GenerateOptions opts{.max_tokens = 12, .sampling = {.temperature = 0.0f}};
  auto res = Generate(*model, prompt, opts);
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  ASSERT_EQ(res->tokens.size(), 12u);
  EXPECT_EQ(res->finish_reason, "length");
  // Re-derive each token from a from-scratch prefill of prompt + tokens so far.
  std::vector<int32_t> seqtok = prompt;
  for (int32_t t : res->tokens) {
    KvSequence s = model->kv_cache().NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(model->Prefill(s, seqtok, {}, &logits).ok());
    EXPECT_EQ(Argmax(logits), t);
    seqtok.push_back(t);
  }
}

TEST(Generate, StopsOnAStopIdAndKeepsIt) {
  auto model = MakeModel("tiny");
  auto prompt = RandomTokens(10, 258, 2);
  auto free_run = Generate(*model, prompt, {.max_tokens = 8, .sampling = {.temperature = 0.0f}});
  ASSERT_TRUE(free_run.ok());
  const int32_t stop = free_run->tokens[3];
  auto res = Generate(*model, prompt,
                      {.max_tokens = 8, .sampling = {.temperature = 0.0f}, .stop_ids = {stop}});
  ASSERT_TRUE(res.ok());
  EXPECT_EQ(res->finish_reason, "stop");
  EXPECT_EQ(res->tokens.back(), stop);
  EXPECT_LE(res->tokens.size(), 4u);
}

TEST(Generate, RejectsBadInputsWithAStatus) {
  auto model = MakeModel("tiny");
  EXPECT_EQ(Generate(*model, {}, {}).status().code(), StatusCode::kInvalidArgument);
  const std::vector<int32_t> one = {1};
  EXPECT_EQ(Generate(*model, one, {.max_tokens = -1}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Generate(*model, one, {.sampling = {.top_p = 2.0f}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(Generate(*model, one, {.max_tokens = 0}).value().tokens.empty());
  // The KV of finished generations is given back.
  EXPECT_EQ(model->kv_cache().free_blocks(), model->kv_cache().num_blocks());
}

TEST(Generate, EndsAtTheContextLimit) {
  auto model = MakeModel("tiny");
  auto prompt = RandomTokens(2040, 258, 3);
  auto res = Generate(*model, prompt, {.max_tokens = 100, .sampling = {.temperature = 0.0f}});
  ASSERT_TRUE(res.ok()) << res.status().ToString();
  EXPECT_EQ(res->finish_reason, "context");
  // Tokens 1-8 fill positions 2040..2047; the 9th comes from the last logits.
  EXPECT_EQ(res->tokens.size(), 9u);
}

}  // namespace
}  // namespace kdn::engine
