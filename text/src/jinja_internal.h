#pragma once
// The private parts of the Jinja2 interpreter (kdn/text/jinja.h): the parsed
// template (statements and expressions), the evaluator's interface to the
// builtins (filters, tests, methods, globals), and Python's string rules.
//
// Errors inside the interpreter are thrown as TemplateError and turned into a
// Status by Template::Parse and Template::Render, which no exception leaves:
// an evaluator that returned Result from every recursive step would be twice
// as long for nothing a caller could see.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/text/jinja.h"

namespace kdn::text::jinja {

// Thrown while parsing or rendering. `line` 0: the line of what was being
// evaluated. `raised`: a template's raise_exception, whose message is the
// template's own.
struct TemplateError {
  StatusCode code = StatusCode::kInvalidArgument;
  std::string message;
  int line = 0;
  bool raised = false;
};
[[noreturn]] void Fail(std::string message, int line = 0);
[[noreturn]] void FailUnsupported(std::string message, int line = 0);

// --- The parsed template ---------------------------------------------------

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;
using KwargExprs = std::vector<std::pair<std::string, ExprPtr>>;

struct Expr {
  enum class Kind {
    kLiteral,  // literal
    kName,     // name
    kList,     // args: the items
    kTuple,    // args: the items
    kDict,     // args: key, value, key, value...
    kGetAttr,  // args[0].name
    kGetItem,  // args[0][args[1]]
    kSlice,    // args[0][args[1]:args[2]:args[3]], each bound may be null
    kCall,     // args[0](args[1:], kwargs)
    kFilter,   // args[0] | name(args[1:], kwargs); args[0] null in a filter block
    kTest,     // args[0] is [not] name(args[1:])
    kUnary,    // name args[0]: "-", "+", "not"
    kBinary,   // args[0] name args[1]: + - * / // % ** ~
    kAnd,
    kOr,
    kCompare,  // args[0] ops[0] args[1] ops[1] args[2]...: == != < <= > >= in notin
    kCond,     // args[1] if args[0] else args[2] (null: undefined)
  };
  Kind kind;
  int line = 0;
  Value literal;
  std::string name;
  std::vector<ExprPtr> args;
  KwargExprs kwargs;
  std::vector<std::string> ops;
  bool negated = false;
};

struct Stmt;
struct Body {
  std::vector<std::unique_ptr<Stmt>> stmts;
};

struct Stmt {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // branches; a null condition is the else
    kFor,       // for targets in expr [if cond]: body [else: else_body]
    kSet,       // set targets = expr, or set targets[0].attr = expr
    kSetBlock,  // set targets[0] [| expr's filters]: body
    kMacro,     // macro text(params): body
    kBreak,
    kContinue,
    kScope,       // a block rendered in place (transformers' generation)
    kFilterBlock  // filter expr: body
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  std::vector<std::pair<ExprPtr, Body>> branches;
  std::vector<std::string> targets;
  std::string attr;
  ExprPtr cond;
  Body body, else_body;
  KwargExprs params;  // a macro's parameters and their defaults (null: none)
};

enum class Tok {
  kText,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  Tok kind;
  std::string text;  // text, name, operator, a string literal's value
  int line = 0;
  int64_t int_value = 0;
  double float_value = 0;
};

// The tokens of a template whose newlines are normalized: text between tags,
// whitespace control applied, and the tokens inside the tags.
std::vector<Token> Lex(std::string source);

// Parses a template's source (newlines normalized, one trailing newline
// dropped, as jinja2 does). Throws TemplateError.
std::shared_ptr<Body> ParseTemplate(std::string_view source);

// --- Evaluation ------------------------------------------------------------

class Renderer;
using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;

struct Function {
  std::string name;
  std::function<Value(Renderer&, Args&, Kwargs&)> call;
};

using FilterFn = Value (*)(Renderer&, const Value& input, Args& args, Kwargs& kwargs);
using TestFn = bool (*)(Renderer&, const Value& input, Args& args);

// nullptr when there is no such filter or test.
FilterFn FindFilter(std::string_view name);
TestFn FindTest(std::string_view name);
// The globals: raise_exception, namespace, range, dict, strftime_now.
// Undefined when there is no such global.
Value LookupGlobal(const std::string& name);

// jinja2's environment.getattr (`x.name`): an attribute (a method), else an
// item; and getitem (`x[key]`): an item, else an attribute. Both undefined
// when neither is there; both fail on an undefined `obj`. A slice is
// Python's own: it fails on what cannot be sliced.
Value GetAttr(const Value& obj, const std::string& name);
Value GetItem(const Value& obj, const Value& key);
Value GetSlice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// Python's operators. `op` is one of + - * / // % ** ~ for Arithmetic, one of
// == != < <= > >= for Compare.
Value Arithmetic(const std::string& op, const Value& a, const Value& b);
bool Compare(const std::string& op, const Value& a, const Value& b);
bool Contains(const Value& container, const Value& item);  // `item in container`
// The items of a for loop over `v`: a list's items, a dict's keys, a
// string's characters; none for undefined.
std::vector<Value> Iterate(const Value& v);
// Python's len(); undefined has length 0.
int64_t Length(const Value& v);
// Fails with the hint of an undefined value that was used where a value is
// needed.
[[noreturn]] void FailUndefined(const Value& v);

// A call's argument at `index`, or the keyword argument `name`, else `def`.
Value Arg(const Args& args, const Kwargs& kwargs, size_t index, const char* name,
          Value def = Value());
// The argument as a string (a copy: arguments are often temporaries) or an
// integer; fails naming `what` otherwise.
std::string StringArg(const Value& v, const char* what);
int64_t IntArg(const Value& v, const char* what);

// One render of a template: its output, its scopes, where it is. One per
// Template::Render call; not thread-safe.
class Renderer {
 public:
  // Calls a function value (a macro, a global, a method).
  Value Call(const Value& fn, Args& args, Kwargs& kwargs);
  // Runs a macro's body in a scope of its own and returns what it printed.
  Value CallMacro(const Stmt& macro, Args& args, Kwargs& kwargs);
  Value ApplyFilter(const std::string& name, const Value& input, Args& args, Kwargs& kwargs);
  bool ApplyTest(const std::string& name, const Value& input, Args& args);

