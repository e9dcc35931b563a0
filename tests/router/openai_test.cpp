#include "kdn/router/openai.h"

#include <gtest/gtest.h>

#include <chrono>
#include <numeric>

#include "kdn/common/kv_block.h"
#include "kdn/engine/presets.h"

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

  model::ModelConfig config_;
  text::ByteTokenizer tokenizer_;
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

// Found by tests/fuzz/openai_fuzz.cpp: prompt length + max_tokens overflowed
// int64 (undefined; in practice a negative sum, and the request was taken with
// max_tokens cut to -1).
TEST_F(OpenAiTest, AHugeMaxTokensIsRefusedNotOverflowed) {
  const ApiError e = Refused(R"({"prompt":"a","max_tokens":9223372036854775807})");
  EXPECT_EQ(e.code, "context_length_exceeded");
  EXPECT_EQ(e.param, "max_tokens");
  EXPECT_NE(e.message.find("9223372036854775809"), std::string::npos) << e.message;
}

// Found by tests/fuzz/openai_fuzz.cpp: a content part whose "type" was not a
// string threw out of ParseRequest (json::value), which ended kdn-router.
TEST_F(OpenAiTest, AContentPartWhoseTypeIsNotAStringIsRefused) {
  for (const char* part : {R"({"type":5,"text":"x"})", R"({"type":null,"text":"x"})",
                           R"({"type":["text"],"text":"x"})", R"("text")"}) {
    const ApiError e = Refused(
        std::string(R"({"messages":[{"role":"user","content":[)") + part + "]}]}", ApiKind::kChat);
    EXPECT_EQ(e.param, "messages") << part;
  }
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
}

// cache_control (docs/serving.md, "Pinning a prefix"): on a chat message or
// one of its parts, the prompt through the last message so marked; on a
// completion, the whole prompt.
TEST_F(OpenAiTest, CacheControlPinsTheConversationThroughTheMarkedMessage) {
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kChat,
                     R"({"messages":[{"role":"system","content":"SYS",
                                      "cache_control":{"type":"ephemeral"}},
                                     {"role":"user","content":[{"type":"text","text":"U",
                                      "cache_control":{"type":"ephemeral","ttl":"1h"}}]},
                                     {"role":"assistant","content":"A"},
                                     {"role":"user","content":"V"}]})",
                     &r));
  ASSERT_TRUE(r.pin.has_value());
  EXPECT_EQ(r.pin->ttl, std::chrono::hours(1));
  const std::string head =
      "<|start_header_id|>system<|end_header_id|>\n\nSYS<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>";
  // BOS, then the two marked messages' text, byte for byte.
  EXPECT_EQ(r.pin->tokens, 1 + static_cast<int64_t>(head.size()));
  EXPECT_EQ(tokenizer_.Decode({r.prompt.begin() + 1, r.prompt.begin() + r.pin->tokens}), head);

  ApiRequest c;
  ASSERT_FALSE(Parse(ApiKind::kCompletion,
                     R"({"prompt":"abc","cache_control":{"type":"ephemeral","ttl":"90s"}})", &c));
  ASSERT_TRUE(c.pin.has_value());
  EXPECT_EQ(c.pin->tokens, 4);
  EXPECT_EQ(c.pin->ttl, std::chrono::seconds(90));
  ApiRequest d;
  ASSERT_FALSE(
      Parse(ApiKind::kCompletion, R"({"prompt":"abc","cache_control":{"type":"ephemeral"}})", &d));
  EXPECT_EQ(d.pin->ttl, std::chrono::minutes(5));
  ApiRequest none;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt":"abc"})", &none));
  EXPECT_FALSE(none.pin.has_value());
  EXPECT_FALSE(ToJob(std::move(none), "", "").pin.has_value());
  EXPECT_EQ(ToJob(std::move(c), "", "").pin->tokens, 4);
}

