#include "kdn/engine/cpu_engine.h"

#include <gtest/gtest.h>

#include "kdn/engine/sampler.h"
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

// Prefill pieces riding in a decode step (DecodeSampleWith, one pass) give
// every row what Prefill and DecodeSample give it alone, bit for bit; so
// does the engine's default (the calls one after another).
TEST_P(ModelTest, PiecesRidingInADecodeStepGiveWhatPrefillAndDecodeGiveAlone) {
  auto model = MakeModel(GetParam());
  const int V = model->config().vocab_size;
  KvCache& cache = model->kv_cache();
  std::vector<float> logits;
  // Two decoding sequences, and two prompts computed in pieces of 24 and
  // 7 tokens (a whole page and a part of one).
  const std::vector<int32_t> a = RandomTokens(30, V, 1), b = RandomTokens(5, V, 2);
  const std::vector<int32_t> p0 = RandomTokens(48, V, 3), p1 = RandomTokens(14, V, 4);
  for (bool fused_default : {false, true}) {
    KvSequence da = cache.NewSequence(), db = cache.NewSequence();
    KvSequence sa = cache.NewSequence(), sb = cache.NewSequence();
    for (auto [seq, prompt] : {std::pair{&da, &a}, {&sa, &a}, {&db, &b}, {&sb, &b}}) {
      ASSERT_TRUE(model->Prefill(*seq, *prompt, {}, &logits).ok());
    }
    KvSequence q0 = cache.NewSequence(), q1 = cache.NewSequence();
    KvSequence r0 = cache.NewSequence(), r1 = cache.NewSequence();
    int32_t tokens[] = {7, 9};
    for (int step = 0; step < 3; ++step) {
      const auto piece0 = std::span(p0).subspan(step * 16, 16);
      const auto piece1 = std::span(p1).subspan(step * 4, step < 2 ? 4 : 6);
      std::vector<float> l0, l1;
      const Engine::Piece pieces[] = {{&q0, piece0, &l0}, {&q1, piece1, &l1}};
      KvSequence* seqs[] = {&da, &db};
      Sampler s1({.temperature = 0.0f}), s2({.temperature = 0.0f});
      Sampler* samplers[] = {&s1, &s2};
      std::vector<int32_t> next;
      const Status st = fused_default
                            ? model->Engine::DecodeSampleWith(seqs, tokens, samplers, &next, pieces)
                            : model->DecodeSampleWith(seqs, tokens, samplers, &next, pieces);
      ASSERT_TRUE(st.ok()) << st.ToString();
      // Alone: the pieces' prefills and the two sequences' steps.
      std::vector<float> want0, want1;
      ASSERT_TRUE(model->Prefill(r0, piece0, {}, &want0).ok());
      ASSERT_TRUE(model->Prefill(r1, piece1, {}, &want1).ok());
      EXPECT_EQ(l0, want0) << "piece 0, step " << step;
      EXPECT_EQ(l1, want1) << "piece 1, step " << step;
      KvSequence* solo[] = {&sa, &sb};
      Sampler t1({.temperature = 0.0f}), t2({.temperature = 0.0f});
      Sampler* solo_samplers[] = {&t1, &t2};
      std::vector<int32_t> solo_next;
      ASSERT_TRUE(model->DecodeSample(solo, tokens, solo_samplers, &solo_next).ok());
      ASSERT_EQ(next, solo_next) << "step " << step;
      EXPECT_EQ(q0.length(), r0.length());
      EXPECT_EQ(q1.length(), r1.length());
      EXPECT_EQ(da.length(), sa.length());
      tokens[0] = next[0];
      tokens[1] = next[1];
    }
  }
}

TEST(CpuEngine, APieceThatCannotRunLeavesEverySequenceAsItWas) {
  auto model = MakeModel("tiny");
  const int V = model->config().vocab_size;
  KvSequence d = model->kv_cache().NewSequence(), q = model->kv_cache().NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(d, RandomTokens(10, V, 1), {}, &logits).ok());
  ASSERT_TRUE(model->Prefill(q, RandomTokens(3, V, 2), {}, &logits).ok());
  KvSequence* seqs[] = {&d};
  const int32_t tokens[] = {5};
  Sampler s({.temperature = 0.0f});
  Sampler* samplers[] = {&s};
  std::vector<int32_t> next;
  const std::vector<int32_t> bad = {1, V + 3};
  std::vector<float> l;
  for (bool fused_default : {false, true}) {
    // A token outside the vocabulary; the decoding sequence as a piece too.
    for (const Engine::Piece& piece :
         {Engine::Piece{&q, bad, &l}, Engine::Piece{&d, std::span(bad).first(1), &l}}) {
      const Engine::Piece pieces[] = {piece};
      const Status st = fused_default
                            ? model->Engine::DecodeSampleWith(seqs, tokens, samplers, &next, pieces)
                            : model->DecodeSampleWith(seqs, tokens, samplers, &next, pieces);
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
      EXPECT_EQ(d.length(), 10);
      EXPECT_EQ(q.length(), 3);
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
