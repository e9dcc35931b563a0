// Test-only: kdn_chat_template < CASES_JSON
// Renders each case of a JSON list on stdin and prints a JSON list of the
// results, for tests/parity/test_chat_template.py to compare with
// transformers and jinja2. A case is
//   {"template": TEXT, "messages": [{"role", "content"}...],
//    "bos_token": S|null, "eos_token": S|null, "add_generation_prompt": B}
// rendered by kdn::text::ChatTemplate (the router's path), or, with
// "variables": {...} in place of the chat fields, by jinja::Template with
// those variables, or, with "model": PATH in place of "template", by the
// ChatTemplate that model folder or GGUF file loads. A result is {"text": S, "end_of_turn": S} or
// {"error": CODE, "message": S}.
#include <iostream>
#include <iterator>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "kdn/text/chat_template.h"
#include "kdn/text/jinja.h"

// Ordered: a template sees a dict's keys in the order Python's json.loads keeps.
using json = nlohmann::ordered_json;
using namespace kdn;

namespace {

json ErrorJson(const Status& s) {
  return {{"error", StatusCodeName(s.code())}, {"message", s.message()}};
}

std::optional<std::string> OptionalString(const json& c, const char* key) {
  if (!c.contains(key) || c[key].is_null()) return std::nullopt;
  return c[key].get<std::string>();
}

json Render(const text::ChatTemplate& t, const json& c) {
  text::ChatMessages messages;
  for (const json& m : c.at("messages")) {
    messages.emplace_back(m.at("role").get<std::string>(), m.at("content").get<std::string>());
  }
  auto p = t.Render(messages, c.value("add_generation_prompt", true));
  if (!p.ok()) return ErrorJson(p.status());
  return {{"text", p->text}, {"end_of_turn", p->end_of_turn}};
}

json RenderCase(const json& c) {
  if (c.contains("model")) {  // a model folder's or GGUF file's own template
    auto t = text::ChatTemplate::Load(c["model"].get<std::string>(), model::Architecture::kLlama);
    if (!t.ok()) return ErrorJson(t.status());
    return Render(*t, c);
  }
  const std::string source = c.at("template").get<std::string>();
  if (c.contains("variables")) {
    auto t = text::jinja::Template::Parse(source, "template");
    if (!t.ok()) return ErrorJson(t.status());
    auto vars = text::jinja::ValueFromJson(c["variables"].dump());
    if (!vars.ok()) return ErrorJson(vars.status());
    text::jinja::Variables v;
    for (const auto& [k, val] : vars->object().items) v.emplace_back(k, val);
    auto out = t->Render(v);
    if (!out.ok()) return ErrorJson(out.status());
    return {{"text", *out}};
  }
  auto t = text::ChatTemplate::FromSource(source, "template", OptionalString(c, "bos_token"),
                                          OptionalString(c, "eos_token"));
  if (!t.ok()) return ErrorJson(t.status());
  return Render(*t, c);
}

}  // namespace

int main() {
  const std::string input((std::istreambuf_iterator<char>(std::cin)),
                          std::istreambuf_iterator<char>());
  const json cases = json::parse(input);
  json results = json::array();
  for (const json& c : cases) results.push_back(RenderCase(c));
  std::cout << results.dump(-1, ' ', /*ensure_ascii=*/false, json::error_handler_t::replace)
            << "\n";
  return 0;
}