TEST_F(OpenAiTest, ABadCacheControlIsRefusedNamingTheField) {
  const std::string user = R"({"role":"user","content":"U"})";
  auto chat = [&](const std::string& cc) {
    return Refused(
        R"({"messages":[{"role":"system","content":"S","cache_control":)" + cc + "}," + user + "]}",
        ApiKind::kChat);
  };
  EXPECT_EQ(chat(R"("yes")").param, "messages[0].cache_control");
  EXPECT_EQ(chat(R"({"type":"persistent"})").param, "messages[0].cache_control.type");
  EXPECT_EQ(chat(R"({})").param, "messages[0].cache_control.type");
  EXPECT_EQ(chat(R"({"type":"ephemeral","ttl":"5d"})").param, "messages[0].cache_control.ttl");
  EXPECT_EQ(chat(R"({"type":"ephemeral","ttl":"0s"})").param, "messages[0].cache_control.ttl");
  EXPECT_EQ(chat(R"({"type":"ephemeral","ttl":"25h"})").param, "messages[0].cache_control.ttl");
  EXPECT_EQ(chat(R"({"type":"ephemeral","ttl":300})").param, "messages[0].cache_control.ttl");
  EXPECT_EQ(chat(R"({"type":"ephemeral","scope":"x"})").param, "messages[0].cache_control.scope");
  const ApiError part = Refused(
      R"({"messages":[{"role":"user","content":[{"type":"text","text":"U",
                                                 "cache_control":{"type":"e"}}]}]})",
      ApiKind::kChat);
  EXPECT_EQ(part.param, "messages[0].content[0].cache_control.type");
  EXPECT_NE(part.message.find("ephemeral"), std::string::npos);
  EXPECT_EQ(Refused(R"({"prompt":"a","cache_control":{"type":"ephemeral","ttl":"1x"}})").param,
            "cache_control.ttl");
  EXPECT_EQ(Refused(R"({"messages":[)" + user + R"(],"cache_control":{"type":"ephemeral"}})",
                    ApiKind::kChat)
                .param,
            "cache_control");
  EXPECT_EQ(
      Refused(R"({"prompt":"q","documents":["d"],"cache_control":{"type":"ephemeral"}})").param,
      "cache_control");
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

TEST_F(OpenAiTest, DocumentsBecomeSegmentsBetweenBosAndTheQuestion) {
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kCompletion,
                     R"({"prompt":"Q?","documents":["doc one\n","d2\n"],
                         "recompute_ratio":0.3,"check_layer":0})",
                     &r));
  EXPECT_EQ(tokenizer_.Decode(r.prompt), "doc one\nd2\nQ?");
  EXPECT_EQ(r.prompt.front(), 256);
  ASSERT_TRUE(r.blend.has_value());
  EXPECT_EQ(r.blend->head_tokens, 1);
  EXPECT_EQ(r.blend->segment_tokens, (std::vector<int>{8, 3}));
  EXPECT_DOUBLE_EQ(r.blend->recompute_ratio, 0.3);
  EXPECT_EQ(r.blend->check_layer, 0);

  // Without documents nothing is blended, and the defaults come from the server.
  ApiRequest plain;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt":"a # # b"})", &plain));
  EXPECT_FALSE(plain.blend.has_value());
}

