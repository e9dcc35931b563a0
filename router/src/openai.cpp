#include "kdn/router/openai.h"

#include <algorithm>
#include <initializer_list>
#include <string_view>
#include <chrono>
#include <cmath>

#include "kdn/router/pins.h"
#include "kdn/text/chat_template.h"
#include "kdn/text/output_text.h"
#include "json_fields.h"
#include "openai_documents.h"

namespace kdn::router {

namespace {

// The body as a JSON object whose optional `model` names the served model.
std::optional<ApiError> ParseBody(const std::string& text, const ServedModel& model, json* body) {
  *body = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body->is_discarded()) return Bad("the request body is not valid JSON");
  if (!body->is_object()) return Bad("the request body must be a JSON object");
  std::string name;
  KDN_API_CHECK(GetString(*body, "model", &name));
  if (!name.empty() && name != model.name) {
    ApiError e =
        Bad("the model '" + name + "' does not exist; this server serves '" + model.name + "'",
            "model");
    e.http_status = 404;
    e.code = "model_not_found";
    return e;
  }
  return std::nullopt;
}

// A `cache_control` object at `where` (set): Anthropic's {"type":
// "ephemeral", "ttl": "5m"}, the TTL optional (5 minutes) and any of
// ParsePinTtl's. Each wrong field is refused by its path.
std::optional<ApiError> ParseCacheControl(const json& cc, const std::string& where,
                                          std::chrono::seconds* ttl) {
  if (!cc.is_object()) {
    return Bad(where + " must be an object: {\"type\": \"ephemeral\", \"ttl\": \"5m\"}", where);
  }
  for (const auto& [k, v] : cc.items()) {
    if (k != "type" && k != "ttl") {
      return Bad(where + ": unknown field '" + k + "' (type, ttl)", where + "." + k);
    }
  }
  auto type = cc.find("type");
  if (type == cc.end() || !type->is_string() || *type != "ephemeral") {
    return Bad(where + ".type must be \"ephemeral\"", where + ".type");
  }
  *ttl = kDefaultPinTtl;
  auto t = cc.find("ttl");
  if (t != cc.end() && !t->is_null()) {
    const auto parsed = t->is_string() ? ParsePinTtl(t->get<std::string>()) : std::nullopt;
    if (!parsed) {
      return Bad(where + ".ttl must be \"5m\", \"1h\" or a whole number of seconds, minutes or " +
                     "hours (\"90s\", \"10m\", \"2h\") from 1 s to 24 h",
                 where + ".ttl");
    }
    *ttl = *parsed;
  }
  return std::nullopt;
}

// The leading tokens `a` and `b` share.
int64_t CommonPrefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  const auto end = std::mismatch(a.begin(), a.begin() + std::min(a.size(), b.size()), b.begin());
  return end.first - a.begin();
}

// Fields of OpenAI's API that kdn does not implement: refused, not ignored,
// when set to anything but their neutral value.
std::optional<ApiError> RefuseUnsupported(const json& body) {
  auto set = [&](const char* name) { return IsSet(body, name); };
  if (set("logprobs") && !(body["logprobs"].is_boolean() && !body["logprobs"].get<bool>())) {
    return Bad("'logprobs' is not supported by kdn", "logprobs");
  }
  if (set("top_logprobs")) return Bad("'top_logprobs' is not supported by kdn", "top_logprobs");
  if (set("echo") && !(body["echo"].is_boolean() && !body["echo"].get<bool>())) {
    return Bad("'echo' is not supported by kdn", "echo");
  }
  if (set("suffix")) return Bad("'suffix' is not supported by kdn", "suffix");
  if (set("logit_bias") && !(body["logit_bias"].is_object() && body["logit_bias"].empty())) {
    return Bad("'logit_bias' is not supported by kdn", "logit_bias");
  }
  if (set("tools") && !(body["tools"].is_array() && body["tools"].empty())) {
    return Bad("'tools' is not supported by kdn", "tools");
  }
  for (const char* name : {"presence_penalty", "frequency_penalty"}) {
    double v = 0;
    KDN_API_CHECK(GetNumber(body, name, &v));
    if (v != 0)
      return Bad(std::string("'") + name + "' other than 0 is not supported by kdn", name);
  }
  for (const char* name : {"n", "best_of"}) {
    int64_t v = 1;
    KDN_API_CHECK(GetInt(body, name, &v));
    if (v != 1) return Bad(std::string("'") + name + "' must be 1: kdn returns one choice", name);
  }
  return std::nullopt;
}

