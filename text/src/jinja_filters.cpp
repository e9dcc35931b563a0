// The filters and tests of jinja2 that chat templates use (kdn/text/jinja.h),
// each as its jinja2 (3.1) original behaves, checked against it in
// tests/parity/test_chat_template.py; tojson is transformers' own.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include "jinja_internal.h"

namespace kdn::text::jinja {

namespace {

// jinja2's make_attrgetter: "a.b.0" looked up item by item (an integer part
// as an index).
Value AttrPath(const Value& item, const std::string& path) {
  Value v = item;
  size_t from = 0;
  for (;;) {
    const size_t dot = path.find('.', from);
    const std::string part =
        path.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
    int64_t index;
    v = ParsePyInt(part, 10, &index) && !part.empty() &&
                std::isdigit(static_cast<unsigned char>(part[0]))
            ? GetItem(v, Value(index))
            : GetItem(v, Value(part));
    if (dot == std::string::npos) return v;
    from = dot + 1;
  }
}

Value Lowered(const Value& v, bool case_sensitive) {
  return !case_sensitive && v.is_string() ? Value(MapCase(v.str(), ToLower)) : v;
}

void SortValues(std::vector<Value>* items, std::function<Value(const Value&)> key, bool reverse) {
  std::stable_sort(items->begin(), items->end(), [&](const Value& a, const Value& b) {
    return reverse ? Compare("<", key(b), key(a)) : Compare("<", key(a), key(b));
  });
}

// select, reject, selectattr, rejectattr.
Value SelectOrReject(Renderer& r, const Value& in, Args& args, bool with_attr, bool select) {
  size_t i = 0;
  std::string attr;
  if (with_attr) {
    if (args.empty()) Fail("selectattr and rejectattr need an attribute");
    attr = StringArg(args[i++], "the attribute");
  }
  std::string test;
  if (i < args.size()) test = StringArg(args[i++], "the test");
  Args test_args(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  std::vector<Value> out;
  if (!in.Truthy()) return Value::Array({});  // jinja2 selects nothing from none
  for (const Value& item : Iterate(in)) {
    const Value v = with_attr ? AttrPath(item, attr) : item;
    Args a = test_args;
    const bool ok = test.empty() ? v.Truthy() : r.ApplyTest(test, v, a);
    if (ok == select) out.push_back(item);
  }
  return Value::Array(std::move(out));
}

std::string Indent(const std::string& s, const Value& width, bool first, bool blank) {
  const std::string indention =
      width.is_string()
          ? width.str()
          : std::string(static_cast<size_t>(std::max<int64_t>(0, IntArg(width, "width"))), ' ');
  // jinja2 appends a newline before splitting, so a trailing one is kept.
  std::vector<std::string> lines = SplitLines(s + "\n");
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) {
      if (i) rv += '\n' + indention;
      rv += lines[i];
    }
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) {
      rv += '\n';
      if (!lines[i].empty()) rv += indention + lines[i];
    }
  }
  return first ? indention + rv : rv;
}

Value RoundValue(const Value& v, int64_t precision, const std::string& method) {
  if (!v.is_number()) {
    if (v.is_undefined()) FailUndefined(v);
    Fail(std::string("type ") + v.TypeName() + " doesn't define __round__ method");
  }
  if (method != "common" && method != "floor" && method != "ceil") {
    Fail("method must be common, ceil or floor");
  }
  if (method == "common") {
    if (v.is_integral()) return Value(v.int_value());  // round(int, n) stays an int
    // printf rounds the exact binary value half to even, as Python's round does.
    char buf[512];
    if (precision < 0 || precision > 300)
      FailUnsupported("round with that precision is not supported");
    std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(precision), v.float_value());
    double d = 0;
    ParsePyFloat(buf, &d);
    return Value(d);
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double x = v.AsDouble() * scale;
  return Value((method == "floor" ? std::floor(x) : std::ceil(x)) / scale);
}

Value ToInt(const Value& v, const Value& def, int base) {
  if (v.is_integral()) return Value(v.int_value());
  if (v.kind() == Value::Kind::kFloat) {
    if (!std::isfinite(v.float_value()) || std::fabs(v.float_value()) >= 9.2e18) return def;
    return Value(static_cast<int64_t>(v.float_value()));
  }
  if (v.is_string()) {
    int64_t i;
    if (ParsePyInt(v.str(), base, &i)) return Value(i);
    double d;
    if (base == 10 && ParsePyFloat(v.str(), &d) && std::isfinite(d) && std::fabs(d) < 9.2e18) {
      return Value(static_cast<int64_t>(d));
    }
  }
  return def;
}

