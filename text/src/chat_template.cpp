#include "kdn/text/chat_template.h"

namespace kdn::text {

ChatPrompt RenderChat(model::Architecture arch,
                      const std::vector<std::pair<std::string, std::string>>& messages) {
  ChatPrompt p;
  switch (arch) {
    case model::Architecture::kQwen2:
      for (const auto& [role, text] : messages) {
        p.text += "<|im_start|>" + role + "\n" + text + "<|im_end|>\n";
      }
      p.text += "<|im_start|>assistant\n";
      p.end_of_turn = "<|im_end|>";
      break;
    case model::Architecture::kMistral: {
      // Mistral has no system role: a system message leads the next user turn.
      std::string pending_system;
      for (const auto& [role, text] : messages) {
        if (role == "system") {
          pending_system += text + "\n\n";
        } else if (role == "user") {
          p.text += "[INST] " + pending_system + text + " [/INST]";
          pending_system.clear();
        } else {
          p.text += text + "</s>";
        }
      }
      p.end_of_turn = "</s>";
      break;
    }
    case model::Architecture::kLlama:
      for (const auto& [role, text] : messages) {
        p.text += "<|start_header_id|>" + role + "<|end_header_id|>\n\n" + text + "<|eot_id|>";
      }
      p.text += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      p.end_of_turn = "<|eot_id|>";
      break;
  }
  return p;
}

}  // namespace kdn::text