// The marker that stands for the documents in a rendered chat prompt. Its
// control characters are not whitespace to Python (\x1c-\x1f are), so a
// template's `| trim` of the message leaves it whole.
constexpr std::string_view kDocumentsMarker = "\x1a\x1bkdn-documents\x1b\x1a";

// The prompt's text when it is one string (`text` set), else its token ids.
std::optional<ApiError> ParsePrompt(const json& body, const ServedModel& model,
                                    std::vector<int32_t>* out, std::optional<std::string>* text) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return Bad("'prompt' is required", "prompt");
  const json* p = &*it;
  if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) p = &(*p)[0];
  if (p->is_string()) {
    *text = p->get<std::string>();
    *out = model.tokenizer->Encode(**text, /*add_bos=*/true);
  } else if (p->is_array()) {
    if (p->empty()) return Bad("'prompt' is an empty list", "prompt");
    for (const json& t : *p) {
      if (t.is_string() || t.is_array()) {
        return Bad("'prompt' as a list of several prompts is not supported; send one per request",
                   "prompt");
      }
      if (!t.is_number_integer() && !t.is_number_unsigned()) {
        return Bad("'prompt' must be a string or a list of token ids", "prompt");
      }
      const int64_t id = t.get<int64_t>();
      if (id < 0 || id >= model.config->vocab_size) {
        return Bad("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(model.config->vocab_size) + ")",
                   "prompt");
      }
      out->push_back(static_cast<int32_t>(id));
    }
  } else {
    return Bad(std::string("'prompt' must be a string or a list of token ids, not ") + TypeName(*p),
               "prompt");
  }
  if (out->empty()) return Bad("'prompt' is empty", "prompt");
  return std::nullopt;
}

