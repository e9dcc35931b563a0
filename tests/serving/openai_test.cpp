#include "kdn/router/openai.h"

#include <gtest/gtest.h>

#include <numeric>

#include "kdn/engine/presets.h"
#include "kdn/router/metrics.h"

namespace kdn::router {
namespace {

class OpenAiTest : public ::testing::Test {
 protected:
  OpenAiTest() : tokenizer_(Ids(), 258, 256, 257) {
    config_ = engine::FindPreset("tiny").value().config;  // context 2048
    model_ = {"tiny", &config_, &tokenizer_};
  }
  static std::vector<int32_t> Ids() {
    std::vector<int32_t> ids(256);
    std::iota(ids.begin(), ids.end(), 0);
    return ids;
  }
  std::optional<ApiError> Parse(ApiKind kind, const std::string& body, ApiRequest* out) {
    return ParseRequest(kind, body, model_, out);
  }
  // The error for a body, which must be refused.
  ApiError Refused(const std::string& body, ApiKind kind = ApiKind::kCompletion) {
    ApiRequest r;
    auto e = Parse(kind, body, &r);
    EXPECT_TRUE(e.has_value()) << body;
    return e.value_or(ApiError{});
  }

  engine::ModelConfig config_;
  engine::ByteTokenizer tokenizer_;
  ServedModel model_;
};

TEST_F(OpenAiTest, ATextPromptGetsBosAndTheDefaults) {
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"model":"tiny","prompt":"ab"})", &r));
  EXPECT_EQ(r.prompt, (std::vector<int32_t>{256, 'a', 'b'}));
  EXPECT_EQ(r.max_tokens, 16);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_EQ(r.stop_ids, std::vector<int32_t>{257});
  EXPECT_FALSE(r.stream);
}

TEST_F(OpenAiTest, TokenIdsAreTakenAsTheyAre) {
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kCompletion,
                     R"({"prompt":[1,2,3],"max_tokens":4,"temperature":0,"top_k":5,"top_p":0.5,
                         "seed":9,"stop":["x","yz"],"stream":true,
                         "stream_options":{"include_usage":true},"ignore_eos":true,
                         "cache_salt":"tenant","unknown_field":{"a":1}})",
                     &r));
  EXPECT_EQ(r.prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(r.max_tokens, 4);
  EXPECT_EQ(r.sampling.top_k, 5);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.5f);
  EXPECT_EQ(r.sampling.seed, 9u);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"x", "yz"}));
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_TRUE(r.stop_ids.empty());
  EXPECT_EQ(r.cache_salt, "tenant");
}

TEST_F(OpenAiTest, WrongTypesAndValuesAreRefusedNamingTheField) {
  EXPECT_EQ(Refused("{not json").message, "the request body is not valid JSON");
  EXPECT_EQ(Refused("[1]").http_status, 400);
  EXPECT_EQ(Refused(R"({"prompt":"a","max_tokens":"ten"})").param, "max_tokens");
  EXPECT_EQ(Refused(R"({"prompt":"a","max_tokens":-1})").param, "max_tokens");
  EXPECT_EQ(Refused(R"({"prompt":"a","max_tokens":0})").param, "max_tokens");
  EXPECT_EQ(Refused(R"({"prompt":"a","temperature":"hot"})").param, "temperature");
  EXPECT_EQ(Refused(R"({"prompt":"a","temperature":3})").param, "temperature");
  EXPECT_EQ(Refused(R"({"prompt":"a","top_p":0})").param, "top_p");
  EXPECT_EQ(Refused(R"({"prompt":"a","stream":"yes"})").param, "stream");
  EXPECT_EQ(Refused(R"({"prompt":"a","stop":["a","b","c","d","e"]})").param, "stop");
  EXPECT_EQ(Refused(R"({"prompt":"a","n":2})").param, "n");
  EXPECT_EQ(Refused(R"({"prompt":"a","logprobs":2})").param, "logprobs");
  EXPECT_EQ(Refused(R"({"prompt":"a","echo":true})").param, "echo");
  EXPECT_EQ(Refused(R"({"prompt":[1,300]})").param, "prompt");
  EXPECT_EQ(Refused(R"({"prompt":["a","b"]})").param, "prompt");
  EXPECT_EQ(Refused(R"({"max_tokens":3})").param, "prompt");
  EXPECT_EQ(Refused(R"({"messages":"hi"})", ApiKind::kChat).param, "messages");
  EXPECT_EQ(Refused(R"({"messages":[{"role":"robot","content":"hi"}]})", ApiKind::kChat).param,
            "messages");
  ApiError wrong_model = Refused(R"({"model":"gpt-4","prompt":"a"})");
  EXPECT_EQ(wrong_model.http_status, 404);
  EXPECT_EQ(wrong_model.code, "model_not_found");
}

