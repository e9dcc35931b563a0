// Values of the Jinja2 interpreter (kdn/text/jinja.h) and Python's rules for
// them: str(), repr(), ==, the operators, iteration, json.dumps.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "jinja_internal.h"

namespace kdn::text::jinja {

void Fail(std::string message, int line) {
  throw TemplateError{StatusCode::kInvalidArgument, std::move(message), line, false};
}

void FailUnsupported(std::string message, int line) {
  throw TemplateError{StatusCode::kUnimplemented, std::move(message), line, false};
}

void FailUndefined(const Value& v) { Fail(v.str()); }

// --- Value -------------------------------------------------------------------

const Value* ObjectData::Find(std::string_view key) const {
  for (const auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}

void ObjectData::Set(std::string key, Value value) {
  for (auto& [k, v] : items) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(std::move(key), std::move(value));
}

Value Value::None() {
  Value v;
  v.kind_ = Kind::kNone;
  return v;
}

Value Value::Undefined(std::string hint) {
  Value v;
  v.str_ = std::move(hint);
  return v;
}

Value Value::Array(std::vector<Value> items, bool tuple) {
  Value v;
  v.kind_ = Kind::kArray;
  v.array_ = std::make_shared<ArrayData>(ArrayData{std::move(items), tuple});
  return v;
}

Value Value::Object(std::vector<std::pair<std::string, Value>> items) {
  Value v;
  v.kind_ = Kind::kObject;
  v.object_ = std::make_shared<ObjectData>(ObjectData{std::move(items), false});
  return v;
}

Value Value::Callable(std::shared_ptr<const Function> fn) {
  Value v;
  v.kind_ = Kind::kFunction;
  v.function_ = std::move(fn);
  return v;
}

bool Value::Truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool:
    case Kind::kInt: return int_ != 0;
    case Kind::kFloat: return float_ != 0;
    case Kind::kString: return !str_.empty();
    case Kind::kArray: return !array_->items.empty();
    case Kind::kObject: return object_->is_namespace || !object_->items.empty();
    case Kind::kFunction: return true;
  }
  return false;
}

const char* Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kArray: return array_->tuple ? "tuple" : "list";
    case Kind::kObject: return object_->is_namespace ? "Namespace" : "dict";
    case Kind::kFunction: return "function";
  }
  return "object";
}

namespace {

std::string StringRepr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const char quote = has_single && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : DecodeUtf8(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f || (c >= 0x80 && c < 0xa0)) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
      out += buf;
    } else {
      AppendUtf8(c, &out);
    }
  }
  return out + quote;
}

}  // namespace

std::string Value::ToString() const {
  switch (kind_) {
    case Kind::kUndefined: return "";
    case Kind::kString: return str_;
    case Kind::kObject:
      if (object_->is_namespace) return "<Namespace " + Value::Object(object_->items).Repr() + ">";
      return Repr();
    default: return Repr();
  }
}

std::string Value::Repr() const {
  switch (kind_) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "None";
    case Kind::kBool: return int_ ? "True" : "False";
    case Kind::kInt: return std::to_string(int_);
    case Kind::kFloat: return FloatRepr(float_);
    case Kind::kString: return StringRepr(str_);
    case Kind::kArray: {
      std::string out = array_->tuple ? "(" : "[";
      for (size_t i = 0; i < array_->items.size(); ++i) {
        if (i) out += ", ";
        out += array_->items[i].Repr();
      }
      if (array_->tuple && array_->items.size() == 1) out += ",";
      return out + (array_->tuple ? ")" : "]");
    }
    case Kind::kObject: {
      if (object_->is_namespace) return ToString();
      std::string out = "{";
      for (size_t i = 0; i < object_->items.size(); ++i) {
        if (i) out += ", ";
        out += StringRepr(object_->items[i].first) + ": " + object_->items[i].second.Repr();
      }
      return out + "}";
    }
    case Kind::kFunction: return "<function " + function_->name + ">";
  }
  return "";
}

