#pragma once
// A Jinja2 interpreter for the chat templates of Hugging Face model folders
// (docs/serving.md, "Chat"): the subset of Jinja2 that real chat templates
// use, with the environment transformers' apply_chat_template renders them
// in: trim_blocks and lstrip_blocks on, the loopcontrols extension (break,
// continue), the `generation` block of its AssistantTracker (rendered as
// plain text), the globals raise_exception and strftime_now, and its own
// tojson filter (no HTML escaping, ensure_ascii off, keys in insertion order).
//
// Values follow Python's semantics where a template can tell: strings are
// indexed, sliced and measured in code points; undefined values print as
// nothing, are falsy and fail on attribute access as jinja2's default
// Undefined does; integers are 64-bit (an overflow is an error). What is not
// supported: template inheritance and includes, call blocks, `with`, `raw`,
// recursive loops, autoescaping, dict keys other than strings, Python's
// %-formatting of strings and format specs in str.format, and case mapping
// beyond ASCII and Latin-1 (upper, lower, title and capitalize leave other
// letters as they are). Lists print as Python prints them; dict.items() is a
// list, not a dict_items view.
//
// A parsed Template is immutable; Render is const and thread-safe. Values are
// not thread-safe: each render builds its own.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::text::jinja {

class Value;
struct Function;  // a callable: a global, a macro, a bound method (private)
struct Body;      // a parsed template's statements (private)

// Python's list (or tuple: printed with parentheses).
struct ArrayData {
  std::vector<Value> items;
  bool tuple = false;
};

// Python's dict, in insertion order, with string keys (JSON's); or, with
// `is_namespace`, the object jinja2's namespace() makes, whose attributes a
// template may assign.
struct ObjectData {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;

  const Value* Find(std::string_view key) const;
  // Sets `key`, appending it when new.
  void Set(std::string key, Value value);
};

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kArray, kObject, kFunction };

  Value() = default;                                                  // undefined
  Value(bool b) : kind_(Kind::kBool), int_(b) {}                      // NOLINT: implicit by design
  Value(int i) : kind_(Kind::kInt), int_(i) {}                        // NOLINT
  Value(int64_t i) : kind_(Kind::kInt), int_(i) {}                    // NOLINT
  Value(double d) : kind_(Kind::kFloat), float_(d) {}                 // NOLINT
  Value(std::string s) : kind_(Kind::kString), str_(std::move(s)) {}  // NOLINT
  Value(const char* s) : kind_(Kind::kString), str_(s) {}             // NOLINT

  static Value None();
  // An undefined value; `hint` says why, for the error when it is used
  // ("'x' is undefined", "'dict object' has no attribute 'y'").
  static Value Undefined(std::string hint);
  static Value Array(std::vector<Value> items, bool tuple = false);
  static Value Object(std::vector<std::pair<std::string, Value>> items = {});
  static Value Callable(std::shared_ptr<const Function> fn);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }
  // An int or a bool (Python's bool is an int).
  bool is_integral() const { return kind_ == Kind::kInt || kind_ == Kind::kBool; }
  bool is_number() const { return is_integral() || kind_ == Kind::kFloat; }

  // Meaningful for the kind they name only.
  int64_t int_value() const { return int_; }
  double float_value() const { return float_; }
  double AsDouble() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& str() const { return str_; }  // a string, or an undefined's hint
  const std::vector<Value>& items() const { return array_->items; }
  bool is_tuple() const { return array_->tuple; }
  ObjectData& object() const { return *object_; }
  const std::shared_ptr<const Function>& function() const { return function_; }

  // Python's truth value.
  bool Truthy() const;
  // Python's str(): what {{ value }} prints ("" for undefined, "None",
  // "True", ['a', 1], 1.0).
  std::string ToString() const;
  // Python's repr(): strings quoted.
  std::string Repr() const;
  // Python's ==, deep for lists and dicts; undefined equals undefined only.
  bool Equals(const Value& other) const;
  // Whether both are the same object (jinja2's `sameas`).
  bool SameAs(const Value& other) const;
  // Python's type name, for errors: 'str', 'int', 'list', 'dict', 'NoneType'.
  const char* TypeName() const;

 private:
  Kind kind_ = Kind::kUndefined;
  int64_t int_ = 0;  // an int, or a bool as 0 or 1
  double float_ = 0;
  std::string str_;
  std::shared_ptr<ArrayData> array_;
  std::shared_ptr<ObjectData> object_;
  std::shared_ptr<const Function> function_;
};

// The value of a JSON text: objects become dicts (keys in order), arrays
// lists, null None. InvalidArgument when it is not JSON.
Result<Value> ValueFromJson(std::string_view json_text);

// json.dumps(value, ensure_ascii, indent, separators, sort_keys) as Python
// writes it; indent < 0 is None. InvalidArgument for what JSON cannot hold
// (undefined, a function).
Result<std::string> ToJson(const Value& value, int indent = -1, bool ensure_ascii = false,
                           bool sort_keys = false, const std::string* item_separator = nullptr,
                           const std::string* key_separator = nullptr);

// The variables a template is rendered with.
using Variables = std::vector<std::pair<std::string, Value>>;

class Template {
 public:
  // Parses `source`. `name` (a file name) leads the messages of errors,
  // which carry the line: "NAME, line 3: unexpected 'endfor'".
  // InvalidArgument when the template does not parse.
  static Result<Template> Parse(std::string_view source, std::string name = "template");

  // Renders with `variables` over the globals. A template's
  // raise_exception(message) is InvalidArgument with exactly that message;
  // another error while rendering (an undefined value used, a type error) is
  // InvalidArgument "NAME, line N: ..."; an unsupported method or feature met
  // while rendering is Unimplemented.
  Result<std::string> Render(const Variables& variables) const;

  const std::string& name() const { return name_; }

 private:
  Template(std::shared_ptr<const Body> body, std::string name)
      : body_(std::move(body)), name_(std::move(name)) {}

  std::shared_ptr<const Body> body_;
  std::string name_;
};

}  // namespace kdn::text::jinja
