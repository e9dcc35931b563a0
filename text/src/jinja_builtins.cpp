// What a Jinja2 template can reach besides filters and tests
// (kdn/text/jinja.h): attribute, item and slice access, the methods of str
// and dict, and the globals of transformers' environment. Each behaves as its
// jinja2 (3.1) or Python original, checked against them in
// tests/parity/test_chat_template.py.
#include <algorithm>
#include <charconv>
#include <ctime>
#include <set>

#include "jinja_internal.h"

namespace kdn::text::jinja {

Value Arg(const Args& args, const Kwargs& kwargs, size_t index, const char* name, Value def) {
  if (index < args.size()) return args[index];
  for (const auto& [k, v] : kwargs) {
    if (k == name) return v;
  }
  return def;
}

std::string StringArg(const Value& v, const char* what) {
  if (!v.is_string()) Fail(std::string(what) + " must be str, not " + v.TypeName());
  return v.str();
}

int64_t IntArg(const Value& v, const char* what) {
  if (!v.is_integral()) Fail(std::string(what) + " must be an integer, not " + v.TypeName());
  return v.int_value();
}

namespace {

// jinja2's name for a value's type in "has no attribute" messages.
std::string ObjectTypeRepr(const Value& v) {
  if (v.is_none()) return "None";
  return std::string(v.TypeName()) + " object";
}

// Built with += : GCC 12 warns falsely (-Wrestrict) on "'" + std::string.
Value NoAttribute(const Value& obj, const std::string& name) {
  std::string hint = "'";
  hint += ObjectTypeRepr(obj);
  hint += "' has no attribute '";
  hint += name;
  hint += "'";
  return Value::Undefined(std::move(hint));
}

Value NoElement(const Value& obj, const Value& key) {
  std::string hint = "'";
  hint += ObjectTypeRepr(obj);
  hint += "' has no element ";
  hint += key.Repr();
  return Value::Undefined(std::move(hint));
}

Value Bind(std::string name, std::function<Value(Args&, Kwargs&)> fn) {
  auto f = std::make_shared<Function>();
  f->name = std::move(name);
  f->call = [fn = std::move(fn)](Renderer&, Args& args, Kwargs& kwargs) {
    return fn(args, kwargs);
  };
  return Value::Callable(std::move(f));
}

// The code-point index of byte offset `at` in s.
int64_t CodePoints(const std::string& s, size_t at) {
  return static_cast<int64_t>(DecodeUtf8(std::string_view(s).substr(0, at)).size());
}

std::string Format(const std::string& fmt, const Args& args, const Kwargs& kwargs) {
  std::string out;
  size_t auto_index = 0;
  bool manual = false;
  for (size_t i = 0; i < fmt.size(); ++i) {
    const char c = fmt[i];
    if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}')
        ++i;
      else
        Fail("Single '}' encountered in format string");
      out += '}';
      continue;
    }
    if (c != '{') {
      out += c;
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out += '{';
      ++i;
      continue;
    }
    const size_t end = fmt.find('}', i);
    if (end == std::string::npos) Fail("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, end - i - 1);
    i = end;
    char conversion = 0;
    if (const size_t bang = field.find('!'); bang != std::string::npos) {
      conversion = bang + 1 < field.size() ? field[bang + 1] : 0;
      field.resize(bang);
    }
    if (field.find(':') != std::string::npos || field.find('.') != std::string::npos ||
        field.find('[') != std::string::npos) {
      FailUnsupported("str.format with format specs or attribute access is not supported");
    }
    Value v;
    if (field.empty() ? manual
                      : auto_index > 0 && std::isdigit(static_cast<unsigned char>(field[0]))) {
      // The sandbox formats with string.Formatter, which says this either way.
      Fail("cannot switch from manual field specification to automatic field numbering");
    }
    if (field.empty()) {
      if (auto_index >= args.size())
        Fail("Replacement index " + std::to_string(auto_index) + " out of range");
      v = args[auto_index++];
    } else if (std::isdigit(static_cast<unsigned char>(field[0]))) {
      manual = true;
      size_t k = 0;
      const auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), k);
      if (ec != std::errc() || end != field.data() + field.size() || k >= args.size()) {
        Fail("Replacement index " + field + " out of range");
      }
      v = args[k];
    } else {
      v = Arg({}, kwargs, 0, field.c_str(), Value::Undefined("'" + field + "'"));
      if (v.is_undefined()) Fail("KeyError: '" + field + "'");
    }
    out += conversion == 'r' ? v.Repr() : v.ToString();
  }
  return out;
}

