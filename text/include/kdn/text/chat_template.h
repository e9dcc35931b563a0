#pragma once
// Chat prompts (docs/serving.md, "Chat"): a model folder's own Jinja chat
// template, rendered as transformers' apply_chat_template renders it
// (kdn/text/jinja.h), or, for a folder that has none, the built-in format of
// its family: ChatML for Qwen2, [INST] for Mistral, Llama 3's headers for
// Llama.
//
// A ChatTemplate is immutable once loaded; Render is const and thread-safe.

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/model/config.h"
#include "kdn/text/jinja.h"

namespace kdn::text {

// A rendered conversation.
struct ChatPrompt {
  std::string text;
  // The end-of-turn stop string: the folder's eos_token with a template
  // (empty when it has none), the family's own with a built-in format.
  std::string end_of_turn;
  // Whether the prompt is to be encoded with the tokenizer's BOS in front.
  // False for a folder's template, which writes BOS itself where the model
  // wants one ({{ bos_token }}), as transformers' apply_chat_template encodes
  // with add_special_tokens=False; true for the built-in formats.
  bool add_bos = true;
};

// (role, content) pairs, roles already validated (system, user, assistant).
using ChatMessages = std::vector<std::pair<std::string, std::string>>;

class ChatTemplate {
 public:
  // The template of the model folder `dir`: DIR/chat_template.jinja if there
  // is one (newer transformers write it, and prefer it), else
  // tokenizer_config.json's `chat_template` (a string, or a list of {name,
  // template} of which "default" is used); with bos_token and eos_token of
  // tokenizer_config.json (strings or {content} objects). A folder with
  // neither falls back to the built-in format of `arch`. Where `dir` is a GGUF
  // file, its tokenizer.chat_template, with the texts of the tokens that
  // tokenizer.ggml.bos_token_id, eos_token_id, unknown_token_id and
  // padding_token_id name (or llama.cpp's defaults, model::GgufTokenId). A template that does
  // not parse is InvalidArgument naming the file and the line.
  static Result<ChatTemplate> Load(const std::filesystem::path& dir, model::Architecture arch);

  // A template from its text; `name` leads its errors. bos and eos unset are
  // left undefined in the template, as transformers leaves them when the
  // tokenizer has none.
  static Result<ChatTemplate> FromSource(std::string_view source, std::string name,
                                         std::optional<std::string> bos_token,
                                         std::optional<std::string> eos_token);

  // The built-in format of `arch`.
  static ChatTemplate BuiltIn(model::Architecture arch);

  // Renders `messages` with `add_generation_prompt` (the assistant's turn
  // opened at the end). The template's raise_exception(message) is
  // InvalidArgument with exactly its message; other errors of the template
  // are InvalidArgument or Unimplemented naming its line (kdn/text/jinja.h).
  // The built-in formats cannot fail.
  Result<ChatPrompt> Render(const ChatMessages& messages, bool add_generation_prompt = true) const;

  // Whether this is a folder's Jinja template (not a built-in format).
  bool is_jinja() const { return jinja_ != nullptr; }

 private:
  // Constant after construction.
  model::Architecture arch_ = model::Architecture::kLlama;
  std::shared_ptr<const jinja::Template> jinja_;  // null: the built-in format
  jinja::Variables tokens_;  // bos_token, eos_token... as the template sees them
  std::string eos_token_;
};

// The built-in format of `arch`; with `add_generation_prompt`, ending where
// the assistant's next turn begins.
ChatPrompt RenderChat(model::Architecture arch, const ChatMessages& messages,
                      bool add_generation_prompt = true);

}  // namespace kdn::text
