// The OpenAI-compatible answers of kdn-router (openai.h): error, usage,
// whole responses and stream chunks. Requests are parsed in openai.cpp.
#include "kdn/router/openai.h"

namespace kdn::router {

json ErrorBody(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

json UsageJson(const Usage& u) {
  json details = {{"cached_tokens", u.cached_tokens}};
  if (u.blended) {
    details["blended_tokens"] = u.blended_tokens;
    details["recomputed_tokens"] = u.recomputed_tokens;
    details["pruned_tokens"] = u.pruned_tokens;
    details["recompute_ratio"] = u.recompute_ratio;
    if (u.question_pass_tokens > 0) details["question_pass_tokens"] = u.question_pass_tokens;
  }
  if (u.pinned_tokens > 0) {
    details["pinned_tokens"] = u.pinned_tokens;
    details["pin_expires_at"] = u.pin_expires_at;
  }
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens},
          {"prompt_tokens_details", details}};
}

json CompletionResponse(ApiKind kind, const std::string& id, int64_t created,
                        const std::string& model, const std::string& text,
                        const std::string& finish_reason, const Usage& usage) {
  json choice = {{"index", 0}, {"finish_reason", finish_reason}, {"logprobs", nullptr}};
  if (kind == ApiKind::kChat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
  } else {
    choice["text"] = text;
  }
  return {{"id", id},
          {"object", kind == ApiKind::kChat ? "chat.completion" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array({choice})},
          {"usage", UsageJson(usage)}};
}

json StreamChunk(ApiKind kind, const std::string& id, int64_t created, const std::string& model,
                 const std::string& text, const std::string* finish_reason, bool first) {
  json choice = {{"index", 0},
                 {"finish_reason", finish_reason ? json(*finish_reason) : json(nullptr)},
                 {"logprobs", nullptr}};
  if (kind == ApiKind::kChat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || finish_reason == nullptr) delta["content"] = text;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  return {{"id", id},
          {"object", kind == ApiKind::kChat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array({choice})}};
}

json StreamUsageChunk(ApiKind kind, const std::string& id, int64_t created,
                      const std::string& model, const Usage& usage) {
  return {{"id", id},
          {"object", kind == ApiKind::kChat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", json::array()},
          {"usage", UsageJson(usage)}};
}

}  // namespace kdn::router