Value StringMethod(const std::string& self, const std::string& name) {
  static const std::set<std::string> kMethods = {
      "strip",      "lstrip",     "rstrip",  "startswith", "endswith", "split",
      "rsplit",     "splitlines", "replace", "upper",      "lower",    "title",
      "capitalize", "find",       "rfind",   "count",      "format",   "join",
      "isdigit",    "isalpha",    "isalnum", "isspace",    "islower",  "isupper"};
  if (!kMethods.count(name)) return Value();
  return Bind(name, [self, name](Args& a, Kwargs& k) -> Value {
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const Value chars = Arg(a, k, 0, "chars", Value::None());
      const std::string set_chars = chars.is_none() ? "" : StringArg(chars, "strip arg");
      const std::string* set = chars.is_none() ? nullptr : &set_chars;
      return PyStrip(self, set, name != "rstrip", name != "lstrip");
    }
    if (name == "startswith" || name == "endswith") {
      const Value p = Arg(a, k, 0, "prefix");
      std::vector<Value> options = p.is_array() ? p.items() : std::vector<Value>{p};
      for (const Value& o : options) {
        const std::string x = StringArg(o, name.c_str());
        if (name == "startswith" ? self.compare(0, x.size(), x) == 0 && self.size() >= x.size()
                                 : self.size() >= x.size() &&
                                       self.compare(self.size() - x.size(), x.size(), x) == 0) {
          return true;
        }
      }
      return false;
    }
    if (name == "split" || name == "rsplit") {
      return Value::Array(Split(self, Arg(a, k, 0, "sep", Value::None()),
                                IntArg(Arg(a, k, 1, "maxsplit", Value(-1)), "maxsplit"),
                                name == "rsplit"));
    }
    if (name == "splitlines") {
      std::vector<Value> out;
      for (auto& l : SplitLines(self)) out.emplace_back(std::move(l));
      return Value::Array(std::move(out));
    }
    if (name == "replace") {
      return Replace(self, StringArg(Arg(a, k, 0, "old"), "replace() argument 1"),
                     StringArg(Arg(a, k, 1, "new"), "replace() argument 2"),
                     IntArg(Arg(a, k, 2, "count", Value(-1)), "count"));
    }
    if (name == "upper") return MapCase(self, ToUpper);
    if (name == "lower") return MapCase(self, ToLower);
    if (name == "title") return Title(self);
    if (name == "capitalize") return Capitalize(self);
    if (name == "find" || name == "rfind") {
      if (a.size() > 1) FailUnsupported("str." + name + " with start or end is not supported");
      const std::string sub = StringArg(Arg(a, k, 0, "sub"), name.c_str());
      const size_t at = name == "find" ? self.find(sub) : self.rfind(sub);
      return at == std::string::npos ? Value(-1) : Value(CodePoints(self, at));
    }
    if (name == "count") {
      const std::string sub = StringArg(Arg(a, k, 0, "sub"), "count");
      if (sub.empty()) return Value(static_cast<int64_t>(DecodeUtf8(self).size()) + 1);
      int64_t n = 0;
      for (size_t at = self.find(sub); at != std::string::npos;
           at = self.find(sub, at + sub.size()))
        ++n;
      return Value(n);
    }
    if (name == "format") return Format(self, a, k);
    if (name == "join") {
      std::string out;
      const std::vector<Value> items = Iterate(Arg(a, k, 0, "iterable"));
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += self;
        out += StringArg(items[i], "sequence item");
      }
      return out;
    }
    const std::u32string u = DecodeUtf8(self);
    if (u.empty()) return false;
    auto all = [&](auto pred) { return std::all_of(u.begin(), u.end(), pred); };
    if (name == "isdigit") return all([](char32_t c) { return c >= '0' && c <= '9'; });
    if (name == "isalpha") return all([](char32_t c) { return IsCased(c); });
    if (name == "isalnum")
      return all([](char32_t c) { return IsCased(c) || (c >= '0' && c <= '9'); });
    if (name == "isspace") return all(IsPySpace);
    const bool any_cased = std::any_of(u.begin(), u.end(), IsCased);
    if (name == "islower") return any_cased && std::none_of(u.begin(), u.end(), IsUpper);
    return any_cased && std::none_of(u.begin(), u.end(), IsLower);  // isupper
  });
}

Value DictMethod(const Value& self, const std::string& name) {
  if (name != "items" && name != "keys" && name != "values" && name != "get") return Value();
  return Bind(name, [self, name](Args& a, Kwargs& k) -> Value {
    if (name == "get") {
      const Value key = Arg(a, k, 0, "key");
      const Value* v = key.is_string() ? self.object().Find(key.str()) : nullptr;
      return v ? *v : Arg(a, k, 1, "default", Value::None());
    }
    std::vector<Value> out;
    for (const auto& [key, v] : self.object().items) {
      if (name == "items") out.push_back(Value::Array({Value(key), v}, true));
      if (name == "keys") out.emplace_back(key);
      if (name == "values") out.push_back(v);
    }
    return Value::Array(std::move(out));
  });
}

}  // namespace

Value GetAttr(const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined: FailUndefined(obj);
    case Value::Kind::kObject: {
      if (!obj.object().is_namespace) {
        if (Value m = DictMethod(obj, name); !m.is_undefined()) return m;
      }
      if (const Value* v = obj.object().Find(name)) return *v;
      break;
    }
    case Value::Kind::kString:
      if (Value m = StringMethod(obj.str(), name); !m.is_undefined()) return m;
      break;
    default: break;
  }
  return NoAttribute(obj, name);
}