Value ToFloat(const Value& v, const Value& def) {
  if (v.is_number()) return Value(v.AsDouble());
  double d;
  if (v.is_string() && ParsePyFloat(v.str(), &d)) return Value(d);
  return def;
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

// Each filter takes the renderer, the input and the call's arguments, whether
// it uses them or not.
#define KDN_FILTER(name)                                                     \
  Value name([[maybe_unused]] Renderer& r, [[maybe_unused]] const Value& in, \
             [[maybe_unused]] Args& a, [[maybe_unused]] Kwargs& k)

KDN_FILTER(FAbs) {
  if (in.kind() == Value::Kind::kFloat) return Value(std::fabs(in.float_value()));
  if (in.is_integral()) return Arithmetic("*", in, Value(in.int_value() < 0 ? -1 : 1));
  if (in.is_undefined()) FailUndefined(in);
  Fail(std::string("bad operand type for abs(): '") + in.TypeName() + "'");
}
KDN_FILTER(FCapitalize) { return Capitalize(in.ToString()); }
KDN_FILTER(FDefault) {
  const Value def = Arg(a, k, 0, "default_value", Value(""));
  const bool boolean = Arg(a, k, 1, "boolean", Value(false)).Truthy();
  return in.is_undefined() || (boolean && !in.Truthy()) ? def : in;
}
KDN_FILTER(FDictsort) {
  if (in.is_undefined()) FailUndefined(in);
  if (!in.is_object()) Fail(std::string("'") + in.TypeName() + "' object has no attribute 'items'");
  const bool case_sensitive = Arg(a, k, 0, "case_sensitive", Value(false)).Truthy();
  const Value by = Arg(a, k, 1, "by", Value("key"));
  const bool reverse = Arg(a, k, 2, "reverse", Value(false)).Truthy();
  if (!by.is_string() || (by.str() != "key" && by.str() != "value"))
    Fail("You can only sort by either 'key' or 'value'");
  const size_t pos = by.str() == "key" ? 0 : 1;
  std::vector<Value> items;
  for (const auto& [key, v] : in.object().items)
    items.push_back(Value::Array({Value(key), v}, true));
  SortValues(
      &items, [&](const Value& item) { return Lowered(item.items()[pos], case_sensitive); },
      reverse);
  return Value::Array(std::move(items));
}
KDN_FILTER(FEscape) { return HtmlEscape(in.ToString()); }
KDN_FILTER(FFirst) {
  const std::vector<Value> items = Iterate(in);
  return items.empty() ? Value::Undefined("No first item, sequence was empty.") : items.front();
}
KDN_FILTER(FFloat) { return ToFloat(in, Arg(a, k, 0, "default", Value(0.0))); }
KDN_FILTER(FIndent) {
  return Indent(in.ToString(), Arg(a, k, 0, "width", Value(4)),
                Arg(a, k, 1, "first", Value(false)).Truthy(),
                Arg(a, k, 2, "blank", Value(false)).Truthy());
}
KDN_FILTER(FInt) {
  return ToInt(in, Arg(a, k, 0, "default", Value(0)),
               static_cast<int>(IntArg(Arg(a, k, 1, "base", Value(10)), "base")));
}
KDN_FILTER(FItems) {
  if (in.is_undefined()) return Value::Array({});
  if (!in.is_object() || in.object().is_namespace) Fail("Can only get item pairs from a mapping.");
  std::vector<Value> out;
  for (const auto& [key, v] : in.object().items) out.push_back(Value::Array({Value(key), v}, true));
  return Value::Array(std::move(out));
}
KDN_FILTER(FJoin) {
  const Value sep = Arg(a, k, 0, "d", Value(""));
  const Value attr = Arg(a, k, 1, "attribute", Value::None());
  std::string out;
  const std::vector<Value> items = Iterate(in);
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep.ToString();
    out += (attr.is_none() ? items[i] : AttrPath(items[i], attr.ToString())).ToString();
  }
  return out;
}
KDN_FILTER(FLast) {
  const std::vector<Value> items = Iterate(in);
  return items.empty() ? Value::Undefined("No last item, sequence was empty.") : items.back();
}
KDN_FILTER(FLength) { return Value(Length(in)); }
KDN_FILTER(FList) { return Value::Array(Iterate(in)); }
KDN_FILTER(FLower) { return MapCase(in.ToString(), ToLower); }
KDN_FILTER(FMap) {
  std::vector<Value> out;
  if (!in.Truthy()) return Value::Array({});  // jinja2 maps none to nothing
  if (a.empty()) {
    const Value attr = Arg(a, k, 99, "attribute");
    if (attr.is_undefined()) Fail("map needs a filter name or attribute=");
    const Value def = Arg(a, k, 99, "default");
    for (const Value& item : Iterate(in)) {
      Value v = AttrPath(item, attr.ToString());
      out.push_back(v.is_undefined() && !def.is_undefined() ? def : v);
    }
  } else {
    const std::string name = StringArg(a[0], "the filter name");
    for (const Value& item : Iterate(in)) {
      Args fa(a.begin() + 1, a.end());
      Kwargs fk = k;
      out.push_back(r.ApplyFilter(name, item, fa, fk));
    }
  }
  return Value::Array(std::move(out));
}
// min and max: the first of the smallest or largest, as Python's.
Value MinMax(const Value& in, Args& a, Kwargs& k, bool max) {
  const bool case_sensitive = Arg(a, k, 0, "case_sensitive", Value(false)).Truthy();
  const Value attr = Arg(a, k, 1, "attribute", Value::None());
  const std::vector<Value> items = Iterate(in);
  if (items.empty())
    return Value::Undefined(std::string("No aggregated item, sequence was empty."));
  auto key = [&](const Value& v) {
    return Lowered(attr.is_none() ? v : AttrPath(v, attr.ToString()), case_sensitive);
  };
  size_t best = 0;
  for (size_t i = 1; i < items.size(); ++i) {
    if (Compare(max ? ">" : "<", key(items[i]), key(items[best]))) best = i;
  }
  return items[best];
}
KDN_FILTER(FMax) { return MinMax(in, a, k, true); }
KDN_FILTER(FMin) { return MinMax(in, a, k, false); }
KDN_FILTER(FReject) { return SelectOrReject(r, in, a, false, false); }
KDN_FILTER(FRejectattr) { return SelectOrReject(r, in, a, true, false); }
KDN_FILTER(FReplace) {
  const Value count = Arg(a, k, 2, "count", Value::None());
  return Replace(in.ToString(), Arg(a, k, 0, "old").ToString(), Arg(a, k, 1, "new").ToString(),
                 count.is_none() ? -1 : IntArg(count, "count"));
}
KDN_FILTER(FReverse) {
  if (in.is_string()) {
    std::u32string u = DecodeUtf8(in.str());
    std::reverse(u.begin(), u.end());
    return EncodeUtf8(u);
  }
  std::vector<Value> items = Iterate(in);
  std::reverse(items.begin(), items.end());
  return Value::Array(std::move(items));
}
KDN_FILTER(FRound) {
  return RoundValue(in, IntArg(Arg(a, k, 0, "precision", Value(0)), "precision"),
                    Arg(a, k, 1, "method", Value("common")).ToString());
}
KDN_FILTER(FSafe) { return in; }
KDN_FILTER(FSelect) { return SelectOrReject(r, in, a, false, true); }
KDN_FILTER(FSelectattr) { return SelectOrReject(r, in, a, true, true); }
KDN_FILTER(FSort) {
  const bool reverse = Arg(a, k, 0, "reverse", Value(false)).Truthy();
  const bool case_sensitive = Arg(a, k, 1, "case_sensitive", Value(false)).Truthy();
  const Value attr = Arg(a, k, 2, "attribute", Value::None());
  std::vector<Value> items = Iterate(in);
  SortValues(
      &items,
      [&](const Value& v) {
        return Lowered(attr.is_none() ? v : AttrPath(v, attr.ToString()), case_sensitive);
      },
      reverse);
  return Value::Array(std::move(items));
}
KDN_FILTER(FString) { return in.ToString(); }
KDN_FILTER(FSum) {
  const Value attr = Arg(a, k, 0, "attribute", Value::None());
  Value total = Arg(a, k, 1, "start", Value(0));
  for (const Value& v : Iterate(in))
    total = Arithmetic("+", total, attr.is_none() ? v : AttrPath(v, attr.ToString()));
  return total;
}
KDN_FILTER(FTitle) { return Title(in.ToString()); }
// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None,
// separators=None, sort_keys=False), not jinja2's HTML-safe one.
KDN_FILTER(FToJson) {
  const Value ensure_ascii = Arg(a, k, 0, "ensure_ascii", Value(false));
  const Value indent = Arg(a, k, 1, "indent", Value::None());
  const Value separators = Arg(a, k, 2, "separators", Value::None());
  const Value sort_keys = Arg(a, k, 3, "sort_keys", Value(false));
  std::string item_sep, key_sep;
  if (!separators.is_none()) {
    if (!separators.is_array() || separators.items().size() != 2)
      Fail("separators must be a pair of strings");
    item_sep = StringArg(separators.items()[0], "separator");
    key_sep = StringArg(separators.items()[1], "separator");
  }
  if (!indent.is_none() && !indent.is_integral())
    FailUnsupported("tojson's indent must be an integer or none");
  Result<std::string> s =
      ToJson(in, indent.is_none() ? -1 : static_cast<int>(std::max<int64_t>(0, indent.int_value())),
             ensure_ascii.Truthy(), sort_keys.Truthy(), separators.is_none() ? nullptr : &item_sep,
             separators.is_none() ? nullptr : &key_sep);
  if (!s.ok()) Fail(s.status().message());
  return std::move(s).value();
}
KDN_FILTER(FTrim) {
  const Value chars = Arg(a, k, 0, "chars", Value::None());
  const std::string set = chars.is_none() ? "" : chars.ToString();
  return PyStrip(in.ToString(), chars.is_none() ? nullptr : &set, true, true);
}
KDN_FILTER(FUnique) {
  const bool case_sensitive = Arg(a, k, 0, "case_sensitive", Value(false)).Truthy();
  const Value attr = Arg(a, k, 1, "attribute", Value::None());
  std::vector<Value> out, seen;
  for (const Value& v : Iterate(in)) {
    const Value key = Lowered(attr.is_none() ? v : AttrPath(v, attr.ToString()), case_sensitive);
    if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return s.Equals(key); })) {
      seen.push_back(key);
      out.push_back(v);
    }
  }
  return Value::Array(std::move(out));
}
KDN_FILTER(FUpper) { return MapCase(in.ToString(), ToUpper); }

