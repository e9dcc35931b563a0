// The Jinja2 interpreter (kdn/text/jinja.h). Every expected string is what
// jinja2 3.1 renders in transformers' environment (trim_blocks,
// lstrip_blocks, loopcontrols); tests/parity/test_chat_template.py compares
// many more snippets with jinja2 itself.
#include "kdn/text/jinja.h"

#include <gtest/gtest.h>

#include <thread>

namespace kdn::text::jinja {
namespace {

Variables TestVariables() {
  return {{"msgs", Value::Array({Value::Object({{"role", "user"}, {"content", "hi"}}),
                                 Value::Object({{"role", "assistant"}, {"content", "yo"}})})},
          {"s", "héllo"},
          {"d", Value::Object({{"b", 1}, {"a", 2}})}};
}

std::string Render(const std::string& source) {
  auto t = Template::Parse(source, "t.jinja");
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  if (!t.ok()) return "";
  auto out = t->Render(TestVariables());
  EXPECT_TRUE(out.ok()) << out.status().ToString();
  return out.ok() ? *out : "";
}

Status RenderError(const std::string& source) {
  auto t = Template::Parse(source, "t.jinja");
  if (!t.ok()) return t.status();
  auto out = t->Render(TestVariables());
  EXPECT_FALSE(out.ok()) << "rendered: " << *out;
  return out.ok() ? Status::Ok() : out.status();
}

TEST(Jinja, EvaluatesOperatorsWithPythonsPrecedenceAndRules) {
  EXPECT_EQ(Render("{{ 1 + 2 * 3 }}|{{ (1 + 2) * 3 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ 7 / 2 }}|"
                   "{{ 2 ** 10 }}|{{ \"a\" ~ 1 ~ none }}"),
            "7|9|3|-4|3.5|1024|a1None");
  EXPECT_EQ(
      Render("{{ x if x is defined else \"no\" }}|{{ not 0 and \"y\" or \"n\" }}|{{ 1 < 2 < 3 }}|"
             "{{ \"b\" in \"abc\" }}|{{ 3 not in [1, 2] }}"),
      "no|y|True|True|True");
}

TEST(Jinja, PrintsNumbersAsPythonDoes) {
  EXPECT_EQ(
      Render("{{ 1.0 }}|{{ 0.1 + 0.2 }}|{{ 1e20 }}|{{ 2.5|round }}|{{ 3.5|round }}|{{ 10|float }}|"
             "{{ \"12\"|int + 1 }}"),
      "1.0|0.30000000000000004|1e+20|2.0|4.0|10.0|13");
}

TEST(Jinja, SlicesAndIndexesStringsByCodePoint) {
  EXPECT_EQ(
      Render("{{ s[1:3] }}|{{ s[::-1] }}|{{ s[-2:] }}|{{ [1, 2, 3, 4][::2] }}|{{ [1, 2, 3][-1] }}|"
             "{{ s|length }}"),
      "él|olléh|lo|[1, 3]|3|5");
}

TEST(Jinja, AppliesFilters) {
  EXPECT_EQ(
      Render("{{ \"  x  \"|trim }}|{{ \"abc\"|upper }}|{{ [\"a\", \"b\"]|join(\", \") }}|{{ "
             "d|tojson }}|"
             "{{ d|dictsort }}|{{ x|default(\"dflt\") }}|{{ msgs|map(attribute=\"role\")|list }}|"
             "{{ msgs|selectattr(\"role\", \"equalto\", \"user\")|list|length }}"),
      "x|ABC|a, b|{\"b\": 1, \"a\": 2}|[('a', 2), ('b', 1)]|dflt|['user', 'assistant']|1");
}

TEST(Jinja, CallsStrAndDictMethods) {
  EXPECT_EQ(
      Render("{{ \"x\".strip(\"x\") }}{{ \" a b \".split() }}{{ \"a,b\".split(\",\") }}"
             "{{ \"ab\".startswith(\"a\") }}{{ \"{}-{}\".format(1, 2) }}{{ d.get(\"zz\", 0) }}"
             "{{ d.items()|list }}"),
      "['a', 'b']['a', 'b']True1-20[('b', 1), ('a', 2)]");
}

TEST(Jinja, LoopsWithLoopVariablesBreakContinueAndElse) {
  EXPECT_EQ(
      Render("{% for m in msgs %}{{ loop.index }}.{{ m.role }}{% if loop.first %}(first){% endif %}"
             "{% if loop.last %}(last){% endif %}{{ \",\" if not loop.last }}{% endfor %}"),
      "1.user(first),2.assistant(last)");
  EXPECT_EQ(Render("{% for i in range(10) %}{% if i is odd %}{% continue %}{% endif %}"
                   "{% if i > 6 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
                   "{% for x in [] %}x{% else %}empty{% endfor %}"),
            "0246|empty");
}

TEST(Jinja, KeepsLoopScopesAndAssignsNamespaceAttributes) {
  // A set in a loop stays in the loop; a namespace carries it out.
  EXPECT_EQ(
      Render("{% set ns = namespace(n=0) %}{% for m in msgs %}{% set ns.n = ns.n + 1 %}{% endfor %}"
             "{{ ns.n }}|{% set x = 1 %}{% for m in msgs %}{% set x = 2 %}{% endfor %}{{ x }}"),
      "2|1");
}

TEST(Jinja, CallsMacrosWithDefaultsAndKeywords) {
  EXPECT_EQ(
      Render("{% macro tag(name, body=\"-\") %}<{{ name }}>{{ body }}</{{ name }}>{% endmacro %}"
             "{{ tag(\"a\") }}{{ tag(\"b\", body=\"x\") }}"),
      "<a>-</a><b>x</b>");
}

TEST(Jinja, TrimsBlocksAndStripsTheirIndentationAsTransformersSetsJinja) {
  EXPECT_EQ(Render("<{% if true %}\n  yes\n{% endif %}>\n  {% for i in [1, 2] %}\n    {{ i }}\n"
                   "  {% endfor %}\nend"),
            "<  yes\n>\n    1\n    2\nend");
  EXPECT_EQ(Render("a  {%- if true -%}  b  {%- endif -%}  c|{{- ' x ' -}}|"), "abc| x |");
}

TEST(Jinja, DropsOneTrailingNewlineOfTheSource) {
  EXPECT_EQ(Render("x\n\n"), "x\n");
  EXPECT_EQ(Render("x\r\ny\r\n"), "x\ny");
}

TEST(Jinja, ParseErrorsNameTheFileAndLine) {
  auto t = Template::Parse("a\n{% for x in y %}\nb", "t.jinja");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.status().message().rfind("t.jinja, line 3: ", 0), 0u) << t.status().message();
  t = Template::Parse("{% if %}", "t.jinja");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(),
            "t.jinja, line 1: expected an expression, got 'end of statement block'");
  t = Template::Parse("\n\n{{ 1 |nofilter }}", "t.jinja");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "t.jinja, line 3: No filter named 'nofilter'.");
  // Inside an `if` an unknown filter fails only when applied, as in jinja2,
  // but not in a loop's body there.
  EXPECT_TRUE(Template::Parse("{% if x %}{{ x|from_json }}{% endif %}", "t.jinja").ok());
  t = Template::Parse("{% if x %}{% for i in x %}\n{{ i|from_json }}{% endfor %}{% endif %}",
                      "t.jinja");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "t.jinja, line 2: No filter named 'from_json'.");
  t = Template::Parse("{% endfor %}", "t.jinja");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(), "t.jinja, line 1: Encountered unknown tag 'endfor'.");
  t = Template::Parse("{% call x() %}{% endcall %}", "t.jinja");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnimplemented);
}

