#include "kdn/text/chat_template.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kdn/model/gguf.h"

namespace kdn::text {

namespace {

Result<std::string> ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError("cannot read " + path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A special token of tokenizer_config.json: a string, or an AddedToken's
// {"content": ...}; null and absent are none.
std::optional<std::string> TokenText(const nlohmann::json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) return content->get<std::string>();
  }
  return std::nullopt;
}

}  // namespace

Result<ChatTemplate> ChatTemplate::FromSource(std::string_view source, std::string name,
                                              std::optional<std::string> bos_token,
                                              std::optional<std::string> eos_token) {
  KDN_ASSIGN_OR_RETURN(jinja::Template t, jinja::Template::Parse(source, std::move(name)));
  ChatTemplate c;
  c.jinja_ = std::make_shared<const jinja::Template>(std::move(t));
  if (bos_token) c.tokens_.emplace_back("bos_token", *bos_token);
  if (eos_token) {
    c.tokens_.emplace_back("eos_token", *eos_token);
    c.eos_token_ = *eos_token;
  }
  return c;
}

Result<ChatTemplate> ChatTemplate::Load(const std::filesystem::path& dir,
                                        model::Architecture arch) {
  nlohmann::json config = nlohmann::json::object();
  auto config_path = dir / "tokenizer_config.json";
  if (model::IsGgufPath(dir)) {
    // tokenizer.chat_template, and the special tokens' texts by their ids,
    // read as tokenizer_config.json's fields.
    KDN_ASSIGN_OR_RETURN(auto file, model::GgufFile::Open(dir));
    config_path = dir.string() + " (tokenizer.*)";
    if (file->Find("tokenizer.chat_template") != nullptr) {
      KDN_ASSIGN_OR_RETURN(config["chat_template"], file->String("tokenizer.chat_template"));
    }
    std::vector<std::string> tokens;
    if (file->Find("tokenizer.ggml.tokens") != nullptr) {
      KDN_ASSIGN_OR_RETURN(tokens, file->Strings("tokenizer.ggml.tokens"));
    }
    for (const char* name : {"bos", "eos", "unknown", "padding"}) {
      KDN_ASSIGN_OR_RETURN(
          const int64_t id,
          model::GgufTokenId(*file, std::string("tokenizer.ggml.") + name + "_token_id"));
      if (id < 0 || id >= static_cast<int64_t>(tokens.size())) continue;
      const std::string field = name == std::string("unknown")   ? "unk_token"
                                : name == std::string("padding") ? "pad_token"
                                                                 : std::string(name) + "_token";
      config[field] = tokens[static_cast<size_t>(id)];
    }
  } else if (std::filesystem::exists(config_path)) {
    KDN_ASSIGN_OR_RETURN(std::string text, ReadFile(config_path));
    config = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!config.is_object()) return Corruption(config_path.string() + " is not a JSON object");
  }
  std::string source, name;
  const auto jinja_path = dir / "chat_template.jinja";
  if (!model::IsGgufPath(dir) && std::filesystem::exists(jinja_path)) {
    KDN_ASSIGN_OR_RETURN(source, ReadFile(jinja_path));
    name = jinja_path.string();
  } else if (auto it = config.find("chat_template"); it != config.end() && !it->is_null()) {
    name = config_path.string() + " (chat_template)";
    if (it->is_string()) {
      source = it->get<std::string>();
    } else if (it->is_array()) {
      // Named templates (transformers uses "default" when no tools are given).
      bool found = false;
      for (const auto& t : *it) {
        if (t.is_object() && t.value("name", nlohmann::json()) == "default" &&
            t.contains("template") && t["template"].is_string()) {
          source = t["template"].get<std::string>();
          found = true;
        }
      }
      if (!found) return InvalidArgument(name + ": a list of templates with none named 'default'");
    } else {
      return InvalidArgument(name + " must be a string or a list of {name, template}");
    }
  } else {
    return BuiltIn(arch);
  }
  // Every special token transformers passes (its special_tokens_map), though
  // templates use bos_token and eos_token only.
  KDN_ASSIGN_OR_RETURN(ChatTemplate c, FromSource(source, name, TokenText(config, "bos_token"),
                                                  TokenText(config, "eos_token")));
  for (const char* key : {"unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    if (auto t = TokenText(config, key)) c.tokens_.emplace_back(key, *t);
  }
  c.arch_ = arch;
  return c;
}

ChatTemplate ChatTemplate::BuiltIn(model::Architecture arch) {
  ChatTemplate c;
  c.arch_ = arch;
  return c;
}

Result<ChatPrompt> ChatTemplate::Render(const ChatMessages& messages,
                                        bool add_generation_prompt) const {
  if (jinja_ == nullptr) return RenderChat(arch_, messages, add_generation_prompt);
  std::vector<jinja::Value> list;
  list.reserve(messages.size());
  for (const auto& [role, content] : messages) {
    list.push_back(jinja::Value::Object({{"role", role}, {"content", content}}));
  }
  jinja::Variables vars = tokens_;
  vars.emplace_back("messages", jinja::Value::Array(std::move(list)));
  vars.emplace_back("add_generation_prompt", add_generation_prompt);
  // transformers passes these as None when the request has none: templates
  // test `tools is not none` as often as `tools is defined`.
  vars.emplace_back("tools", jinja::Value::None());
  vars.emplace_back("documents", jinja::Value::None());
  KDN_ASSIGN_OR_RETURN(std::string text, jinja_->Render(vars));
  return ChatPrompt{std::move(text), eos_token_, /*add_bos=*/false};
}

ChatPrompt RenderChat(model::Architecture arch, const ChatMessages& messages,
                      bool add_generation_prompt) {
  ChatPrompt p;
  switch (arch) {
    case model::Architecture::kQwen2:
      for (const auto& [role, text] : messages) {
        p.text += "<|im_start|>" + role + "\n" + text + "<|im_end|>\n";
      }
      if (add_generation_prompt) p.text += "<|im_start|>assistant\n";
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
      if (add_generation_prompt) p.text += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      p.end_of_turn = "<|eot_id|>";
      break;
  }
  return p;
}

}  // namespace kdn::text