#undef KDN_FILTER

const std::map<std::string, FilterFn, std::less<>>& Filters() {
  static const auto* filters = new std::map<std::string, FilterFn, std::less<>>{
      {"abs", FAbs},
      {"capitalize", FCapitalize},
      {"count", FLength},
      {"d", FDefault},
      {"default", FDefault},
      {"dictsort", FDictsort},
      {"e", FEscape},
      {"escape", FEscape},
      {"first", FFirst},
      {"float", FFloat},
      {"indent", FIndent},
      {"int", FInt},
      {"items", FItems},
      {"join", FJoin},
      {"last", FLast},
      {"length", FLength},
      {"list", FList},
      {"lower", FLower},
      {"map", FMap},
      {"max", FMax},
      {"min", FMin},
      {"reject", FReject},
      {"rejectattr", FRejectattr},
      {"replace", FReplace},
      {"reverse", FReverse},
      {"round", FRound},
      {"safe", FSafe},
      {"select", FSelect},
      {"selectattr", FSelectattr},
      {"sort", FSort},
      {"string", FString},
      {"sum", FSum},
      {"title", FTitle},
      {"tojson", FToJson},
      {"trim", FTrim},
      {"unique", FUnique},
      {"upper", FUpper},
  };
  return *filters;
}

// --- Tests -------------------------------------------------------------------------

