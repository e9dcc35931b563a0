#include "kdn/text/chat_template.h"

#include <gtest/gtest.h>

namespace kdn::text {
namespace {

TEST(RenderChat, QwenUsesChatMlAndEndsAtImEnd) {
  const ChatPrompt p = RenderChat(model::Architecture::kQwen2, {{"user", "hi"}});
  EXPECT_EQ(p.text, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(p.end_of_turn, "<|im_end|>");
}

TEST(RenderChat, MistralFoldsTheSystemMessageIntoTheNextUserTurn) {
  const ChatPrompt p = RenderChat(model::Architecture::kMistral,
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

}  // namespace
}  // namespace kdn::text