TEST_F(OpenAiTest, ProgressiveChecksComeFromTheRequestOrTheServer) {
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kCompletion,
                     R"({"prompt":"Q?","documents":["d\n"],"check_layers":[0,1],
                         "check_ratios":[0.5,0.2]})",
                     &r));
  ASSERT_TRUE(r.blend.has_value());
  EXPECT_EQ(r.blend->check_layers, (std::vector<int>{0, 1}));
  EXPECT_EQ(r.blend->check_ratios, (std::vector<double>{0.5, 0.2}));
  EXPECT_DOUBLE_EQ(r.blend->recompute_ratio, 0.2);  // the last check's ratio is the target

  model_.check_layers = {0, 1};
  ApiRequest dflt;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt":"Q?","documents":["d"]})", &dflt));
  EXPECT_EQ(dflt.blend->check_layers, (std::vector<int>{0, 1}));
  EXPECT_TRUE(dflt.blend->check_ratios.empty());
  // A request naming one check layer gets one check there.
  ApiRequest one;
  ASSERT_FALSE(
      Parse(ApiKind::kCompletion, R"({"prompt":"Q?","documents":["d"],"check_layer":1})", &one));
  EXPECT_TRUE(one.blend->check_layers.empty());
  EXPECT_EQ(one.blend->check_layer, 1);
  // A request's own ratio replaces the server's check ratios with the
  // default ones for it (the server's last would not equal it).
  model_.check_ratios = {0.5, 0.15};
  ApiRequest own;
  ASSERT_FALSE(Parse(ApiKind::kCompletion,
                     R"({"prompt":"Q?","documents":["d"],"recompute_ratio":0.3})", &own));
  EXPECT_EQ(own.blend->check_layers, (std::vector<int>{0, 1}));
  EXPECT_TRUE(own.blend->check_ratios.empty());
  EXPECT_DOUBLE_EQ(own.blend->recompute_ratio, 0.3);
}

TEST_F(OpenAiTest, ASeparatorSplitsThePromptIntoDocumentsAndTheQuestion) {
  model_.separator = " # # ";
  model_.recompute_ratio = 0.05;
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt":"A # # BB # #  # # Q"})", &r));
  ASSERT_TRUE(r.blend.has_value());
  EXPECT_EQ(tokenizer_.Decode(r.prompt), "ABBQ");  // separators dropped, empty pieces too
  EXPECT_EQ(r.blend->segment_tokens, (std::vector<int>{1, 2}));
  EXPECT_DOUBLE_EQ(r.blend->recompute_ratio, 0.05);
  // A request's own separator wins; one that does not occur leaves the prompt whole.
  ApiRequest own;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt":"x|y # # z","separator":"|"})", &own));
  EXPECT_EQ(own.blend->segment_tokens, (std::vector<int>{1}));
  ApiRequest none;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt":"xyz"})", &none));
  EXPECT_FALSE(none.blend.has_value());
  EXPECT_EQ(Refused(R"({"prompt":"A # # "})").message,
            "the text after the documents (the question) is empty");
}

TEST_F(OpenAiTest, ChatDocumentsOpenTheLastUserMessage) {
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kChat,
                     R"({"messages":[{"role":"user","content":"old"},
                                     {"role":"assistant","content":"A"},
                                     {"role":"user","content":"Q?"}],
                         "documents":["D1 ","D2 "]})",
                     &r));
  ASSERT_TRUE(r.blend.has_value());
  const std::string head =
      "<|start_header_id|>user<|end_header_id|>\n\nold<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\n";
  EXPECT_EQ(tokenizer_.Decode(r.prompt),
            head + "D1 D2 Q?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(r.blend->head_tokens, 1 + static_cast<int>(head.size()));
  EXPECT_EQ(r.blend->segment_tokens, (std::vector<int>{3, 3}));
  EXPECT_EQ(
      Refused(R"({"messages":[{"role":"system","content":"S"}],"documents":["d"]})", ApiKind::kChat)
          .param,
      "documents");
}

