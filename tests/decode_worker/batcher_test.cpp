#include "kdn/decode_worker/batcher.h"

#include <gtest/gtest.h>

#include <numeric>

#include "kdn/testing/tiny_model.h"
#include "kdn/engine/generate.h"
#include "kdn/text/output_text.h"

namespace kdn::decode_worker {
namespace {

using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;

text::ByteTokenizer Bytes() {
  std::vector<int32_t> ids(256);
  std::iota(ids.begin(), ids.end(), 0);
  return text::ByteTokenizer(ids, 258, 256, 257);
}

// What the router shows of a request's first token (router/src/backend.cpp).
text::TextDelta RouterFirstToken(const text::Tokenizer& tok, const RequestSpec& spec,
                                 int64_t prompt_tokens, int64_t max_context, int32_t first) {
  text::OutputText output(tok, {spec.max_tokens, spec.stop_ids, spec.stop_strings});
  return output.Add(first, prompt_tokens, max_context);
}

// What a prefill worker hands over: the prompt's KV and its first token.
struct Prefilled {
  engine::KvSequence seq;
  int32_t first;
};

Prefilled Prefill(engine::CpuEngine& model, const std::vector<int32_t>& prompt,
                  const model::SamplingParams& sampling) {
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
    if (i % 2 == 1)
      spec.sampling = {.temperature = 0.9f, .top_k = 40, .top_p = 0.95f, .seed = 7 + i};
    else
      spec.sampling = {.temperature = 0.0f};
    cases.push_back(
        {spec, RandomTokens(10 + 7 * static_cast<int>(i), 256, 50 + i), static_cast<int>(i)});
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
  const model::SamplingParams greedy{.temperature = 0.0f};
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
  const model::SamplingParams greedy{.temperature = 0.0f};
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
  const model::SamplingParams greedy{.temperature = 0.0f};
  std::vector<TokenEvent> events;
  Prefilled a = Prefill(*model, RandomTokens(5, 256, 1), greedy);
  EXPECT_EQ(
      batcher.Admit({.id = 1, .sampling = {.top_p = 0.0f}}, std::move(a.seq), a.first, &events)
          .code(),
      StatusCode::kInvalidArgument);
  a = Prefill(*model, RandomTokens(5, 256, 1), greedy);
  ASSERT_TRUE(batcher
                  .Admit({.id = 1, .sampling = greedy, .max_tokens = 50}, std::move(a.seq), a.first,
                         &events)
                  .ok());
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

TEST(Batcher, TheRoutersFirstTokenTextIsTheEventAdmitEmits) {
  auto model = MakeModel("tiny");
  const auto tok = Bytes();
  const auto prompt = RandomTokens(9, 256, 5);
  const model::SamplingParams greedy{.temperature = 0.0f};
  const int32_t a = 'a', lead = 0xC3;  // 0xC3: a UTF-8 lead byte, held back alone
  struct Case {
    RequestSpec spec;
    int32_t first;
  };
  const std::vector<Case> cases = {
      {{.sampling = greedy, .max_tokens = 4}, a},
      {{.sampling = greedy, .max_tokens = 1}, a},                          // length
      {{.sampling = greedy, .max_tokens = 4, .stop_ids = {a}}, a},         // stop token
      {{.sampling = greedy, .max_tokens = 4, .stop_strings = {"a"}}, a},   // stop string
      {{.sampling = greedy, .max_tokens = 4, .stop_strings = {"ab"}}, a},  // may become one
      {{.sampling = greedy, .max_tokens = 4}, lead},
      {{.sampling = greedy, .max_tokens = 1}, lead},
  };
  const int64_t context = model->config().max_context;
  uint64_t id = 1;
  for (const Case& c : cases) {
    RequestSpec spec = c.spec;
    spec.id = id++;
    Batcher batcher(*model, tok, 4);
    Prefilled p = Prefill(*model, prompt, greedy);
    std::vector<TokenEvent> events;
    ASSERT_TRUE(batcher.Admit(spec, std::move(p.seq), c.first, &events).ok());
    ASSERT_EQ(events.size(), 1u);
    const TokenEvent want = events[0];
    const text::TextDelta got =
        RouterFirstToken(tok, spec, static_cast<int64_t>(prompt.size()), context, c.first);
    EXPECT_EQ(want.token, c.first) << "case " << spec.id;
    EXPECT_EQ(got.text, want.text) << "case " << spec.id;
    EXPECT_EQ(got.finished, want.finished) << "case " << spec.id;
    EXPECT_EQ(got.finish_reason, want.finish_reason) << "case " << spec.id;
  }
  // A prompt that fills the context ends at its first token.
  const text::TextDelta full = RouterFirstToken(tok, {.max_tokens = 4}, context, context, a);
  EXPECT_TRUE(full.finished);
  EXPECT_EQ(full.finish_reason, "context");
}

TEST(Batcher, AFirstTokenTheClientHasIsNotEmittedAgain) {
  auto model = MakeModel("tiny");
  const auto tok = Bytes();
  const auto prompt = RandomTokens(12, 256, 6);
  const model::SamplingParams greedy{.temperature = 0.0f};
  auto free_run = engine::Generate(*model, prompt, {.max_tokens = 10, .sampling = greedy});
  ASSERT_TRUE(free_run.ok());
  const std::string full = tok.Decode(free_run->tokens);
  // A stop string that starts with the first token's text but never occurs:
  // the first token is held back, so the text the decode worker emits next
  // must take it in.
  ASSERT_LT(free_run->tokens[0], 256) << "precondition: the first token is a byte";
  std::string stop = full.substr(0, 1);
  for (char c : std::string("~#@%^|")) {
    if (full.find(c) == std::string::npos) {
      stop += c;
      break;
    }
  }
  ASSERT_EQ(stop.size(), 2u) << "precondition: a character the text lacks";
  Transcript t;
  for (const bool sent : {false, true}) {
    Batcher batcher(*model, tok, 4);
    RequestSpec spec{.id = sent ? 2u : 1u,
                     .sampling = greedy,
                     .max_tokens = 10,
                     .stop_strings = {stop},
                     .first_token_sent = sent};
    Prefilled p = Prefill(*model, prompt, greedy);
    std::vector<TokenEvent> events;
    ASSERT_TRUE(batcher.Admit(spec, std::move(p.seq), p.first, &events).ok());
    EXPECT_EQ(events.size(), sent ? 0u : 1u);
    while (batcher.running() > 0) ASSERT_TRUE(batcher.Step(&events).ok());
    t.Add(events);
  }
  ASSERT_EQ(t.tokens[1], free_run->tokens);
  EXPECT_EQ(t.tokens[2],
            std::vector<int32_t>(free_run->tokens.begin() + 1, free_run->tokens.end()));
  const text::TextDelta first = RouterFirstToken(
      tok, {.sampling = greedy, .max_tokens = 10, .stop_strings = {stop}},
      static_cast<int64_t>(prompt.size()), model->config().max_context, free_run->tokens[0]);
  EXPECT_EQ(first.text, "");  // held back: it may begin the stop string
  EXPECT_EQ(first.text + t.text[2], t.text[1]);
  EXPECT_EQ(t.text[1], full);
  EXPECT_EQ(t.finish[2], "length");

  // Should the first token end it after all, only the end is emitted.
  Batcher batcher(*model, tok, 4);
  Prefilled p = Prefill(*model, prompt, greedy);
  std::vector<TokenEvent> events;
  ASSERT_TRUE(batcher
                  .Admit({.id = 3, .sampling = greedy, .max_tokens = 1, .first_token_sent = true},
                         std::move(p.seq), p.first, &events)
                  .ok());
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].token, -1);
  EXPECT_TRUE(events[0].finished);
  EXPECT_EQ(events[0].finish_reason, "length");
  EXPECT_EQ(batcher.running(), 0u);
  EXPECT_EQ(model->kv_cache().free_blocks(), model->kv_cache().num_blocks());
}

// A request resumed after `k` tokens on another worker (docs/serving.md, "A
// decode worker lost"): the prefill worker computes prompt + those tokens and
// draws the next from the stream moved past them; the Batcher replays them.
// It must go on token for token, and text for text, as if it never moved.
TEST(Batcher, AResumedRequestGoesOnAsIfItNeverMoved) {
  auto model = MakeModel("tiny-qwen2");
  const auto tok = Bytes();
  const auto prompt = RandomTokens(14, 256, 8);
  constexpr int kMax = 12;
  for (const model::SamplingParams& sampling :
       {model::SamplingParams{.temperature = 0.0f},
        model::SamplingParams{.temperature = 4.0f, .top_k = 50, .seed = 99}}) {
    auto free_run = engine::Generate(*model, prompt, {.max_tokens = kMax, .sampling = sampling});
    ASSERT_TRUE(free_run.ok());
    const std::vector<int32_t>& all = free_run->tokens;
    ASSERT_EQ(all.size(), static_cast<size_t>(kMax));
    // A stop string of two ASCII tokens past the third, and none: the
    // resumed request must find it where the first one would, also when it
    // resumes between its tokens (the first one's text held back).
    std::string stop;
    for (size_t i = 3; i + 1 < all.size() && stop.empty(); ++i) {
      if (all[i] >= 32 && all[i] < 127 && all[i + 1] >= 32 && all[i + 1] < 127) {
        stop = {static_cast<char>(all[i]), static_cast<char>(all[i + 1])};
      }
    }
    ASSERT_FALSE(stop.empty()) << "precondition: two ASCII tokens in a row";
    for (const bool with_stop : {false, true}) {
      RequestSpec spec{.sampling = sampling, .max_tokens = kMax};
      if (with_stop) spec.stop_strings = {stop};
      Transcript whole;
      {
        Batcher batcher(*model, tok, 2);
        spec.id = 1;
        Prefilled p = Prefill(*model, prompt, sampling);
        std::vector<TokenEvent> events;
        ASSERT_TRUE(batcher.Admit(spec, std::move(p.seq), p.first, &events).ok());
        while (batcher.running() > 0) ASSERT_TRUE(batcher.Step(&events).ok());
        whole.Add(events);
      }
      const size_t end = whole.tokens[1].size();
      for (size_t k = 1; k < end; ++k) {
        SCOPED_TRACE(::testing::Message() << "seed " << sampling.seed << ", stop " << with_stop
                                          << ", resumed after " << k);
        // What the client was shown of the first k tokens.
        text::OutputText shown(tok, {spec.max_tokens, spec.stop_ids, spec.stop_strings});
        std::string before;
        for (size_t i = 0; i < k; ++i) {
          before +=
              shown
                  .Add(all[i], static_cast<int64_t>(prompt.size() + i), model->config().max_context)
                  .text;
        }
        std::vector<int32_t> longer = prompt;
        longer.insert(longer.end(), all.begin(), all.begin() + static_cast<std::ptrdiff_t>(k));
        Prefilled p{model->kv_cache().NewSequence(), -1};
        std::vector<float> logits;
        ASSERT_TRUE(model->Prefill(p.seq, longer, {}, &logits).ok());
        engine::Sampler sampler(sampling);
        sampler.Advance(static_cast<int>(k));
        p.first = sampler.Sample(logits);
        RequestSpec resumed = spec;
        resumed.id = 2;
        resumed.generated.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(k));
        Batcher batcher(*model, tok, 2);
        std::vector<TokenEvent> events;
        ASSERT_TRUE(batcher.Admit(resumed, std::move(p.seq), p.first, &events).ok());
        while (batcher.running() > 0) ASSERT_TRUE(batcher.Step(&events).ok());
        Transcript t;
        t.Add(events);
        EXPECT_EQ(t.tokens[2],
                  std::vector<int32_t>(whole.tokens[1].begin() + static_cast<std::ptrdiff_t>(k),
                                       whole.tokens[1].end()));
        EXPECT_EQ(before + t.text[2], whole.text[1]);
        EXPECT_EQ(t.finish[2], whole.finish[1]);
      }
      if (with_stop) {
        EXPECT_EQ(whole.finish[1], "stop");
      }
    }
  }
  // Resuming past the end, or with more tokens than the sequence, is refused.
  Batcher batcher(*model, tok, 2);
  std::vector<TokenEvent> events;
  Prefilled p = Prefill(*model, prompt, {.temperature = 0.0f});
  RequestSpec late{.id = 3, .sampling = {.temperature = 0.0f}, .max_tokens = 2};
  late.generated = {1, 2};
  EXPECT_EQ(batcher.Admit(late, std::move(p.seq), p.first, &events).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(model->kv_cache().free_blocks(), model->kv_cache().num_blocks());
}

}  // namespace
}  // namespace kdn::decode_worker