bool Value::Equals(const Value& o) const {
  if (is_number() && o.is_number()) {
    if (is_integral() && o.is_integral()) return int_ == o.int_;
    return AsDouble() == o.AsDouble();
  }
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return true;
    case Kind::kString: return str_ == o.str_;
    case Kind::kArray:
      // Python's list never equals a tuple.
      if (array_->tuple != o.array_->tuple || array_->items.size() != o.array_->items.size())
        return false;
      for (size_t i = 0; i < array_->items.size(); ++i) {
        if (!array_->items[i].Equals(o.array_->items[i])) return false;
      }
      return true;
    case Kind::kObject:
      if (object_->is_namespace || o.object_->is_namespace) return object_ == o.object_;
      if (object_->items.size() != o.object_->items.size()) return false;
      for (const auto& [k, v] : object_->items) {
        const Value* w = o.object_->Find(k);
        if (w == nullptr || !v.Equals(*w)) return false;
      }
      return true;
    case Kind::kFunction: return function_ == o.function_;
    default: return false;
  }
}

bool Value::SameAs(const Value& o) const {
  if (kind_ != o.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return true;
    case Kind::kBool:
    case Kind::kInt: return int_ == o.int_;  // CPython caches small ints and the bools
    case Kind::kFloat: return false;
    case Kind::kString: return str_ == o.str_;
    case Kind::kArray: return array_ == o.array_;
    case Kind::kObject: return object_ == o.object_;
    case Kind::kFunction: return function_ == o.function_;
  }
  return false;
}

// --- JSON --------------------------------------------------------------------

namespace {

// Ordered, as Python's json.loads keeps a dict's keys.
Value FromJson(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return Value::None();
    case nlohmann::json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<double>(u));
      return Value(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      std::vector<Value> items;
      for (const auto& e : j) items.push_back(FromJson(e));
      return Value::Array(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      std::vector<std::pair<std::string, Value>> items;
      for (auto it = j.begin(); it != j.end(); ++it)
        items.emplace_back(it.key(), FromJson(it.value()));
      return Value::Object(std::move(items));
    }
    default: return Value();
  }
}

void JsonString(const std::string& s, bool ensure_ascii, std::string* out) {
  *out += '"';
  for (char32_t c : DecodeUtf8(s)) {
    switch (c) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      case '\b': *out += "\\b"; break;
      case '\f': *out += "\\f"; break;
      default: {
        char buf[16];
        if (c < 0x20 || (ensure_ascii && c >= 0x7f)) {
          if (c >= 0x10000) {
            const char32_t v = c - 0x10000;
            std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x",
                          static_cast<unsigned>(0xd800 + (v >> 10)),
                          static_cast<unsigned>(0xdc00 + (v & 0x3ff)));
          } else {
            std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          }
          *out += buf;
        } else {
          AppendUtf8(c, out);
        }
      }
    }
  }
  *out += '"';
}

struct JsonWriter {
  int indent;
  bool ensure_ascii;
  bool sort_keys;
  std::string item_sep, key_sep;
  std::string out;

  void Newline(int depth) {
    out += '\n';
    out.append(static_cast<size_t>(indent) * depth, ' ');
  }

  void Write(const Value& v, int depth) {
    switch (v.kind()) {
      case Value::Kind::kNone: out += "null"; return;
      case Value::Kind::kBool: out += v.int_value() ? "true" : "false"; return;
      case Value::Kind::kInt: out += std::to_string(v.int_value()); return;
      case Value::Kind::kFloat: {
        const double d = v.float_value();
        out += std::isnan(d)   ? "NaN"
               : std::isinf(d) ? (d < 0 ? "-Infinity" : "Infinity")
                               : FloatRepr(d);
        return;
      }
      case Value::Kind::kString: JsonString(v.str(), ensure_ascii, &out); return;
      case Value::Kind::kArray: {
        if (v.items().empty()) {
          out += "[]";
          return;
        }
        out += '[';
        for (size_t i = 0; i < v.items().size(); ++i) {
          if (i) out += item_sep;
          if (indent >= 0) Newline(depth + 1);
          Write(v.items()[i], depth + 1);
        }
        if (indent >= 0) Newline(depth);
        out += ']';
        return;
      }
      case Value::Kind::kObject: {
        if (v.object().is_namespace) break;
        auto items = v.object().items;
        if (items.empty()) {
          out += "{}";
          return;
        }
        if (sort_keys) {
          std::stable_sort(items.begin(), items.end(),
                           [](const auto& a, const auto& b) { return a.first < b.first; });
        }
        out += '{';
        for (size_t i = 0; i < items.size(); ++i) {
          if (i) out += item_sep;
          if (indent >= 0) Newline(depth + 1);
          JsonString(items[i].first, ensure_ascii, &out);
          out += key_sep;
          Write(items[i].second, depth + 1);
        }
        if (indent >= 0) Newline(depth);
        out += '}';
        return;
      }
      default: break;
    }
    Fail(std::string("Object of type ") + v.TypeName() + " is not JSON serializable");
  }
};

}  // namespace

