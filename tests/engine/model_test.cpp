#include "kdn/engine/cpu_engine.h"

#include <gtest/gtest.h>

#include "kdn/testing/tiny_model.h"

namespace kdn::engine {
namespace {

using testing::MakeModel;
using testing::RandomTokens;
using testing::RelError;

class ModelTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ModelTest, PrefillOfSuffixOnCachedPrefixMatchesFullPrefill) {
  auto model = MakeModel(GetParam());
  const int V = model->config().vocab_size;
  const auto tokens = RandomTokens(150, V, 1);
  PrefillOptions all{.all_logits = true};

  KvSequence full = model->kv_cache().NewSequence();
  std::vector<float> full_logits;
  ASSERT_TRUE(model->Prefill(full, tokens, all, &full_logits).ok());
  ASSERT_EQ(full_logits.size(), tokens.size() * V);

  // Prefix ends mid-block (37) and the suffix is long enough for the blocked
  // attention path; a second split exercises the row-by-row path (5 tokens).
  for (int split : {37, 145}) {
    KvSequence seq = model->kv_cache().NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(model->Prefill(seq, std::span(tokens).first(split), {}, &logits).ok());
    ASSERT_TRUE(model->Prefill(seq, std::span(tokens).subspan(split), all, &logits).ok());
    EXPECT_EQ(seq.length(), 150);
    EXPECT_LT(RelError(logits.data(), &full_logits[split * V], logits.size()), 1e-5)
        << "split at " << split;
  }
}

TEST_P(ModelTest, TokensDecodedStepByStepMatchTheFullForward) {
  auto model = MakeModel(GetParam());
  const int V = model->config().vocab_size;
  const auto tokens = RandomTokens(60, V, 2);
  KvSequence full = model->kv_cache().NewSequence();
  std::vector<float> full_logits;
  ASSERT_TRUE(model->Prefill(full, tokens, {.all_logits = true}, &full_logits).ok());

  KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, std::span(tokens).first(20), {}, &logits).ok());
  EXPECT_LT(RelError(logits.data(), &full_logits[19 * V], V), 1e-5);
  for (int i = 20; i < 60; ++i) {
    KvSequence* batch[] = {&seq};
    ASSERT_TRUE(model->DecodeStep(batch, std::span(&tokens[i], 1), &logits).ok());
    ASSERT_EQ(logits.size(), static_cast<size_t>(V));
    EXPECT_LT(RelError(logits.data(), &full_logits[i * V], V), 1e-5) << "position " << i;
  }
}

TEST_P(ModelTest, BatchedDecodeStepEqualsSequencesDecodedAlone) {
  auto model = MakeModel(GetParam());
  const int V = model->config().vocab_size;
  const std::vector<int> lengths = {3, 17, 40};
  std::vector<KvSequence> batch_seqs, solo_seqs;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<float> logits;
  for (size_t b = 0; b < lengths.size(); ++b) {
    prompts.push_back(RandomTokens(lengths[b], V, 10 + b));
    batch_seqs.push_back(model->kv_cache().NewSequence());
    solo_seqs.push_back(model->kv_cache().NewSequence());
    ASSERT_TRUE(model->Prefill(batch_seqs[b], prompts[b], {}, &logits).ok());
    ASSERT_TRUE(model->Prefill(solo_seqs[b], prompts[b], {}, &logits).ok());
  }
  for (int step = 0; step < 5; ++step) {
    const auto next = RandomTokens(3, V, 100 + step);
    std::vector<KvSequence*> ptrs;
    for (auto& s : batch_seqs) ptrs.push_back(&s);
    std::vector<float> batched;
    ASSERT_TRUE(model->DecodeStep(ptrs, next, &batched).ok());
    ASSERT_EQ(batched.size(), 3u * V);
    for (size_t b = 0; b < 3; ++b) {
      KvSequence* one[] = {&solo_seqs[b]};
      ASSERT_TRUE(model->DecodeStep(one, std::span(&next[b], 1), &logits).ok());
      EXPECT_LT(RelError(&batched[b * V], logits.data(), V), 1e-5)
          << "seq " << b << " step " << step;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, ModelTest,
                         ::testing::Values("tiny", "tiny-qwen2", "tiny-mistral"),
                         [](const auto& info) {
                           std::string s = info.param;
                           for (char& ch : s)
                             if (ch == '-') ch = '_';
                           return s;
                         });

TEST(CpuEngine, LayerHookRunsOnceForEveryLayerInOrder) {
  auto model = MakeModel("tiny");
  std::vector<int> seen;
  KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  PrefillOptions opts;
  opts.on_layer = [&](int layer) {
    EXPECT_EQ(seq.length(), 30);  // this layer's KV is in place
    seen.push_back(layer);
    return Status::Ok();
  };
  ASSERT_TRUE(model->Prefill(seq, RandomTokens(30, 258, 3), opts, &logits).ok());
  EXPECT_EQ(seen, (std::vector<int>{0, 1}));
}

TEST(CpuEngine, FailingLayerHookAbortsPrefillAndLeavesSequenceAsItWas) {
  auto model = MakeModel("tiny");
  KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, RandomTokens(10, 258, 4), {}, &logits).ok());
  const int free_before = model->kv_cache().free_blocks();
  PrefillOptions opts;
  opts.on_layer = [](int layer) { return layer == 1 ? Unavailable("peer gone") : Status::Ok(); };
  Status st = model->Prefill(seq, RandomTokens(40, 258, 5), opts, &logits);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable);
  EXPECT_EQ(seq.length(), 10);
  EXPECT_EQ(model->kv_cache().free_blocks(), free_before);
}

TEST(CpuEngine, PrefillBeyondFreeKvBlocksIsResourceExhaustedAndChangesNothing) {
  auto model = MakeModel("tiny", 7, {.kv_blocks = 4});
  KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, RandomTokens(40, 258, 6), {}, &logits).ok());
  Status st = model->Prefill(seq, RandomTokens(40, 258, 7), {}, &logits);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted) << st.ToString();
  EXPECT_EQ(seq.length(), 40);
  EXPECT_EQ(model->kv_cache().free_blocks(), 1);
}

TEST(CpuEngine, RejectsTokenIdsOutsideTheVocabulary) {
  auto model = MakeModel("tiny");
  KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  const std::vector<int32_t> bad = {1, 2, 258};
  Status st = model->Prefill(seq, bad, {}, &logits);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("258"), std::string::npos);
  EXPECT_EQ(seq.length(), 0);
}

TEST(CpuEngine, RejectsSequencesLongerThanTheContext) {
  auto model = MakeModel("tiny", 7, {.kv_tokens = 4096});
  KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  Status st = model->Prefill(seq, RandomTokens(2049, 258, 8), {}, &logits);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("2048"), std::string::npos) << st.message();
}

TEST(CpuEngine, DecodeRejectsTheSameSequenceTwiceInOneBatch) {
  auto model = MakeModel("tiny");
  KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, RandomTokens(5, 258, 9), {}, &logits).ok());
  KvSequence* batch[] = {&seq, &seq};
  const int32_t toks[] = {1, 2};
  EXPECT_EQ(model->DecodeStep(batch, toks, &logits).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(seq.length(), 5);
}

}  // namespace
}  // namespace kdn::engine