// A folder's template, which writes BOS itself and trims the messages as
// Llama 3's does.
text::ChatTemplate TrimmingTemplate() {
  auto t = text::ChatTemplate::FromSource(
      "{{ bos_token }}{% for m in messages %}"
      "{% if m.role == 'assistant' and loop.first %}{{ raise_exception('a user speaks first') }}{% "
      "endif %}"
      "<{{ m.role }}>{{ m.content | trim }}</>{% endfor %}"
      "{% if add_generation_prompt %}<assistant>{% endif %}",
      "test.jinja", "<s>", "</s>");
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

TEST_F(OpenAiTest, ChatWithTheFoldersTemplateAddsNoBosOfItsOwnAndStopsAtItsEos) {
  const text::ChatTemplate tpl = TrimmingTemplate();
  model_.chat_template = &tpl;
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kChat, R"({"messages":[{"role":"user","content":" hi "}]})", &r));
  // "<s>" is the template's text: this byte-level tokenizer spells it out.
  EXPECT_EQ(r.prompt.front(), '<');
  EXPECT_EQ(tokenizer_.Decode(r.prompt), "<s><user>hi</><assistant>");
  EXPECT_EQ(r.stop, std::vector<std::string>{"</s>"});
  EXPECT_EQ(r.stop_ids, std::vector<int32_t>{257});
}

TEST_F(OpenAiTest, ChatDocumentsSurviveATemplateThatTrimsTheMessage) {
  const text::ChatTemplate tpl = TrimmingTemplate();
  model_.chat_template = &tpl;
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kChat,
                     R"({"messages":[{"role":"user","content":"Q? "}],"documents":["D1 ","D2 "]})",
                     &r));
  ASSERT_TRUE(r.blend.has_value());
  const std::string head = "<s><user>";
  EXPECT_EQ(tokenizer_.Decode(r.prompt), head + "D1 D2 Q?</><assistant>");
  EXPECT_EQ(r.blend->head_tokens, static_cast<int>(head.size()));  // no BOS id before it
  EXPECT_EQ(r.blend->segment_tokens, (std::vector<int>{3, 3}));
}

TEST_F(OpenAiTest, ChatTemplateRaisingIsABadRequestWithItsMessage) {
  const text::ChatTemplate tpl = TrimmingTemplate();
  model_.chat_template = &tpl;
  const ApiError e =
      Refused(R"({"messages":[{"role":"assistant","content":"A"}]})", ApiKind::kChat);
  EXPECT_EQ(e.http_status, 400);
  EXPECT_EQ(e.message, "the model's chat template refused the messages: a user speaks first");
  EXPECT_EQ(e.param, "messages");
}

TEST_F(OpenAiTest, ChatDocumentsAreRefusedWhereTheTemplateDropsTheUserMessage) {
  auto tpl = text::ChatTemplate::FromSource("{% for m in messages %}{{ m.role }}{% endfor %}", "t",
                                            std::nullopt, std::nullopt);
  ASSERT_TRUE(tpl.ok());
  model_.chat_template = &*tpl;
  EXPECT_EQ(
      Refused(R"({"messages":[{"role":"user","content":"Q"}],"documents":["D"]})", ApiKind::kChat)
          .param,
      "documents");
}

TEST_F(OpenAiTest, BadDocumentsAndBlendSettingsAreRefused) {
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":"d"})").param, "documents");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":[]})").param, "documents");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":["a",""]})").message,
            "documents[1] must be a non-empty string or {\"text\", \"erratum\"}");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":[{"text":"a","erratum":""}]})").param,
            "documents[0].erratum");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":[{"erratum":"x"}]})").param, "documents[0].text");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":["a",{"text":"b","steer":"v"}]})").param,
            "documents[1].steer");
  EXPECT_EQ(Refused(R"({"prompt":[1,2],"documents":["a"]})").param, "prompt");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":["a"],"recompute_ratio":1.5})").param,
            "recompute_ratio");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":["a"],"check_layer":2})").message,
            "'check_layer' must be in [0, 2) for this model");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":["a"],"check_layers":[1,0]})").param,
            "check_layers");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":["a"],"check_layers":[0,2]})").param,
            "check_layers");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":["a"],"check_layers":"0,1"})").param,
            "check_layers");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":["a"],"check_layers":[0,1],
                        "check_ratios":[0.1,0.2]})")
                .param,
            "check_ratios");
  EXPECT_EQ(Refused(R"({"prompt":"q","documents":["a"],"check_layers":[0,1],
                        "check_ratios":[0.5,0.3],"recompute_ratio":0.15})")
                .message,
            "'check_layers' and 'check_ratios': the last of check_ratios must equal "
            "recompute_ratio");
  EXPECT_EQ(Refused(R"({"prompt":"q","separator":7})").param, "separator");
}