  std::string Render(const Body& body, const Variables& variables);
  // The line of what is being evaluated, for errors.
  int line() const { return line_; }

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  struct Frame;

  Flow Exec(const Body& body);
  Flow ExecStmt(const Stmt& s);
  Flow ExecFor(const Stmt& s);
  void ExecSet(const Stmt& s, Value v);
  Value Eval(const Expr& e);
  void EvalArgs(const Expr& e, size_t first, Args* args, Kwargs* kwargs);
  Value Lookup(const std::string& name) const;
  void Assign(const std::string& name, Value v);
  std::string Capture(const Body& body);

  std::string* out_ = nullptr;
  std::vector<std::unique_ptr<Frame>> frames_;  // [0]: the template's own
  size_t scope_base_ = 0;  // a macro sees frames_[0] and frames_[scope_base_..]
  int depth_ = 0;          // macro calls in progress
  Value block_input_;      // what a filter block or `set` block captured
  int line_ = 0;
};

// --- Python's strings --------------------------------------------------------

std::u32string DecodeUtf8(std::string_view s);
std::string EncodeUtf8(std::u32string_view s);
void AppendUtf8(char32_t c, std::string* out);
// str.isspace() for one code point.
bool IsPySpace(char32_t c);
// str.strip/lstrip/rstrip(chars); `chars` null: whitespace.
std::string PyStrip(std::string_view s, const std::string* chars, bool left, bool right);
// Python's int and float parsing of a string, as int() and float() take them;
// false when it is not one.
bool ParsePyInt(std::string_view s, int base, int64_t* out);
bool ParsePyFloat(std::string_view s, double* out);
// repr() of a float.
std::string FloatRepr(double d);
// Case: ASCII and Latin-1 letters only (kdn/text/jinja.h).
bool IsCased(char32_t c);
bool IsUpper(char32_t c);
bool IsLower(char32_t c);
char32_t ToUpper(char32_t c);
char32_t ToLower(char32_t c);
std::string MapCase(const std::string& s, char32_t (*f)(char32_t));
std::string Title(const std::string& s);
std::string Capitalize(const std::string& s);
// str.split (from_right: rsplit) with `sep` None or a string; maxsplit < 0:
// no limit.
std::vector<Value> Split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right);
// str.splitlines(): Python's line boundaries, which are dropped.
std::vector<std::string> SplitLines(const std::string& s);
// str.replace; count < 0: all.
std::string Replace(const std::string& s, const std::string& old, const std::string& repl,
                    int64_t count);

}  // namespace kdn::text::jinja