std::optional<ApiError> ParseMessages(const json& body, const ServedModel& model,
                                      const std::string& separator, ApiRequest* out,
                                      std::string* end_of_turn) {
  auto it = body.find("messages");
  if (it == body.end() || it->is_null()) return Bad("'messages' is required", "messages");
  if (!it->is_array()) {
    return Bad(std::string("'messages' must be a list, not ") + TypeName(*it), "messages");
  }
  if (it->empty()) return Bad("'messages' is empty", "messages");
  std::vector<std::pair<std::string, std::string>> msgs;
  // The last message marked with cache_control, and its TTL.
  std::optional<size_t> pinned_through;
  std::chrono::seconds pin_ttl{0};
  for (size_t i = 0; i < it->size(); ++i) {
    const json& m = (*it)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return Bad(where + " must be an object", "messages");
    // On the message, or (Anthropic's place) on one of its parts: the
    // prefix through this message either way.
    auto mark = [&](const json& holder, const std::string& at) -> std::optional<ApiError> {
      auto cc = holder.find("cache_control");
      if (cc == holder.end() || cc->is_null()) return std::nullopt;
      std::chrono::seconds ttl{0};
      KDN_API_CHECK(ParseCacheControl(*cc, at + ".cache_control", &ttl));
      if (pinned_through != i) pin_ttl = ttl;
      pin_ttl = std::max(pin_ttl, ttl);
      pinned_through = i;
      return std::nullopt;
    };
    KDN_API_CHECK(mark(m, where));
    auto role = m.find("role");
    if (role == m.end() || !role->is_string())
      return Bad(where + ".role must be a string", "messages");
    const std::string r = role->get<std::string>();
    if (r != "system" && r != "user" && r != "assistant" && r != "developer") {
      return Bad(where + ".role '" + r + "' is not one of system, developer, user, assistant",
                 "messages");
    }
    std::string text;
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      return Bad(where + ".content is required", "messages");
    } else if (content->is_string()) {
      text = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t j = 0; j < content->size(); ++j) {
        const json& part = (*content)[j];
        // Compared, not read with value(), which throws when "type" is not a string.
        const auto type = part.is_object() ? part.find("type") : part.end();
        if (!part.is_object() || type == part.end() || *type != "text" || !part.contains("text") ||
            !part["text"].is_string()) {
          return Bad(where + ".content: only text parts are supported", "messages");
        }
        text += part["text"].get<std::string>();
        KDN_API_CHECK(mark(part, where + ".content[" + std::to_string(j) + "]"));
      }
    } else {
      return Bad(where + ".content must be a string or a list of text parts", "messages");
    }
    if (text.find(kDocumentsMarker) != std::string::npos) {
      return Bad(where + ".content holds a reserved control sequence", "messages");
    }
    msgs.emplace_back(r == "developer" ? "system" : r, std::move(text));
  }
  // Documents go at the start of the last user message.
  std::vector<DocumentText> docs;
  bool has_documents = false;
  auto last_user =
      std::find_if(msgs.rbegin(), msgs.rend(), [](const auto& m) { return m.first == "user"; });
  if (last_user != msgs.rend()) {
    KDN_API_CHECK(TakeDocuments(body, separator, &last_user->second, &docs, &has_documents));
    if (has_documents && pinned_through) {
      return Bad("cache_control does not go with documents: store them with /v1/kdn/inject",
                 "messages[" + std::to_string(*pinned_through) + "].cache_control");
    }
    if (has_documents) last_user->second.insert(0, kDocumentsMarker);
  } else if (IsSet(body, "documents")) {
    return Bad("'documents' go with the last user message, and there is none", "documents");
  }
  Result<text::ChatPrompt> rendered = model.chat_template
                                          ? model.chat_template->Render(msgs)
                                          : text::RenderChat(model.config->architecture, msgs);
  if (!rendered.ok()) {
    if (rendered.status().code() == StatusCode::kInvalidArgument) {
      // The template's raise_exception (roles that do not alternate...), or
      // an error of the template that these messages led to.
      return Bad("the model's chat template refused the messages: " + rendered.status().message(),
                 "messages");
    }
    ApiError e =
        Bad("the model's chat template cannot be rendered: " + rendered.status().message());
    e.http_status = 500;
    e.type = "server_error";
    return e;
  }
  const text::ChatPrompt& chat = *rendered;
  *end_of_turn = chat.end_of_turn;
  if (!has_documents) {
    out->prompt = model.tokenizer->Encode(chat.text, chat.add_bos);
    if (pinned_through) {
      // The conversation through the marked message, without the
      // assistant's turn opened: its tokens that the prompt starts with.
      const text::ChatMessages upto(msgs.begin(), msgs.begin() + *pinned_through + 1);
      Result<text::ChatPrompt> head =
          model.chat_template ? model.chat_template->Render(upto, /*add_generation_prompt=*/false)
                              : text::RenderChat(model.config->architecture, upto, false);
      if (!head.ok()) {
        return Bad(
            "the model's chat template cannot render the messages up to the one marked "
            "with cache_control: " +
                head.status().message(),
            "messages[" + std::to_string(*pinned_through) + "].cache_control");
      }
      out->pin = PinSpec{
          CommonPrefix(model.tokenizer->Encode(head->text, head->add_bos), out->prompt), pin_ttl};
    }
    return std::nullopt;
  }
  // A template could drop the last user message, or repeat it: the documents
  // must have one place to go.
  const size_t at = chat.text.find(kDocumentsMarker);
  if (at == std::string::npos || chat.text.find(kDocumentsMarker, at + 1) != std::string::npos) {
    return Bad(
        "the model's chat template does not place the last user message once, where "
        "documents could go; send the request without documents",
        "documents");
  }
  return BlendPrompt(model, chat.text.substr(0, at), docs,
                     chat.text.substr(at + kDocumentsMarker.size()), chat.add_bos, "messages", out);
}

}  // namespace