TEST_F(OpenAiTest, InjectTakesDocumentsAndRefusesOversizedOnes) {
  InjectApiRequest r;
  ASSERT_FALSE(
      ParseInjectRequest(R"({"documents":["ab","c"],"cache_salt":"t","stream":true})", model_, &r));
  EXPECT_EQ(r.documents, (std::vector<std::vector<int32_t>>{{'a', 'b'}, {'c'}}));
  EXPECT_EQ(r.cache_salt, "t");
  EXPECT_TRUE(r.stream);
  InjectApiRequest bad;
  EXPECT_EQ(ParseInjectRequest("{}", model_, &bad)->param, "documents");
  auto e =
      ParseInjectRequest(R"({"documents":[")" + std::string(3000, 'x') + R"("]})", model_, &bad);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->code, "context_length_exceeded");
}

// A document with an erratum is one segment: its text's tokens, then the
// erratum's; an injection of it names the text's as the base.
TEST_F(OpenAiTest, AnErratumFollowsItsDocumentInOneSegment) {
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kCompletion,
                     R"({"prompt":"Q?","documents":[{"text":"doc\n","erratum":"no!"},"d2\n"]})",
                     &r));
  EXPECT_EQ(tokenizer_.Decode(r.prompt), "doc\nno!d2\nQ?");
  ASSERT_TRUE(r.blend.has_value());
  EXPECT_EQ(r.blend->segment_tokens, (std::vector<int>{7, 3}));

  InjectApiRequest inject;
  ASSERT_FALSE(
      ParseInjectRequest(R"({"documents":[{"text":"ab","erratum":"c"},"d"]})", model_, &inject));
  EXPECT_EQ(inject.documents, (std::vector<std::vector<int32_t>>{{'a', 'b', 'c'}, {'d'}}));
  EXPECT_EQ(inject.base_tokens, (std::vector<int64_t>{2, 0}));
  EXPECT_FALSE(inject.edit);

  InjectApiRequest edit;
  ASSERT_FALSE(
      ParseEditRequest(R"({"document":"ab","erratum":"cd","cache_salt":"t"})", model_, &edit));
  EXPECT_EQ(edit.documents, (std::vector<std::vector<int32_t>>{{'a', 'b', 'c', 'd'}}));
  EXPECT_EQ(edit.base_tokens, (std::vector<int64_t>{2}));
  EXPECT_EQ(edit.cache_salt, "t");
  EXPECT_TRUE(edit.edit);
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"erratum":"x"})", "document"},
           {R"({"document":"ab"})", "erratum"},
           {R"({"document":"","erratum":"x"})", "document"},
           {R"({"document":"ab","erratum":["x"]})", "erratum"},
           {R"({"document":"ab","erratum":"x","steer":{"vector":"v"}})", "steer"},
           {R"({"document":"ab","erratum":")" + std::string(3000, 'x') + R"("})", "erratum"},
       }) {
    InjectApiRequest bad;
    auto e = ParseEditRequest(body, model_, &bad);
    ASSERT_TRUE(e.has_value()) << body;
    EXPECT_EQ(e->param, param) << body;
    EXPECT_EQ(e->http_status, 400) << body;
  }
}

