#include "kdn/decode_worker/batcher.h"

#include <gtest/gtest.h>

#include <numeric>

#include "../engine/test_util.h"
#include "kdn/engine/generate.h"

namespace kdn::decode_worker {
namespace {

using engine::testing::MakeModel;
using engine::testing::RandomTokens;

engine::ByteTokenizer Bytes() {
  std::vector<int32_t> ids(256);
  std::iota(ids.begin(), ids.end(), 0);
  return engine::ByteTokenizer(ids, 258, 256, 257);
}

// What a prefill worker hands over: the prompt's KV and its first token.
struct Prefilled {
  engine::KvSequence seq;
  int32_t first;
};

Prefilled Prefill(engine::CpuEngine& model, const std::vector<int32_t>& prompt,
                  const engine::SamplingParams& sampling) {
  Prefilled p{model.kv_cache().NewSequence(), -1};
  std::vector<float> logits;
  EXPECT_TRUE(model.Prefill(p.seq, prompt, {}, &logits).ok());
  engine::Sampler sampler(sampling);
  p.first = sampler.Sample(logits);
  return p;
}

// Collects each request's tokens and shown text from events.
struct Transcript {
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, std::string> text;
  std::map<uint64_t, std::string> finish;
  void Add(const std::vector<TokenEvent>& events) {
    for (const TokenEvent& e : events) {
      if (e.token >= 0) tokens[e.id].push_back(e.token);
      text[e.id] += e.text;
      if (e.finished) finish[e.id] = e.finish_reason;
    }
  }
};

TEST(Batcher, RequestsJoiningAtAnyStepGetTheTokensTheyGetAlone) {
  auto model = MakeModel("tiny-qwen2");
  const auto tok = Bytes();
  Batcher batcher(*model, tok, 8);
  struct Case {
    RequestSpec spec;
    std::vector<int32_t> prompt;
    int join_step;
  };
  std::vector<Case> cases;
  for (uint64_t i = 0; i < 5; ++i) {
    RequestSpec spec;
    spec.id = 100 + i;
    spec.max_tokens = 6 + static_cast<int>(i) * 3;
    // Greedy, and seeded sampling with temperature, top-k and top-p.
    if (i % 2 == 1) spec.sampling = {.temperature = 0.9f, .top_k = 40, .top_p = 0.95f, .seed = 7 + i};
    else spec.sampling = {.temperature = 0.0f};
    cases.push_back({spec, RandomTokens(10 + 7 * static_cast<int>(i), 256, 50 + i), static_cast<int>(i)});
  }
  Transcript t;
  for (int step = 0; step < 40; ++step) {
    std::vector<TokenEvent> events;
    for (const Case& c : cases) {
      if (c.join_step != step) continue;
      Prefilled p = Prefill(*model, c.prompt, c.spec.sampling);
      ASSERT_TRUE(batcher.Admit(c.spec, std::move(p.seq), p.first, &events).ok());
    }
    ASSERT_TRUE(batcher.Step(&events).ok());
    t.Add(events);
  }
  EXPECT_EQ(batcher.running(), 0u);
  for (const Case& c : cases) {
    auto alone = engine::Generate(*model, c.prompt,
                                  {.max_tokens = c.spec.max_tokens, .sampling = c.spec.sampling});
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(t.tokens[c.spec.id], alone->tokens) << "request " << c.spec.id;
    EXPECT_EQ(t.finish[c.spec.id], "length");
  }
  EXPECT_EQ(model->kv_cache().free_blocks(), model->kv_cache().num_blocks());
}

TEST(Batcher, StopStringEndsTheTextBeforeItAndIsNeverShown) {
  auto model = MakeModel("tiny");
  const auto tok = Bytes();
  const auto prompt = RandomTokens(12, 256, 3);
  const engine::SamplingParams greedy{.temperature = 0.0f};
  auto free_run = engine::Generate(*model, prompt, {.max_tokens = 12, .sampling = greedy});
  ASSERT_TRUE(free_run.ok());
  const std::string full = tok.Decode(free_run->tokens);
  ASSERT_GE(full.size(), 8u);
  const std::string stop = full.substr(5, 2);  // spans tokens 5 and 6
  const std::string expect = full.substr(0, full.find(stop));

  Batcher batcher(*model, tok, 4);
  RequestSpec spec{.id = 1, .sampling = greedy, .max_tokens = 12, .stop_strings = {stop}};
  Prefilled p = Prefill(*model, prompt, greedy);
  std::vector<TokenEvent> events;
  ASSERT_TRUE(batcher.Admit(spec, std::move(p.seq), p.first, &events).ok());
  Transcript t;
  for (int i = 0; i < 12 && batcher.running() > 0; ++i) ASSERT_TRUE(batcher.Step(&events).ok());
  t.Add(events);
  EXPECT_EQ(t.finish[1], "stop");
  EXPECT_EQ(t.text[1], expect);
  for (const TokenEvent& e : events) EXPECT_EQ(e.text.find(stop), std::string::npos);
}

TEST(Batcher, StopTokenFinishesTheRequest) {
  auto model = MakeModel("tiny");
  const auto tok = Bytes();
  const auto prompt = RandomTokens(8, 256, 4);
  const engine::SamplingParams greedy{.temperature = 0.0f};
  auto free_run = engine::Generate(*model, prompt, {.max_tokens = 8, .sampling = greedy});
  ASSERT_TRUE(free_run.ok());
  Batcher batcher(*model, tok, 4);
  RequestSpec spec{.id = 9, .sampling = greedy, .max_tokens = 8, .stop_ids = {free_run->tokens[2]}};
  Prefilled p = Prefill(*model, prompt, greedy);
  std::vector<TokenEvent> events;
  ASSERT_TRUE(batcher.Admit(spec, std::move(p.seq), p.first, &events).ok());
  while (batcher.running() > 0) ASSERT_TRUE(batcher.Step(&events).ok());
  Transcript t;
  t.Add(events);
  EXPECT_EQ(t.finish[9], "stop");
  EXPECT_EQ(t.tokens[9].back(), free_run->tokens[2]);
  EXPECT_LE(t.tokens[9].size(), 3u);
}

TEST(Batcher, RefusesBadRequestsAndAFullBatchAndCancelsCleanly) {
  auto model = MakeModel("tiny");
  const auto tok = Bytes();
  Batcher batcher(*model, tok, 1);
  const engine::SamplingParams greedy{.temperature = 0.0f};
  std::vector<TokenEvent> events;
  Prefilled a = Prefill(*model, RandomTokens(5, 256, 1), greedy);
  EXPECT_EQ(batcher.Admit({.id = 1, .sampling = {.top_p = 0.0f}}, std::move(a.seq), a.first, &events).code(),
            StatusCode::kInvalidArgument);
  a = Prefill(*model, RandomTokens(5, 256, 1), greedy);
  ASSERT_TRUE(batcher.Admit({.id = 1, .sampling = greedy, .max_tokens = 50}, std::move(a.seq), a.first, &events).ok());
  Prefilled b = Prefill(*model, RandomTokens(5, 256, 2), greedy);
  EXPECT_EQ(batcher.Admit({.id = 2, .sampling = greedy}, std::move(b.seq), b.first, &events).code(),
            StatusCode::kResourceExhausted);
  b.seq = model->kv_cache().NewSequence();
  EXPECT_EQ(batcher.Admit({.id = 3, .sampling = greedy}, std::move(b.seq), 1, &events).code(),
            StatusCode::kInvalidArgument);  // no prompt KV
  ASSERT_TRUE(batcher.Step(&events).ok());
  events.clear();
  ASSERT_TRUE(batcher.Cancel(1, &events).ok());
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].finish_reason, "cancelled");
  EXPECT_EQ(batcher.Cancel(1, &events).code(), StatusCode::kNotFound);
  EXPECT_EQ(model->kv_cache().free_blocks(), model->kv_cache().num_blocks());
}

TEST(ShowableLength, HoldsBackPartialCharactersAndStopPrefixes) {
  EXPECT_EQ(ShowableLength("hello", {}), 5u);
  EXPECT_EQ(ShowableLength("caf\xc3", {}), 3u);           // é cut after its lead byte
  EXPECT_EQ(ShowableLength("caf\xc3\xa9", {}), 5u);       // complete
  EXPECT_EQ(ShowableLength("x\xe4\xb8", {}), 1u);         // 3-byte character, 2 arrived
  EXPECT_EQ(ShowableLength("the end", {"ending"}), 4u);  // "end" may become "ending"
  EXPECT_EQ(ShowableLength("the en", {"end", "xyz"}), 4u);
  EXPECT_EQ(ShowableLength("the e", {"done"}), 5u);
}

}  // namespace
}  // namespace kdn::decode_worker