namespace {

// A JSON accessor that throws (nlohmann's type_error, out_of_range) in a path
// no check foresaw must not end the router's I/O thread: the request is
// refused instead.
template <typename Fn>
std::optional<ApiError> RefuseOnJsonException(Fn&& parse) {
  try {
    return parse();
  } catch (const json::exception& e) {
    return Bad(std::string("malformed request: ") + e.what(), "");
  }
}

std::optional<ApiError> ParseRequestUnguarded(ApiKind kind, const std::string& body_text,
                                              const ServedModel& model, ApiRequest* out) {
  json body;
  KDN_API_CHECK(ParseBody(body_text, model, &body));
  out->kind = kind;
  KDN_API_CHECK(RefuseUnsupported(body));

  std::string separator = model.separator;
  KDN_API_CHECK(GetString(body, "separator", &separator));
  std::string end_of_turn;
  if (kind == ApiKind::kCompletion) {
    std::optional<std::string> text;
    KDN_API_CHECK(ParsePrompt(body, model, &out->prompt, &text));
    if (IsSet(body, "documents") && !text) {
      return Bad("'documents' need 'prompt' as a string (the question after them)", "prompt");
    }
    if (text) {
      std::vector<DocumentText> docs;
      bool has_documents = false;
      KDN_API_CHECK(TakeDocuments(body, separator, &*text, &docs, &has_documents));
      if (has_documents) {
        KDN_API_CHECK(BlendPrompt(model, "", docs, *text, /*add_bos=*/true, "prompt", out));
      }
    }
    if (IsSet(body, "cache_control")) {
      if (out->blend) {
        return Bad("cache_control does not go with documents: store them with /v1/kdn/inject",
                   "cache_control");
      }
      std::chrono::seconds ttl{0};
      KDN_API_CHECK(ParseCacheControl(body["cache_control"], "cache_control", &ttl));
      out->pin = PinSpec{static_cast<int64_t>(out->prompt.size()), ttl};
    }
  } else {
    if (IsSet(body, "cache_control")) {
      return Bad("on a chat request, cache_control goes on a message (or one of its parts)",
                 "cache_control");
    }
    KDN_API_CHECK(ParseMessages(body, model, separator, out, &end_of_turn));
  }
  double ratio = model.recompute_ratio;
  int64_t check_layer = model.check_layer;
  std::vector<int> check_layers = model.check_layers;
  std::vector<double> check_ratios = model.check_ratios;
  blend::BlendSelection selection = model.selection;
  std::string selection_text;
  KDN_API_CHECK(GetString(body, "blend_selection", &selection_text));
  if (IsSet(body, "blend_selection")) {
    auto s = blend::ParseBlendSelection(selection_text);
    if (!s.ok()) return Bad("'blend_selection': " + s.status().message(), "blend_selection");
    selection = *s;
  }
  double max_kl = 0;
  KDN_API_CHECK(GetNumber(body, "blend_max_kl", &max_kl));
  if (IsSet(body, "blend_max_kl") && !(max_kl > 0 && max_kl <= 10)) {
    return Bad("'blend_max_kl' must be above 0 and at most 10", "blend_max_kl");
  }
  // A quality target raises the ratio from the ladder's first unless the
  // request says where to start.
  if (max_kl > 0 && !IsSet(body, "recompute_ratio")) ratio = blend::kMinTargetRatio;
  KDN_API_CHECK(GetNumber(body, "recompute_ratio", &ratio));
  KDN_API_CHECK(GetInt(body, "check_layer", &check_layer));
  KDN_API_CHECK(GetIntArray(body, "check_layers", &check_layers));
  KDN_API_CHECK(GetNumberArray(body, "check_ratios", &check_ratios));
  if (!(ratio >= 0 && ratio <= 1)) {
    return Bad("'recompute_ratio' must be between 0 and 1", "recompute_ratio");
  }
  if (check_layer < 0 || check_layer >= model.config->num_layers) {
    return Bad("'check_layer' must be in [0, " + std::to_string(model.config->num_layers) +
                   ") for this model",
               "check_layer");
  }
  if (IsSet(body, "check_layer") && !IsSet(body, "check_layers")) {
    check_layers.clear();  // one check, where the request says
    check_ratios.clear();
  }
  if ((IsSet(body, "check_layers") || IsSet(body, "recompute_ratio") || max_kl > 0) &&
      !IsSet(body, "check_ratios")) {
    check_ratios.clear();  // the default schedule for this request's layers and ratio
  }
  if (IsSet(body, "check_ratios") && !IsSet(body, "recompute_ratio") && !check_ratios.empty()) {
    ratio = check_ratios.back();  // the last check's ratio is the target
  }
  if (auto st = blend::CheckSchedule(ratio, static_cast<int>(check_layer), check_layers,
                                     check_ratios, model.config->num_layers);
      !st.ok()) {
    return Bad("'check_layers' and 'check_ratios': " + st.status().message(),
               IsSet(body, "check_ratios") ? "check_ratios" : "check_layers");
  }
  if (out->blend) {
    out->blend->recompute_ratio = ratio;
    out->blend->check_layer = static_cast<int>(check_layer);
    out->blend->check_layers = std::move(check_layers);
    out->blend->check_ratios = std::move(check_ratios);
    out->blend->selection = selection;
    out->blend->max_kl = max_kl;
  }
  KDN_API_CHECK(ParseEmphasis(body, model, out));

  int64_t max_tokens = control::kDefaultMaxTokens;
  KDN_API_CHECK(GetInt(body, "max_tokens", &max_tokens));
  if (kind == ApiKind::kChat) KDN_API_CHECK(GetInt(body, "max_completion_tokens", &max_tokens));
  if (max_tokens < 1) {
    return Bad("'max_tokens' must be at least 1, got " + std::to_string(max_tokens), "max_tokens");
  }
  const int64_t ctx = model.config->max_context;
  const int64_t n = static_cast<int64_t>(out->prompt.size());
  // Compared and added so that no max_tokens overflows (both are >= 0 here).
  if (max_tokens > ctx - n) {
    const uint64_t asked = static_cast<uint64_t>(n) + static_cast<uint64_t>(max_tokens);
    ApiError e = Bad("this model's maximum context length is " + std::to_string(ctx) +
                         " tokens; the request asks for " + std::to_string(asked) + " (" +
                         std::to_string(n) + " in the prompt, " + std::to_string(max_tokens) +
                         " for the completion)",
                     n >= ctx ? (kind == ApiKind::kChat ? "messages" : "prompt") : "max_tokens");
    e.code = "context_length_exceeded";
    return e;
  }
  out->max_tokens = static_cast<int>(max_tokens);

  double temperature = 1.0, top_p = 1.0;
  int64_t top_k = 0, seed = 0;
  KDN_API_CHECK(GetNumber(body, "temperature", &temperature));
  KDN_API_CHECK(GetNumber(body, "top_p", &top_p));
  KDN_API_CHECK(GetInt(body, "top_k", &top_k));
  KDN_API_CHECK(GetInt(body, "seed", &seed));
  if (!(temperature >= 0 && temperature <= 2)) {
    return Bad("'temperature' must be between 0 and 2", "temperature");
  }
  if (!(top_p > 0 && top_p <= 1)) return Bad("'top_p' must be in (0, 1]", "top_p");
  if (top_k == -1) top_k = 0;  // vLLM's spelling of "off"
  if (top_k < 0 || top_k > model.config->vocab_size) {
    return Bad("'top_k' must be 0 (off) or a positive number of tokens", "top_k");
  }
  out->sampling.temperature = static_cast<float>(temperature);
  out->sampling.top_p = static_cast<float>(top_p);
  out->sampling.top_k = static_cast<int>(top_k);
  out->sampling.seed = static_cast<uint64_t>(seed);

  auto stop = body.find("stop");
  if (stop != body.end() && !stop->is_null()) {
    if (stop->is_string()) {
      out->stop.push_back(stop->get<std::string>());
    } else if (stop->is_array() && stop->size() <= 4 &&
               std::all_of(stop->begin(), stop->end(),
                           [](const json& s) { return s.is_string(); })) {
      for (const json& s : *stop) out->stop.push_back(s.get<std::string>());
    } else {
      return Bad("'stop' must be a string or a list of at most 4 strings", "stop");
    }
    for (const std::string& s : out->stop) {
      if (s.empty()) return Bad("'stop' strings must not be empty", "stop");
    }
  }
  if (!end_of_turn.empty()) out->stop.push_back(end_of_turn);

  KDN_API_CHECK(GetBool(body, "stream", &out->stream));
  auto so = body.find("stream_options");
  if (so != body.end() && !so->is_null()) {
    if (!so->is_object()) return Bad("'stream_options' must be an object", "stream_options");
    KDN_API_CHECK(GetBool(*so, "include_usage", &out->include_usage));
  }
  bool ignore_eos = false;
  KDN_API_CHECK(GetBool(body, "ignore_eos", &ignore_eos));
  if (!ignore_eos) out->stop_ids = text::ModelStopIds(*model.tokenizer, *model.config);
  KDN_API_CHECK(GetString(body, "cache_salt", &out->cache_salt));
  std::string disaggregation;
  KDN_API_CHECK(GetString(body, "disaggregation", &disaggregation));
  if (!disaggregation.empty()) {
    out->disaggregation = ParseDisaggregation(disaggregation);
    if (!out->disaggregation) {
      return Bad("'disaggregation' must be \"always\", \"auto\" or \"never\"", "disaggregation");
    }
  }
  std::string user;
  KDN_API_CHECK(GetString(body, "user", &user));
  return std::nullopt;
}

// `prune` of /v1/kdn/inject: {"method": ..., "keep": ..., "sinks": ...,
// "granularity": ..., "scoring": ...}.
std::optional<ApiError> ParsePruneField(const json& body, const ServedModel& model,
                                        std::optional<prune::PruneSpec>* out) {
  if (!IsSet(body, "prune")) return std::nullopt;
  const json& p = body["prune"];
  const std::string methods = prune::PruneMethodNames();
  if (!p.is_object()) {
    return Bad("'prune' must be an object: {\"method\": " + methods + ", \"keep\": a ratio}",
               "prune");
  }
  for (const auto& [k, v] : p.items()) {
    if (k != "method" && k != "keep" && k != "sinks" && k != "granularity" && k != "scoring") {
      return Bad("prune: unknown field '" + k + "' (method, keep, sinks, granularity, scoring)",
                 "prune");
    }
  }
  prune::PruneSpec spec;
  if (!p.contains("method") || !p["method"].is_string()) {
    return Bad("prune.method must be one of " + methods, "prune.method");
  }
  spec.method = p["method"].get<std::string>();
  if (!p.contains("keep") || !p["keep"].is_number()) {
    return Bad("prune.keep must be a number in (0, 1]", "prune.keep");
  }
  if (!prune::IsPruneMethod(spec.method)) {
    return Bad("prune.method '" + spec.method + "' is not one of " + methods, "prune.method");
  }
  spec.keep = p["keep"].get<double>();
  if (!(spec.keep > 0 && spec.keep <= 1)) {
    return Bad("prune.keep must be in (0, 1]", "prune.keep");
  }
  if (p.contains("sinks")) {
    const json& sinks = p["sinks"];
    if (!sinks.is_number_integer() || sinks.get<int64_t>() < 0 ||
        sinks.get<int64_t>() > prune::kMaxPruneSinks) {
      return Bad(
          "prune.sinks must be an integer in [0, " + std::to_string(prune::kMaxPruneSinks) + "]",
          "prune.sinks");
    }
    spec.sinks = static_cast<int>(sinks.get<int64_t>());
  }
  if (p.contains("granularity")) {
    const json& g = p["granularity"];
    auto parsed =
        g.is_string() ? prune::ParseGranularity(g.get<std::string>()) : prune::ParseGranularity("");
    if (!parsed.ok()) {
      return Bad("prune.granularity must be token, layer, head or global", "prune.granularity");
    }
    spec.granularity = *parsed;
  }
  if (p.contains("scoring")) {
    const json& sc = p["scoring"];
    auto parsed = sc.is_string() ? prune::ParseKvzipScoring(sc.get<std::string>())
                                 : prune::ParseKvzipScoring("");
    if (!parsed.ok())
      return Bad("prune.scoring must be full, profiled or combined", "prune.scoring");
    spec.scoring = *parsed;
  }
  prune::TokenizeKvzipPrompts(
      [&](const std::string& text) { return model.tokenizer->Encode(text, /*add_bos=*/false); },
      &spec);
  // What the prefill worker checks again (the repeat prompts, above all).
  if (Status st = prune::ValidatePruneSpec(spec); !st.ok()) {
    const bool scoring = st.message().find("scoring") != std::string::npos;
    return Bad(st.message(), scoring ? "prune.scoring" : "prune");
  }
  *out = std::move(spec);
  return std::nullopt;
}

// Tokenizes a document to store (an injection's or an edit's) into `out`,
// refusing one with no tokens or past the model's context; `name` says
// which in the message, `param` is the field.
std::optional<ApiError> AddStoredDocument(const ServedModel& model, const DocumentText& doc,
                                          const std::string& name, const std::string& param,
                                          InjectApiRequest* out) {
  int64_t base = 0;
  std::vector<int32_t> t = DocumentTokens(model, doc, &base);
  if (t.empty()) return Bad(name + " has no tokens", param);
  if (!doc.erratum.empty() && static_cast<int64_t>(t.size()) == base) {
    return Bad(name + "'s erratum has no tokens", param);
  }
  if (static_cast<int64_t>(t.size()) >= model.config->max_context) {
    ApiError e =
        Bad(name + " has " + std::to_string(t.size()) + " tokens; this model's context is " +
                std::to_string(model.config->max_context),
            param);
    e.code = "context_length_exceeded";
    return e;
  }
  out->documents.push_back(std::move(t));
  out->base_tokens.push_back(base);
  return std::nullopt;
}

std::optional<ApiError> ParseInjectRequestUnguarded(const std::string& body_text,
                                                    const ServedModel& model,
                                                    InjectApiRequest* out) {
  json body;
  KDN_API_CHECK(ParseBody(body_text, model, &body));
  if (!IsSet(body, "documents")) return Bad("'documents' is required", "documents");
  std::vector<DocumentText> docs;
  KDN_API_CHECK(ParseDocumentsField(body, &docs));
  for (size_t i = 0; i < docs.size(); ++i) {
    if (docs[i].steer) {
      const std::string field = "documents[" + std::to_string(i) + "].steer";
      return Bad(field + ": a steered version is stored by POST /v1/kdn/edit", field);
    }
    KDN_API_CHECK(
        AddStoredDocument(model, docs[i], "document " + std::to_string(i), "documents", out));
  }
  KDN_API_CHECK(GetString(body, "cache_salt", &out->cache_salt));
  KDN_API_CHECK(GetBool(body, "stream", &out->stream));
  KDN_API_CHECK(ParsePruneField(body, model, &out->prune));
  if (out->prune) {
    for (size_t i = 0; i < docs.size(); ++i) {
      if (!docs[i].erratum.empty()) {
        return Bad("documents[" + std::to_string(i) +
                       "] has an erratum: a document with an erratum is stored whole, not pruned",
                   "prune");
      }
    }
    for (size_t i = 0; i < out->documents.size(); ++i) {
      const auto n = static_cast<int64_t>(out->documents[i].size());
      if (const int64_t peak = prune::PrunePeakTokens(*out->prune, n);
          peak > model.config->max_context) {
        ApiError e =
            Bad("document " + std::to_string(i) + " has " + std::to_string(n) +
                    " tokens; pruning it by " + out->prune->method + " holds " +
                    std::to_string(peak) + " tokens at once, past this model's context of " +
                    std::to_string(model.config->max_context),
                "documents");
        e.code = "context_length_exceeded";
        return e;
      }
      if (n <= out->prune->sinks) {
        return Bad("document " + std::to_string(i) + " has " +
                       std::to_string(out->documents[i].size()) +
                       " tokens, no more than prune.sinks (" + std::to_string(out->prune->sinks) +
                       "): nothing to prune",
                   "documents");
      }
    }
  }
  return std::nullopt;
}

// A 400 naming a field of a kdn endpoint's body that is not one of `known`
// (`model` and `user`, every body's, aside); `takes` says what it takes.
std::optional<ApiError> RefuseUnknownFields(const json& body,
                                            std::initializer_list<std::string_view> known,
                                            const std::string& takes) {
  for (const auto& [k, v] : body.items()) {
    if (k != "model" && k != "user" && std::find(known.begin(), known.end(), k) == known.end()) {
      return Bad("unknown field '" + k + "': " + takes, k);
    }
  }
  return std::nullopt;
}

// POST /v1/kdn/edit: {"document": ..., "erratum" or "steer": ..., "cache_salt": ...}.
std::optional<ApiError> ParseEditRequestUnguarded(const std::string& body_text,
                                                  const ServedModel& model, InjectApiRequest* out) {
  json body;
  KDN_API_CHECK(ParseBody(body_text, model, &body));
  KDN_API_CHECK(RefuseUnknownFields(body, {"document", "erratum", "steer", "cache_salt"},
                                    "an edit takes document, erratum or steer, and cache_salt"));
  if (IsSet(body, "erratum") == IsSet(body, "steer")) {
    return Bad(
        "an edit is one of 'erratum' (a note stored after the document) and 'steer' (a "
        "steering vector added to its values)",
        IsSet(body, "steer") ? "steer" : "erratum");
  }
  DocumentText doc;
  const bool steer = IsSet(body, "steer");
  for (const char* field : {"document", steer ? "document" : "erratum"}) {
    if (!IsSet(body, field) || !body[field].is_string() || body[field].get<std::string>().empty()) {
      return Bad(std::string("'") + field + "' must be a non-empty string", field);
    }
  }
  doc.text = body["document"].get<std::string>();
  int64_t base = 0;
  if (DocumentTokens(model, {doc.text, {}}, &base).empty()) {
    return Bad("'document' has no tokens", "document");
  }
  if (steer) {
    KDN_API_CHECK(ParseSteer(body["steer"], "steer", &out->steer.emplace()));
    KDN_API_CHECK(AddStoredDocument(model, doc, "the document", "document", out));
    KDN_API_CHECK(GetString(body, "cache_salt", &out->cache_salt));
    out->edit = true;
    return std::nullopt;
  }
  doc.erratum = body["erratum"].get<std::string>();
  KDN_API_CHECK(AddStoredDocument(model, doc, "the edited document", "erratum", out));
  KDN_API_CHECK(GetString(body, "cache_salt", &out->cache_salt));
  out->edit = true;
  return std::nullopt;
}

// POST /v1/kdn/steering: {"name", "pairs", "layers", "cache_salt"}.
std::optional<ApiError> ParseSteeringRequestUnguarded(const std::string& body_text,
                                                      const ServedModel& model,
                                                      InjectApiRequest* out) {
  json body;
  KDN_API_CHECK(ParseBody(body_text, model, &body));
  KDN_API_CHECK(RefuseUnknownFields(body, {"name", "pairs", "layers", "cache_salt"},
                                    "a steering vector takes name, pairs, layers and cache_salt"));
  std::string param;
  Result<blend::SteeringVectorSpec> spec = blend::ParseSteeringBody(
      body, [&](const std::string& text) { return model.tokenizer->Encode(text, true); },
      model.config->num_layers, model.config->max_context, &param);
  if (!spec.ok()) return Bad(spec.status().message(), param);
  KDN_API_CHECK(GetString(body, "cache_salt", &out->cache_salt));
  out->steering_vector = *std::move(spec);
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> ParseSteeringRequest(const std::string& body_text, const ServedModel& model,
                                             InjectApiRequest* out) {
  return RefuseOnJsonException(
      [&] { return ParseSteeringRequestUnguarded(body_text, model, out); });
}

std::optional<ApiError> ParseRequest(ApiKind kind, const std::string& body_text,
                                     const ServedModel& model, ApiRequest* out) {
  return RefuseOnJsonException([&] { return ParseRequestUnguarded(kind, body_text, model, out); });
}

std::optional<ApiError> ParseInjectRequest(const std::string& body_text, const ServedModel& model,
                                           InjectApiRequest* out) {
  return RefuseOnJsonException([&] { return ParseInjectRequestUnguarded(body_text, model, out); });
}

std::optional<ApiError> ParseEditRequest(const std::string& body_text, const ServedModel& model,
                                         InjectApiRequest* out) {
  return RefuseOnJsonException([&] { return ParseEditRequestUnguarded(body_text, model, out); });
}

Job ToJob(ApiRequest req, std::string ns, std::string route) {
  Job job;
  job.tokens = std::move(req.prompt);
  job.ns = std::move(ns);
  job.sampling = req.sampling;
  job.max_tokens = req.max_tokens;
  job.stop_ids = std::move(req.stop_ids);
  job.stop_strings = std::move(req.stop);
  job.blend = std::move(req.blend);
  job.disaggregation = req.disaggregation;
  job.route = std::move(route);
  job.pin = req.pin;
  return job;
}

}  // namespace kdn::router