Result<Value> ValueFromJson(std::string_view json_text) {
  nlohmann::ordered_json j =
      nlohmann::ordered_json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument("not valid JSON");
  return FromJson(j);
}

Result<std::string> ToJson(const Value& value, int indent, bool ensure_ascii, bool sort_keys,
                           const std::string* item_separator, const std::string* key_separator) {
  // Python's defaults: ", " between items, or "," when indenting.
  JsonWriter w{indent,
               ensure_ascii,
               sort_keys,
               item_separator ? *item_separator : (indent >= 0 ? "," : ", "),
               key_separator ? *key_separator : ": ",
               {}};
  try {
    w.Write(value, 0);
  } catch (const TemplateError& e) {
    return InvalidArgument(e.message);
  }
  return std::move(w.out);
}

// --- Operators -----------------------------------------------------------------

namespace {

[[noreturn]] void OperandError(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) FailUndefined(a);
  if (b.is_undefined()) FailUndefined(b);
  if (op == "+" && a.is_string()) {
    Fail(std::string("can only concatenate str (not \"") + b.TypeName() + "\") to str");
  }
  Fail("unsupported operand type(s) for " + op + ": '" + a.TypeName() + "' and '" + b.TypeName() +
       "'");
}

// x op y, failing on overflow.
template <typename Op>
int64_t Checked(int64_t x, int64_t y, Op op) {
  int64_t r;
  if (op(x, y, &r)) FailUnsupported("integer overflow (kdn's integers are 64-bit)");
  return r;
}
bool Add(int64_t x, int64_t y, int64_t* r) { return __builtin_add_overflow(x, y, r); }
bool Sub(int64_t x, int64_t y, int64_t* r) { return __builtin_sub_overflow(x, y, r); }
bool Mul(int64_t x, int64_t y, int64_t* r) { return __builtin_mul_overflow(x, y, r); }

Value Repeat(const Value& seq, int64_t n) {
  if (n < 0) n = 0;
  if (seq.is_string()) {
    if (n > 0 && seq.str().size() * n > (64u << 20)) Fail("a repeated string over 64 MiB");
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += seq.str();
    return out;
  }
  std::vector<Value> items;
  for (int64_t i = 0; i < n && items.size() < (1u << 20); ++i) {
    items.insert(items.end(), seq.items().begin(), seq.items().end());
  }
  return Value::Array(std::move(items), seq.is_tuple());
}

double FloorMod(double a, double b) {
  double m = std::fmod(a, b);
  if (m != 0 && ((m < 0) != (b < 0))) m += b;
  return m;
}

}  // namespace

Value Arithmetic(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return a.ToString() + b.ToString();
  if (a.is_number() && b.is_number()) {
    const bool ints = a.is_integral() && b.is_integral();
    const int64_t x = a.int_value(), y = b.int_value();
    const double p = a.AsDouble(), q = b.AsDouble();
    if (op == "+") return ints ? Value(Checked(x, y, Add)) : Value(p + q);
    if (op == "-") return ints ? Value(Checked(x, y, Sub)) : Value(p - q);
    if (op == "*") return ints ? Value(Checked(x, y, Mul)) : Value(p * q);
    if (op == "/") {
      if (q == 0) Fail("division by zero");
      return Value(p / q);
    }
    if (op == "//" || op == "%") {
      if (q == 0) Fail(ints ? "integer division or modulo by zero" : "float modulo");
      if (ints) {
        if (x == INT64_MIN && y == -1)
          FailUnsupported("integer overflow (kdn's integers are 64-bit)");
        int64_t d = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) {
          --d;
          m += y;
        }
        return op == "//" ? Value(d) : Value(m);
      }
      return op == "//" ? Value(std::floor(p / q)) : Value(FloorMod(p, q));
    }
    if (op == "**") {
      if (ints && y >= 0) {
        if (x == 0 || x == 1) return Value(y == 0 ? int64_t{1} : x);
        if (x == -1) return Value(y % 2 ? int64_t{-1} : int64_t{1});
        int64_t result = 1;  // |x| >= 2: under 64 multiplications before an overflow
        for (int64_t i = 0; i < y; ++i) result = Checked(result, x, Mul);
        return Value(result);
      }
      return Value(std::pow(p, q));
    }
  }
  if (op == "+" && a.is_string() && b.is_string()) return a.str() + b.str();
  if (op == "+" && a.is_array() && b.is_array() && a.is_tuple() == b.is_tuple()) {
    std::vector<Value> items = a.items();
    items.insert(items.end(), b.items().begin(), b.items().end());
    return Value::Array(std::move(items), a.is_tuple());
  }
  if (op == "*" && (a.is_string() || a.is_array()) && b.is_integral())
    return Repeat(a, b.int_value());
  if (op == "*" && (b.is_string() || b.is_array()) && a.is_integral())
    return Repeat(b, a.int_value());
  if (op == "%" && a.is_string()) FailUnsupported("%-formatting of strings is not supported");
  OperandError(op, a, b);
}

