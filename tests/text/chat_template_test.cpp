#include "kdn/text/chat_template.h"

#include <gtest/gtest.h>

#include <fstream>

#include "kdn/testing/temp_dir.h"

namespace kdn::text {
namespace {

using kdn::testing::TempDir;

void Write(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

const ChatMessages kHi = {{"user", "hi"}};

TEST(RenderChat, QwenUsesChatMlAndEndsAtImEnd) {
  const ChatPrompt p = RenderChat(model::Architecture::kQwen2, {{"user", "hi"}});
  EXPECT_EQ(p.text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(p.end_of_turn, "<|im_end|>");
  EXPECT_TRUE(p.add_bos);
}

TEST(RenderChat, MistralFoldsTheSystemMessageIntoTheNextUserTurn) {
  const ChatPrompt p =
      RenderChat(model::Architecture::kMistral,
                 {{"system", "S"}, {"user", "hi"}, {"assistant", "A"}, {"user", "more"}});
  EXPECT_EQ(p.text, "[INST] S\n\nhi [/INST]A</s>[INST] more [/INST]");
  EXPECT_EQ(p.end_of_turn, "</s>");
}

TEST(RenderChat, LlamaUsesHeadersAndEndsAtEotId) {
  const ChatPrompt p = RenderChat(model::Architecture::kLlama, {{"system", "S"}, {"user", "U"}});
  EXPECT_EQ(p.text,
            "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(p.end_of_turn, "<|eot_id|>");
}

TEST(RenderChat, LeavesTheAssistantTurnClosedWithoutTheGenerationPrompt) {
  const ChatPrompt p = RenderChat(model::Architecture::kQwen2, {{"user", "hi"}}, false);
  EXPECT_EQ(p.text, "<|im_start|>user\nhi<|im_end|>\n");
}

TEST(ChatTemplate, RendersTheTemplateOfTokenizerConfigWithItsTokens) {
  TempDir dir;
  // eos_token as an AddedToken object, as older transformers save it.
  Write(dir.path() / "tokenizer_config.json", R"({
    "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}{{ eos_token }}",
    "bos_token": "<s>",
    "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": false}
  })");
  auto t = ChatTemplate::Load(dir.path(), model::Architecture::kLlama);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_TRUE(t->is_jinja());
  auto p = t->Render({{"system", "S"}, {"user", "hi"}});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->text, "<s>[system:S][user:hi]></s>");
  EXPECT_EQ(p->end_of_turn, "</s>");
  EXPECT_FALSE(p->add_bos);  // the template writes BOS itself
  p = t->Render(kHi, /*add_generation_prompt=*/false);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->text, "<s>[user:hi]</s>");
}

TEST(ChatTemplate, LeavesATokenTheFolderDoesNotHaveUndefined) {
  TempDir dir;
  Write(
      dir.path() / "tokenizer_config.json",
      R"({"chat_template": "{{ bos_token is defined }}|{{ tools is none }}", "bos_token": null})");
  auto t = ChatTemplate::Load(dir.path(), model::Architecture::kQwen2);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto p = t->Render(kHi);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->text, "False|True");
  EXPECT_EQ(p->end_of_turn, "");
}

TEST(ChatTemplate, UsesTheDefaultOfNamedTemplates) {
  TempDir dir;
  Write(dir.path() / "tokenizer_config.json", R"({"chat_template": [
    {"name": "tool_use", "template": "tools"},
    {"name": "default", "template": "plain"}]})");
  auto t = ChatTemplate::Load(dir.path(), model::Architecture::kLlama);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->Render(kHi)->text, "plain");

  Write(dir.path() / "tokenizer_config.json",
        R"({"chat_template": [{"name": "rag", "template": "x"}]})");
  t = ChatTemplate::Load(dir.path(), model::Architecture::kLlama);
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("none named 'default'"), std::string::npos);
}

TEST(ChatTemplate, PrefersChatTemplateJinjaToTokenizerConfig) {
  TempDir dir;
  Write(dir.path() / "tokenizer_config.json",
        R"({"chat_template": "from config", "eos_token": "<e>"})");
  Write(dir.path() / "chat_template.jinja", "from file\n");
  auto t = ChatTemplate::Load(dir.path(), model::Architecture::kLlama);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto p = t->Render(kHi);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->text, "from file");  // jinja2 drops one trailing newline
  EXPECT_EQ(p->end_of_turn, "<e>");
}

TEST(ChatTemplate, FallsBackToTheBuiltInFormatWithoutATemplate) {
  TempDir dir;
  Write(dir.path() / "tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "</s>"})");
  auto t = ChatTemplate::Load(dir.path(), model::Architecture::kQwen2);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_FALSE(t->is_jinja());
  auto p = t->Render(kHi);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->text, RenderChat(model::Architecture::kQwen2, kHi).text);
  EXPECT_EQ(p->end_of_turn, "<|im_end|>");
  EXPECT_TRUE(p->add_bos);
}

TEST(ChatTemplate, RefusesATemplateThatDoesNotParseNamingTheFileAndLine) {
  TempDir dir;
  Write(dir.path() / "chat_template.jinja",
        "{% for m in messages %}\n{{ m.content }\n{% endfor %}");
  auto t = ChatTemplate::Load(dir.path(), model::Architecture::kLlama);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  const std::string want = (dir.path() / "chat_template.jinja").string() + ", line 2: ";
  EXPECT_EQ(t.status().message().rfind(want, 0), 0u) << t.status().message();
}

TEST(ChatTemplate, TurnsRaiseExceptionIntoInvalidArgumentWithTheTemplatesMessage) {
  auto t = ChatTemplate::FromSource(
      "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a "
      "user') }}"
      "{% endif %}ok",
      "t", std::nullopt, std::nullopt);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto p = t->Render({{"assistant", "A"}});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.status().message(), "Conversations must start with a user");
  EXPECT_EQ(t->Render(kHi)->text, "ok");
}

}  // namespace
}  // namespace kdn::text