#define KDN_TEST(name) \
  bool name([[maybe_unused]] Renderer& r, [[maybe_unused]] const Value& v, [[maybe_unused]] Args& a)

KDN_TEST(TDefined) { return !v.is_undefined(); }
KDN_TEST(TUndefined) { return v.is_undefined(); }
KDN_TEST(TNone) { return v.is_none(); }
KDN_TEST(TBoolean) { return v.kind() == Value::Kind::kBool; }
KDN_TEST(TTrue) { return v.kind() == Value::Kind::kBool && v.int_value(); }
KDN_TEST(TFalse) { return v.kind() == Value::Kind::kBool && !v.int_value(); }
KDN_TEST(TInteger) { return v.kind() == Value::Kind::kInt; }
KDN_TEST(TFloat) { return v.kind() == Value::Kind::kFloat; }
KDN_TEST(TNumber) { return v.is_number(); }
KDN_TEST(TString) { return v.is_string(); }
KDN_TEST(TMapping) { return v.is_object() && !v.object().is_namespace; }
// Python's iter() and jinja2's test_sequence (len() and __getitem__) accept
// an Undefined, strings and dicts alike.
KDN_TEST(TIterable) {
  return v.is_undefined() || v.is_string() || v.is_array() ||
         (v.is_object() && !v.object().is_namespace);
}
KDN_TEST(TCallable) { return v.kind() == Value::Kind::kFunction; }
KDN_TEST(TOdd) { return Arithmetic("%", v, Value(2)).Equals(Value(1)); }
KDN_TEST(TEven) { return Arithmetic("%", v, Value(2)).Equals(Value(0)); }
KDN_TEST(TDivisibleBy) {
  if (a.size() != 1) Fail("divisibleby takes one argument");
  return Arithmetic("%", v, a[0]).Equals(Value(0));
}
bool Need1(const Args& a, const char* test) {
  if (a.size() != 1) Fail(std::string(test) + " takes one argument");
  return true;
}
KDN_TEST(TEq) { return Need1(a, "eq") && v.Equals(a[0]); }
KDN_TEST(TNe) { return Need1(a, "ne") && !v.Equals(a[0]); }
KDN_TEST(TLt) { return Need1(a, "lt") && Compare("<", v, a[0]); }
KDN_TEST(TLe) { return Need1(a, "le") && Compare("<=", v, a[0]); }
KDN_TEST(TGt) { return Need1(a, "gt") && Compare(">", v, a[0]); }
KDN_TEST(TGe) { return Need1(a, "ge") && Compare(">=", v, a[0]); }
KDN_TEST(TIn) { return Need1(a, "in") && Contains(a[0], v); }
KDN_TEST(TSameAs) { return Need1(a, "sameas") && v.SameAs(a[0]); }
KDN_TEST(TLower) {
  const std::u32string u = DecodeUtf8(v.ToString());
  return std::any_of(u.begin(), u.end(), IsCased) && std::none_of(u.begin(), u.end(), IsUpper);
}
KDN_TEST(TUpper) {
  const std::u32string u = DecodeUtf8(v.ToString());
  return std::any_of(u.begin(), u.end(), IsCased) && std::none_of(u.begin(), u.end(), IsLower);
}
KDN_TEST(TEscaped) { return false; }
KDN_TEST(TFilter) { return v.is_string() && FindFilter(v.str()) != nullptr; }
KDN_TEST(TTest) { return v.is_string() && FindTest(v.str()) != nullptr; }