TEST_F(OpenAiTest, APromptBeyondTheContextIsRefusedWithItsLengths) {
  const std::string long_prompt(2100, 'a');
  ApiError e = Refused(R"({"prompt":")" + long_prompt + R"("})");
  EXPECT_EQ(e.code, "context_length_exceeded");
  EXPECT_NE(e.message.find("2048"), std::string::npos) << e.message;
  // Room for the prompt but not for max_tokens.
  e = Refused(R"({"prompt":")" + std::string(2000, 'a') + R"(","max_tokens":100})");
  EXPECT_EQ(e.param, "max_tokens");
}

TEST_F(OpenAiTest, ChatUsesTheFamilysTemplateAndStopsAtItsEndOfTurn) {
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kChat,
                     R"({"messages":[{"role":"system","content":"S"},
                                     {"role":"user","content":[{"type":"text","text":"U"}]}]})",
                     &r));
  const std::string text = tokenizer_.Decode(r.prompt);
  EXPECT_EQ(text,
            "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(r.stop, std::vector<std::string>{"<|eot_id|>"});
  EXPECT_EQ(RenderChat(engine::Architecture::kQwen2, {{"user", "hi"}}).text,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(RenderChat(engine::Architecture::kMistral, {{"system", "S"}, {"user", "hi"}}).text,
            "[INST] S\n\nhi [/INST]");
}

TEST_F(OpenAiTest, ResponsesHaveOpenAisShapeAndCachedTokens) {
  Usage u{10, 3, 8};
  json c = CompletionResponse(ApiKind::kCompletion, "cmpl-1", 5, "tiny", "abc", "length", u);
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["text"], "abc");
  EXPECT_EQ(c["usage"]["total_tokens"], 13);
  EXPECT_EQ(c["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
  json chat = CompletionResponse(ApiKind::kChat, "c", 5, "tiny", "abc", "stop", u);
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "abc");
  std::string reason = "stop";
  json first = StreamChunk(ApiKind::kChat, "c", 5, "tiny", "a", nullptr, true);
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  json last = StreamChunk(ApiKind::kChat, "c", 5, "tiny", "", &reason, false);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  EXPECT_FALSE(last["choices"][0]["delta"].contains("content"));
  EXPECT_TRUE(StreamUsageChunk(ApiKind::kChat, "c", 5, "tiny", u)["choices"].empty());
}

TEST(Metrics, HistogramBucketsAreCumulativeAndEndInTheCount) {
  Histogram h({0.1, 1});
  h.Observe(0.05);
  h.Observe(0.5);
  h.Observe(0.5);
  h.Observe(7);
  std::string out;
  h.Render("x", &out);
  EXPECT_NE(out.find("x_bucket{le=\"0.1\"} 1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{le=\"1\"} 3\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_bucket{le=\"+Inf\"} 4\n"), std::string::npos) << out;
  EXPECT_NE(out.find("x_count 4\n"), std::string::npos) << out;
}

TEST(Metrics, RendersEveryDocumentedFamilyAndEscapesLabels) {
  Metrics m;
  m.RequestFinished("/v1/completions", 200);
  m.PromptTokens(768, 233);
  const std::string out = m.Render({{"we\"ird", "decode", true, 2, 10}});
  for (const char* name :
       {"kdn_requests_total", "kdn_requests_in_flight", "kdn_ttft_seconds", "kdn_inter_token_seconds",
        "kdn_prompt_tokens_total", "kdn_generated_tokens_total", "kdn_kv_bytes_moved_total",
        "kdn_kv_chunks_skipped_total", "kdn_worker_up", "kdn_worker_queue_depth",
        "kdn_worker_free_kv_blocks"}) {
    EXPECT_NE(out.find(std::string("# TYPE ") + name + " "), std::string::npos) << name;
  }
  EXPECT_NE(out.find("kdn_prompt_tokens_total{source=\"cached\"} 768\n"), std::string::npos);
  EXPECT_NE(out.find("worker=\"we\\\"ird\""), std::string::npos) << out;
}

}  // namespace
}  // namespace kdn::router