TEST(Jinja, RenderErrorsNameTheLineAndRaiseExceptionKeepsItsMessage) {
  EXPECT_EQ(RenderError("{{ x.y }}").message(), "t.jinja, line 1: 'x' is undefined");
  EXPECT_EQ(RenderError("line1\n{{ d.zz.w }}").message(),
            "t.jinja, line 2: 'dict object' has no attribute 'zz'");
  EXPECT_EQ(RenderError("{{ \"a\" + 1 }}").message(),
            "t.jinja, line 1: can only concatenate str (not \"int\") to str");
  const Status raised = RenderError("x\n{{ raise_exception(\"roles must alternate\") }}");
  EXPECT_EQ(raised.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(raised.message(), "roles must alternate");
}

TEST(Jinja, UndefinedPrintsNothingAndIsFalsy) {
  EXPECT_EQ(Render("[{{ x }}]{{ x is defined }}{{ not x }}{{ x|length }}{{ d.zz is defined }}"
                   "{% for i in x %}never{% endfor %}"),
            "[]FalseTrue0False");
}

TEST(Jinja, RendersFromManyThreadsAtOnce) {
  auto t = Template::Parse(
      "{% set ns = namespace(n=0) %}{% for m in msgs %}{% set ns.n = ns.n + 1 %}"
      "{{ m.role }}{% endfor %}{{ ns.n }}",
      "t.jinja");
  ASSERT_TRUE(t.ok());
  const Template& shared = *t;
  std::vector<std::thread> threads;
  std::vector<int> wrong(4, 0);
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 500; ++k) {
        auto out = shared.Render(TestVariables());
        if (!out.ok() || *out != "userassistant2") ++wrong[i];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(wrong[i], 0);
}

TEST(Jinja, WritesJsonAsPythonsJsonDumps) {
  auto v = ValueFromJson(R"({"z": [1, 2.5, "é\n", null, true], "a": {}})");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*ToJson(*v), R"({"z": [1, 2.5, "é\n", null, true], "a": {}})");
  EXPECT_EQ(*ToJson(*v, -1, /*ensure_ascii=*/true, /*sort_keys=*/true),
            R"({"a": {}, "z": [1, 2.5, "\u00e9\n", null, true]})");
  EXPECT_EQ(*ToJson(*v, 1),
            "{\n \"z\": [\n  1,\n  2.5,\n  \"é\\n\",\n  null,\n  true\n ],\n \"a\": {}\n}");
  EXPECT_FALSE(ToJson(Value()).ok());
}

}  // namespace
}  // namespace kdn::text::jinja