// Steering (docs/serving.md, "Steering a document"): a vector made from
// prompt pairs, a steer edit of a stored document, and a request's document
// naming its steered version.
TEST_F(OpenAiTest, SteeringVectorsSteerEditsAndSteeredDocumentsParseAndBadOnesNameTheirField) {
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kCompletion,
                     R"({"prompt":"Q?","documents":[{"text":"ab","steer":{"vector":"trust",
                         "strength":2}},"cd"]})",
                     &r));
  ASSERT_TRUE(r.blend.has_value());
  EXPECT_EQ(r.blend->steer, (std::vector<std::optional<blend::SteerSpec>>{
                                blend::SteerSpec{"trust", 2.0f}, std::nullopt}));
  ApiRequest plain;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt":"Q?","documents":["ab","cd"]})", &plain));
  EXPECT_TRUE(plain.blend->steer.empty());

  InjectApiRequest edit;
  ASSERT_FALSE(ParseEditRequest(
      R"({"document":"ab","steer":{"vector":"trust","strength":-1.5},"cache_salt":"t"})", model_,
      &edit));
  EXPECT_EQ(edit.documents, (std::vector<std::vector<int32_t>>{{'a', 'b'}}));
  EXPECT_EQ(edit.base_tokens, (std::vector<int64_t>{0}));
  EXPECT_EQ(edit.steer, (blend::SteerSpec{"trust", -1.5f}));
  EXPECT_EQ(edit.cache_salt, "t");
  EXPECT_TRUE(edit.edit);

  InjectApiRequest vector;
  ASSERT_FALSE(ParseSteeringRequest(
      R"({"name":"trust","pairs":[{"positive":"yes","negative":"no"}],"cache_salt":"t"})", model_,
      &vector));
  ASSERT_TRUE(vector.steering_vector.has_value());
  EXPECT_EQ(vector.steering_vector->name, "trust");
  EXPECT_EQ(vector.steering_vector->layers, blend::MiddleThirdLayers(config_.num_layers));
  ASSERT_EQ(vector.steering_vector->pairs.size(), 1u);
  EXPECT_EQ(vector.steering_vector->pairs[0].first, tokenizer_.Encode("yes", true));
  EXPECT_EQ(vector.steering_vector->pairs[0].second, tokenizer_.Encode("no", true));
  EXPECT_TRUE(vector.documents.empty());
  EXPECT_EQ(vector.cache_salt, "t");
  InjectApiRequest layered;
  ASSERT_FALSE(ParseSteeringRequest(
      R"({"name":"v.2","pairs":[{"positive":"a","negative":"b"}],"layers":[0,1]})", model_,
      &layered));
  EXPECT_EQ(layered.steering_vector->layers, (std::vector<int>{0, 1}));

  const std::string doc = R"({"prompt":"Q?","documents":[{"text":"ab","steer":)";
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {doc + R"({"strength":1}}]})", "documents[0].steer.vector"},
           {doc + R"({"vector":"a b","strength":1}}]})", "documents[0].steer.vector"},
           {doc + R"({"vector":"v"}}]})", "documents[0].steer.strength"},
           {doc + R"({"vector":"v","strength":0}}]})", "documents[0].steer.strength"},
           {doc + R"({"vector":"v","strength":17}}]})", "documents[0].steer.strength"},
           {doc + R"({"vector":"v","strength":1e-50}}]})", "documents[0].steer.strength"},
           {doc + R"({"vector":"v","strength":1,"layers":[1]}}]})", "documents[0].steer.layers"},
           {doc + R"("v"}]})", "documents[0].steer"},
           {R"({"prompt":"Q?","documents":[{"text":"ab","erratum":"c",
                "steer":{"vector":"v","strength":1}}]})",
            "documents[0].steer"},
       }) {
    ApiRequest bad;
    auto e = Parse(ApiKind::kCompletion, body, &bad);
    ASSERT_TRUE(e.has_value()) << body;
    EXPECT_EQ(e->param, param) << body;
    EXPECT_EQ(e->http_status, 400) << body;
  }
  InjectApiRequest inject;
  auto refused = ParseInjectRequest(
      R"({"documents":[{"text":"ab","steer":{"vector":"v","strength":1}}]})", model_, &inject);
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->param, "documents[0].steer");
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"document":"ab","steer":{"vector":"v","strength":99}})", "steer.strength"},
           {R"({"document":"ab","steer":"v"})", "steer"},
           {R"({"steer":{"vector":"v","strength":1}})", "document"},
       }) {
    InjectApiRequest bad;
    auto e = ParseEditRequest(body, model_, &bad);
    ASSERT_TRUE(e.has_value()) << body;
    EXPECT_EQ(e->param, param) << body;
  }
  const std::string pair = R"([{"positive":"a","negative":"b"}])";
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"pairs":)" + pair + "}", "name"},
           {R"({"name":"","pairs":)" + pair + "}", "name"},
           {R"({"name":"a/b","pairs":)" + pair + "}", "name"},
           {R"({"name":"v"})", "pairs"},
           {R"({"name":"v","pairs":[]})", "pairs"},
           {R"({"name":"v","pairs":[{"positive":"a"}]})", "pairs[0]"},
           {R"({"name":"v","pairs":[{"positive":"a","negative":""}]})", "pairs[0].negative"},
           {R"({"name":"v","pairs":)" + pair + R"(,"layers":[1,0]})", "layers"},
           {R"({"name":"v","pairs":)" + pair + R"(,"layers":[9]})", "layers"},
           {R"({"name":"v","pairs":)" + pair + R"(,"layers":[4294967296]})", "layers"},
           {R"({"name":"v","pairs":)" + pair + R"(,"layers":"1"})", "layers"},
           {R"({"name":"v","pairs":)" + pair + R"(,"strength":1})", "strength"},
       }) {
    InjectApiRequest bad;
    auto e = ParseSteeringRequest(body, model_, &bad);
    ASSERT_TRUE(e.has_value()) << body;
    EXPECT_EQ(e->param, param) << body;
    EXPECT_EQ(e->http_status, 400) << body;
  }
}