Value GetItem(const Value& obj, const Value& key) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined: FailUndefined(obj);
    case Value::Kind::kObject:
      if (key.is_string()) {
        if (const Value* v = obj.object().Find(key.str())) return *v;
        return GetAttr(obj, key.str());
      }
      break;
    case Value::Kind::kArray:
    case Value::Kind::kString:
      if (key.is_integral()) {
        const bool is_str = obj.is_string();
        const std::u32string u = is_str ? DecodeUtf8(obj.str()) : std::u32string();
        const int64_t n =
            is_str ? static_cast<int64_t>(u.size()) : static_cast<int64_t>(obj.items().size());
        int64_t i = key.int_value();
        if (i < 0) i += n;
        if (i < 0 || i >= n) break;
        return is_str ? Value(EncodeUtf8(u.substr(i, 1))) : obj.items()[i];
      }
      if (key.is_string()) return GetAttr(obj, key.str());
      break;
    default: break;
  }
  if (key.is_string()) return NoAttribute(obj, key.str());
  return NoElement(obj, key);
}

Value GetSlice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  if (obj.is_undefined()) FailUndefined(obj);
  // jinja2 compiles a slice to Python's own subscript: no undefined fallback.
  for (const Value* b : {&start_v, &stop_v, &step_v}) {
    if (!b->is_none() && !b->is_integral())
      Fail("slice indices must be integers or None or have an __index__ method");
  }
  if (!obj.is_string() && !obj.is_array())
    Fail(std::string("'") + obj.TypeName() + "' object is not subscriptable");
  const int64_t step = step_v.is_none() ? 1 : step_v.int_value();
  if (step == 0) Fail("slice step cannot be zero");
  const std::u32string u = obj.is_string() ? DecodeUtf8(obj.str()) : std::u32string();
  const int64_t n =
      obj.is_string() ? static_cast<int64_t>(u.size()) : static_cast<int64_t>(obj.items().size());
  const int64_t lower = step > 0 ? 0 : -1, upper = step > 0 ? n : n - 1;
  auto adjust = [&](const Value& v, int64_t def) {
    if (v.is_none()) return def;
    int64_t i = v.int_value();
    return i < 0 ? std::max(i + n, lower) : std::min(i, upper);
  };
  const int64_t start = adjust(start_v, step > 0 ? lower : upper);
  const int64_t stop = adjust(stop_v, step > 0 ? upper : lower);
  std::u32string s;
  std::vector<Value> items;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    if (obj.is_string()) {
      s += u[i];
    } else {
      items.push_back(obj.items()[i]);
    }
  }
  if (obj.is_string()) return EncodeUtf8(s);
  return Value::Array(std::move(items), obj.is_tuple());
}

// --- Globals ----------------------------------------------------------------------

namespace {

// jinja2's sandbox refuses larger ranges (MAX_RANGE).
constexpr int64_t kMaxRange = 100000;

Value Global(const std::string& name, std::function<Value(Args&, Kwargs&)> fn) {
  return Bind(name, std::move(fn));
}

}  // namespace

Value LookupGlobal(const std::string& name) {
  if (name == "raise_exception") {
    return Global(name, [](Args& a, Kwargs& k) -> Value {
      throw TemplateError{StatusCode::kInvalidArgument, Arg(a, k, 0, "message").ToString(), 0,
                          true};
    });
  }
  if (name == "namespace" || name == "dict") {
    const bool ns = name == "namespace";
    return Global(name, [ns](Args& a, Kwargs& k) -> Value {
      Value v = Value::Object();
      v.object().is_namespace = ns;
      for (const Value& init : a) {
        if (!init.is_object()) Fail(std::string(ns ? "namespace" : "dict") + "() takes a mapping");
        for (const auto& [key, val] : init.object().items) v.object().Set(key, val);
      }
      for (const auto& [key, val] : k) v.object().Set(key, val);
      return v;
    });
  }
  if (name == "range") {
    return Global(name, [](Args& a, Kwargs&) -> Value {
      if (a.empty() || a.size() > 3)
        Fail("range expected 1 to 3 arguments, got " + std::to_string(a.size()));
      int64_t start = 0, stop, step = 1;
      if (a.size() == 1) {
        stop = IntArg(a[0], "range()'s argument");
      } else {
        start = IntArg(a[0], "range()'s argument");
        stop = IntArg(a[1], "range()'s argument");
        if (a.size() == 3) step = IntArg(a[2], "range()'s argument");
      }
      if (step == 0) Fail("range() arg 3 must not be zero");
      std::vector<Value> out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (static_cast<int64_t>(out.size()) >= kMaxRange) {
          Fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        }
        out.emplace_back(i);
      }
      return Value::Array(std::move(out));
    });
  }
  if (name == "strftime_now") {
    // Newer transformers define it (Llama 3.2 and Mistral's templates print
    // the date with it); local time, as datetime.now() is.
    return Global(name, [](Args& a, Kwargs& k) -> Value {
      const std::string fmt = StringArg(Arg(a, k, 0, "format"), "strftime_now's format");
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
      if (n == 0 && !fmt.empty())
        FailUnsupported("strftime_now's format gives over 255 bytes or nothing");
      return std::string(buf, n);
    });
  }
  return Value();
}

}  // namespace kdn::text::jinja
