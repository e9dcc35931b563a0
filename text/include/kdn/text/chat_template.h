#pragma once
// The chat templates of the model families kdn serves (docs/serving.md,
// "Chat"): ChatML for Qwen2, [INST] for Mistral, Llama 3's header format for
// Llama. Thread-safe (functions over values).

#include <string>
#include <utility>
#include <vector>

#include "kdn/model/config.h"

namespace kdn::text {

// A rendered conversation: the prompt text (BOS excluded) and the family's
// end-of-turn stop string.
struct ChatPrompt {
  std::string text;
  std::string end_of_turn;
};

// Renders `messages`, (role, text) pairs already validated (roles system,
// user, assistant), in the template of `arch`, ending where the assistant's
// next turn begins.
ChatPrompt RenderChat(model::Architecture arch,
                      const std::vector<std::pair<std::string, std::string>>& messages);

}  // namespace kdn::text