// A document's emphasized phrases become prompt positions; the request's
// 'emphasis' (or the router's defaults) the heads and the strength
// (docs/serving.md, "Emphasis").
TEST_F(OpenAiTest, EmphasizedPhrasesBecomeSpansOfThePromptWithTheirHeadsAndStrength) {
  const int layers = config_.num_layers, heads = config_.num_heads;
  ApiRequest r;
  ASSERT_FALSE(Parse(ApiKind::kCompletion,
                     R"({"prompt":"Q?","documents":["zero\n",
                         {"text":"one two\n","erratum":"three","emphasize":["two","three"]},
                         {"text":"four four","emphasize":"four"}]})",
                     &r));
  ASSERT_TRUE(r.blend.has_value() && r.blend->emphasis.has_value());
  // BOS and "zero\n" (5), then "one two\n" and its erratum at 6: "two" at
  // 10, "three" at 14 to 19; the third document at 19, whose first "four"
  // touches "three" and is merged with it.
  EXPECT_EQ(r.blend->emphasis->spans,
            (std::vector<std::pair<int64_t, int64_t>>{{10, 13}, {14, 23}}));
  EXPECT_EQ(r.blend->emphasis->heads, heads);
  // The default: the middle third's heads at the default strength.
  std::vector<float> want(static_cast<size_t>(layers) * heads, 0.0f);
  for (const blend::EmphasisHead& h : blend::MiddleThirdHeads(layers, heads)) {
    want[static_cast<size_t>(h.layer) * heads + h.head] =
        static_cast<float>(blend::kDefaultEmphasisStrength);
  }
  EXPECT_EQ(r.blend->emphasis->bias, want);

  ApiRequest named;
  ASSERT_FALSE(Parse(ApiKind::kCompletion,
                     R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":"b"}],
                         "emphasis":{"strength":2,"heads":[[0,1]]}})",
                     &named));
  std::vector<float> one(static_cast<size_t>(layers) * heads, 0.0f);
  one[1] = 2.0f;
  EXPECT_EQ(named.blend->emphasis->bias, one);
  EXPECT_EQ(named.blend->emphasis->spans, (std::vector<std::pair<int64_t, int64_t>>{{2, 3}}));

  // In a chat request, after the template's head: the span holds the phrase.
  ApiRequest chat;
  ASSERT_FALSE(Parse(ApiKind::kChat,
                     R"({"messages":[{"role":"user","content":"Q? "}],
                         "documents":["D1 ",{"text":"one two ","emphasize":"two"}]})",
                     &chat));
  ASSERT_TRUE(chat.blend.has_value() && chat.blend->emphasis.has_value());
  ASSERT_EQ(chat.blend->emphasis->spans.size(), 1u);
  const auto [begin, end] = chat.blend->emphasis->spans[0];
  EXPECT_EQ(tokenizer_.Decode(std::span(chat.prompt).subspan(begin, end - begin)), "two");

  ApiRequest plain;
  ASSERT_FALSE(Parse(ApiKind::kCompletion, R"({"prompt":"Q?","documents":["ab"]})", &plain));
  EXPECT_FALSE(plain.blend->emphasis.has_value());

  const std::string too_many_layers = "[[" + std::to_string(layers) + ",0]]";
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":"x"}]})",
            "documents[0].emphasize"},
           {R"({"prompt":"Q?","documents":["c",{"text":"ab","emphasize":""}]})",
            "documents[1].emphasize"},
           {R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":["a",3]}]})",
            "documents[0].emphasize"},
           {R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":[]}]})",
            "documents[0].emphasize"},
           {R"({"prompt":"Q?","documents":["ab"],"emphasis":{"strength":1}})", "emphasis"},
           {R"({"prompt":"Q?","emphasis":{}})", "emphasis"},
           {R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":"a"}],"emphasis":2})",
            "emphasis"},
           {R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":"a"}],
                "emphasis":{"strength":0}})",
            "emphasis.strength"},
           {R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":"a"}],
                "emphasis":{"strength":"big"}})",
            "emphasis.strength"},
           {R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":"a"}],
                "emphasis":{"heads":)" +
                too_many_layers + "}}",
            "emphasis.heads"},
           {R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":"a"}],
                "emphasis":{"heads":[[0,0],[0,0]]}})",
            "emphasis.heads"},
           {R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":"a"}],
                "emphasis":{"heads":[0]}})",
            "emphasis.heads"},
           {R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":"a"}],
                "emphasis":{"heads":[[4294967296,0]]}})",
            "emphasis.heads"},
           {R"({"prompt":"Q?","documents":[{"text":"ab","emphasize":"a"}],
                "emphasis":{"layers":[0]}})",
            "emphasis.layers"},
       }) {
    const ApiError e = Refused(body);
    EXPECT_EQ(e.param, param) << body;
    EXPECT_EQ(e.http_status, 400) << body;
  }
  // Inject stores the document as it is: emphasis changes no stored KV.
  InjectApiRequest inject;
  ASSERT_FALSE(
      ParseInjectRequest(R"({"documents":[{"text":"ab","emphasize":"a"}]})", model_, &inject));
  EXPECT_EQ(inject.documents, (std::vector<std::vector<int32_t>>{{'a', 'b'}}));
}

TEST_F(OpenAiTest, UsageTellsBlendedAndRecomputedTokensOfABlendRequest) {
  Usage plain{10, 3, 8};
  EXPECT_FALSE(UsageJson(plain)["prompt_tokens_details"].contains("blended_tokens"));
  Usage u{100, 3, 90, true, 90, 14};
  json j = UsageJson(u)["prompt_tokens_details"];
  EXPECT_EQ(j["cached_tokens"], 90);
  EXPECT_EQ(j["blended_tokens"], 90);
  EXPECT_EQ(j["recomputed_tokens"], 14);
}

}  // namespace
}  // namespace kdn::router