#undef KDN_TEST

const std::map<std::string, TestFn, std::less<>>& Tests() {
  static const auto* tests = new std::map<std::string, TestFn, std::less<>>{
      {"defined", TDefined},
      {"undefined", TUndefined},
      {"none", TNone},
      {"boolean", TBoolean},
      {"true", TTrue},
      {"false", TFalse},
      {"integer", TInteger},
      {"float", TFloat},
      {"number", TNumber},
      {"string", TString},
      {"mapping", TMapping},
      {"iterable", TIterable},
      {"sequence", TIterable},
      {"callable", TCallable},
      {"odd", TOdd},
      {"even", TEven},
      {"divisibleby", TDivisibleBy},
      {"eq", TEq},
      {"equalto", TEq},
      {"==", TEq},
      {"ne", TNe},
      {"!=", TNe},
      {"lt", TLt},
      {"lessthan", TLt},
      {"<", TLt},
      {"le", TLe},
      {"<=", TLe},
      {"gt", TGt},
      {"greaterthan", TGt},
      {">", TGt},
      {"ge", TGe},
      {">=", TGe},
      {"in", TIn},
      {"sameas", TSameAs},
      {"lower", TLower},
      {"upper", TUpper},
      {"escaped", TEscaped},
      {"filter", TFilter},
      {"test", TTest},
  };
  return *tests;
}

}  // namespace

FilterFn FindFilter(std::string_view name) {
  auto it = Filters().find(name);
  return it == Filters().end() ? nullptr : it->second;
}

TestFn FindTest(std::string_view name) {
  auto it = Tests().find(name);
  return it == Tests().end() ? nullptr : it->second;
}

Value Renderer::ApplyFilter(const std::string& name, const Value& input, Args& args,
                            Kwargs& kwargs) {
  FilterFn f = FindFilter(name);
  if (f == nullptr) Fail("No filter named '" + name + "' found.");  // one the parser let pass
  return f(*this, input, args, kwargs);
}

bool Renderer::ApplyTest(const std::string& name, const Value& input, Args& args) {
  TestFn t = FindTest(name);
  if (t == nullptr) Fail("No test named '" + name + "' found.");
  return t(*this, input, args);
}

}  // namespace kdn::text::jinja