namespace {

// -1, 0, 1 for Python's ordering of two values; fails where Python has none.
int Order(const std::string& op, const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral())
      return (a.int_value() > b.int_value()) - (a.int_value() < b.int_value());
    const double x = a.AsDouble(), y = b.AsDouble();
    return (x > y) - (x < y);
  }
  if (a.is_string() && b.is_string())
    return a.str().compare(b.str()) < 0 ? -1 : a.str() == b.str() ? 0 : 1;
  if (a.is_array() && b.is_array() && a.is_tuple() == b.is_tuple()) {
    const auto& x = a.items();
    const auto& y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!x[i].Equals(y[i])) return Order(op, x[i], y[i]);
    }
    return (x.size() > y.size()) - (x.size() < y.size());
  }
  if (a.is_undefined()) FailUndefined(a);
  if (b.is_undefined()) FailUndefined(b);
  Fail("'" + op + "' not supported between instances of '" + a.TypeName() + "' and '" +
       b.TypeName() + "'");
}

}  // namespace

bool Compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return a.Equals(b);
  if (op == "!=") return !a.Equals(b);
  const int o = Order(op, a, b);
  if (op == "<") return o < 0;
  if (op == "<=") return o <= 0;
  if (op == ">") return o > 0;
  return o >= 0;
}

bool Contains(const Value& c, const Value& item) {
  switch (c.kind()) {
    case Value::Kind::kUndefined: return false;  // Undefined iterates as empty
    case Value::Kind::kString:
      if (!item.is_string()) {
        Fail(std::string("'in <string>' requires string as left operand, not ") + item.TypeName());
      }
      return c.str().find(item.str()) != std::string::npos;
    case Value::Kind::kArray:
      return std::any_of(c.items().begin(), c.items().end(),
                         [&](const Value& v) { return v.Equals(item); });
    case Value::Kind::kObject:
      if (c.object().is_namespace) break;
      return item.is_string() && c.object().Find(item.str()) != nullptr;
    default: break;
  }
  Fail(std::string("argument of type '") + c.TypeName() + "' is not iterable");
}

std::vector<Value> Iterate(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return {};
    case Value::Kind::kArray: return v.items();
    case Value::Kind::kString: {
      std::vector<Value> out;
      for (char32_t c : DecodeUtf8(v.str())) out.emplace_back(EncodeUtf8(std::u32string(1, c)));
      return out;
    }
    case Value::Kind::kObject: {
      if (v.object().is_namespace) break;
      std::vector<Value> out;
      for (const auto& [k, unused] : v.object().items) out.emplace_back(k);
      return out;
    }
    default: break;
  }
  Fail(std::string("'") + v.TypeName() + "' object is not iterable");
}

int64_t Length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return 0;
    case Value::Kind::kString: return static_cast<int64_t>(DecodeUtf8(v.str()).size());
    case Value::Kind::kArray: return static_cast<int64_t>(v.items().size());
    case Value::Kind::kObject:
      if (v.object().is_namespace) break;
      return static_cast<int64_t>(v.object().items.size());
    default: break;
  }
  Fail(std::string("object of type '") + v.TypeName() + "' has no len()");
}

}  // namespace kdn::text::jinja
