// The Jinja2 evaluator (kdn/text/jinja.h): statements, expressions, scopes.
// Scopes follow jinja2's: a for loop and a macro have their own, `if` does
// not, and a loop's variables last across its iterations.
#include <unordered_map>

#include "jinja_internal.h"

namespace kdn::text::jinja {

namespace {

// Deep enough for any template's own recursion, shallow enough that a macro
// calling itself forever fails before the stack does.
constexpr int kMaxMacroDepth = 200;

}  // namespace

struct Renderer::Frame {
  std::unordered_map<std::string, Value> vars;
};

std::string Renderer::Render(const Body& body, const Variables& variables) {
  frames_.push_back(std::make_unique<Frame>());
  for (const auto& [name, value] : variables) frames_[0]->vars[name] = value;
  std::string out;
  out_ = &out;
  Exec(body);
  return out;
}

Value Renderer::Lookup(const std::string& name) const {
  for (size_t i = frames_.size(); i-- > scope_base_;) {
    auto it = frames_[i]->vars.find(name);
    if (it != frames_[i]->vars.end()) return it->second;
  }
  if (scope_base_ > 0) {
    auto it = frames_[0]->vars.find(name);
    if (it != frames_[0]->vars.end()) return it->second;
  }
  Value g = LookupGlobal(name);
  if (!g.is_undefined()) return g;
  return Value::Undefined("'" + name + "' is undefined");
}

void Renderer::Assign(const std::string& name, Value v) {
  frames_.back()->vars[name] = std::move(v);
}

std::string Renderer::Capture(const Body& body) {
  std::string captured;
  std::string* saved = out_;
  out_ = &captured;
  Exec(body);
  out_ = saved;
  return captured;
}

Renderer::Flow Renderer::Exec(const Body& body) {
  for (const auto& s : body.stmts) {
    const Flow f = ExecStmt(*s);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

Renderer::Flow Renderer::ExecStmt(const Stmt& s) {
  line_ = s.line;
  switch (s.kind) {
    case Stmt::Kind::kText: *out_ += s.text; break;
    case Stmt::Kind::kOutput: *out_ += Eval(*s.expr).ToString(); break;
    case Stmt::Kind::kIf:
      for (const auto& [cond, body] : s.branches) {
        if (cond == nullptr || Eval(*cond).Truthy()) return Exec(body);
      }
      break;
    case Stmt::Kind::kFor: return ExecFor(s);
    case Stmt::Kind::kSet: ExecSet(s, Eval(*s.expr)); break;
    case Stmt::Kind::kSetBlock: {
      Value v = Capture(s.body);
      if (s.expr) {
        block_input_ = std::move(v);
        v = Eval(*s.expr);
      }
      ExecSet(s, std::move(v));
      break;
    }
    case Stmt::Kind::kMacro: {
      auto fn = std::make_shared<Function>();
      fn->name = s.text;
      const Stmt* macro = &s;  // the template outlives its renders
      fn->call = [macro](Renderer& r, Args& args, Kwargs& kwargs) {
        return r.CallMacro(*macro, args, kwargs);
      };
      Assign(s.text, Value::Callable(std::move(fn)));
      break;
    }
    case Stmt::Kind::kBreak: return Flow::kBreak;
    case Stmt::Kind::kContinue: return Flow::kContinue;
    case Stmt::Kind::kScope: {
      frames_.push_back(std::make_unique<Frame>());
      const Flow f = Exec(s.body);
      frames_.pop_back();
      return f;
    }
    case Stmt::Kind::kFilterBlock:
      block_input_ = Value(Capture(s.body));
      *out_ += Eval(*s.expr).ToString();
      break;
  }
  return Flow::kNormal;
}

Renderer::Flow Renderer::ExecFor(const Stmt& s) {
  std::vector<Value> items = Iterate(Eval(*s.expr));
  frames_.push_back(std::make_unique<Frame>());
  auto bind = [&](const Value& item) {
    if (s.targets.size() == 1) {
      Assign(s.targets[0], item);
      return;
    }
    if (!item.is_array() && !item.is_string()) {
      Fail(std::string("cannot unpack non-iterable ") + item.TypeName() + " object", s.line);
    }
    const std::vector<Value> parts = Iterate(item);
    if (parts.size() != s.targets.size()) {
      Fail(parts.size() < s.targets.size()
               ? "not enough values to unpack (expected " + std::to_string(s.targets.size()) +
                     ", got " + std::to_string(parts.size()) + ")"
               : "too many values to unpack (expected " + std::to_string(s.targets.size()) + ")",
           s.line);
    }
    for (size_t i = 0; i < parts.size(); ++i) Assign(s.targets[i], parts[i]);
  };
  if (s.cond) {
    // The loop counts only the items the filter keeps.
    std::vector<Value> kept;
    for (Value& item : items) {
      bind(item);
      if (Eval(*s.cond).Truthy()) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  const int64_t n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    bind(items[i]);
    Value loop = Value::Object({{"index", Value(i + 1)},
                                {"index0", Value(i)},
                                {"revindex", Value(n - i)},
                                {"revindex0", Value(n - i - 1)},
                                {"first", Value(i == 0)},
                                {"last", Value(i == n - 1)},
                                {"length", Value(n)},
                                {"depth", Value(1)},
                                {"depth0", Value(0)}});
    if (i > 0) loop.object().Set("previtem", items[i - 1]);
    if (i + 1 < n) loop.object().Set("nextitem", items[i + 1]);
    auto cycle = std::make_shared<Function>();
    cycle->name = "cycle";
    cycle->call = [i](Renderer&, Args& args, Kwargs&) {
      if (args.empty()) Fail("no items for cycling given");
      return args[static_cast<size_t>(i) % args.size()];
    };
    loop.object().Set("cycle", Value::Callable(std::move(cycle)));
    Assign("loop", std::move(loop));
    line_ = s.line;
    if (Exec(s.body) == Flow::kBreak) break;
  }
  if (n == 0) Exec(s.else_body);
  frames_.pop_back();
  return Flow::kNormal;
}

void Renderer::ExecSet(const Stmt& s, Value v) {
  if (!s.attr.empty()) {
    Value ns = Lookup(s.targets[0]);
    if (!ns.is_object() || !ns.object().is_namespace) {
      Fail("cannot assign attribute on non-namespace object", s.line);
    }
    ns.object().Set(s.attr, std::move(v));
    return;
  }
  if (s.targets.size() == 1) {
    Assign(s.targets[0], std::move(v));
    return;
  }
  const std::vector<Value> parts = Iterate(v);
  if (parts.size() != s.targets.size()) {
    Fail("cannot unpack " + std::to_string(parts.size()) + " values into " +
             std::to_string(s.targets.size()) + " names",
         s.line);
  }
  for (size_t i = 0; i < parts.size(); ++i) Assign(s.targets[i], parts[i]);
}

void Renderer::EvalArgs(const Expr& e, size_t first, Args* args, Kwargs* kwargs) {
  for (size_t i = first; i < e.args.size(); ++i) args->push_back(Eval(*e.args[i]));
  for (const auto& [k, v] : e.kwargs) kwargs->emplace_back(k, Eval(*v));
}

Value Renderer::Eval(const Expr& e) {
  line_ = e.line;
  switch (e.kind) {
    case Expr::Kind::kLiteral: return e.literal;
    case Expr::Kind::kName: return Lookup(e.name);
    case Expr::Kind::kList:
    case Expr::Kind::kTuple: {
      std::vector<Value> items;
      for (const auto& a : e.args) items.push_back(Eval(*a));
      return Value::Array(std::move(items), e.kind == Expr::Kind::kTuple);
    }
    case Expr::Kind::kDict: {
      Value d = Value::Object();
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        Value k = Eval(*e.args[i]);
        if (!k.is_string())
          FailUnsupported("dict keys other than strings are not supported", e.line);
        d.object().Set(k.str(), Eval(*e.args[i + 1]));
      }
      return d;
    }
    case Expr::Kind::kGetAttr: {
      Value obj = Eval(*e.args[0]);
      line_ = e.line;
      return GetAttr(obj, e.name);
    }
    case Expr::Kind::kGetItem: {
      Value obj = Eval(*e.args[0]);
      Value key = Eval(*e.args[1]);
      line_ = e.line;
      return GetItem(obj, key);
    }
    case Expr::Kind::kSlice: {
      Value obj = Eval(*e.args[0]);
      Value bounds[3];
      for (int i = 0; i < 3; ++i) bounds[i] = e.args[i + 1] ? Eval(*e.args[i + 1]) : Value::None();
      line_ = e.line;
      return GetSlice(obj, bounds[0], bounds[1], bounds[2]);
    }
    case Expr::Kind::kCall: {
      Value fn = Eval(*e.args[0]);
      Args args;
      Kwargs kwargs;
      EvalArgs(e, 1, &args, &kwargs);
      line_ = e.line;
      return Call(fn, args, kwargs);
    }
    case Expr::Kind::kFilter: {
      Value input = e.args[0] ? Eval(*e.args[0]) : block_input_;
      Args args;
      Kwargs kwargs;
      EvalArgs(e, 1, &args, &kwargs);
      line_ = e.line;
      return ApplyFilter(e.name, input, args, kwargs);
    }
    case Expr::Kind::kTest: {
      Value input = Eval(*e.args[0]);
      Args args;
      Kwargs unused;
      EvalArgs(e, 1, &args, &unused);
      line_ = e.line;
      return ApplyTest(e.name, input, args) != e.negated;
    }
    case Expr::Kind::kUnary: {
      Value v = Eval(*e.args[0]);
      if (e.name == "not") return !v.Truthy();
      if (v.is_undefined()) FailUndefined(v);
      if (!v.is_number())
        Fail("bad operand type for unary " + e.name + ": '" + v.TypeName() + "'", e.line);
      if (e.name == "+") return v.kind() == Value::Kind::kFloat ? v : Value(v.int_value());
      if (v.kind() == Value::Kind::kFloat) return Value(-v.float_value());
      return Arithmetic("-", Value(0), v);
    }
    case Expr::Kind::kBinary: {
      Value a = Eval(*e.args[0]);
      Value b = Eval(*e.args[1]);
      line_ = e.line;
      return Arithmetic(e.name, a, b);
    }
    case Expr::Kind::kAnd: {
      Value a = Eval(*e.args[0]);
      return a.Truthy() ? Eval(*e.args[1]) : a;
    }
    case Expr::Kind::kOr: {
      Value a = Eval(*e.args[0]);
      return a.Truthy() ? a : Eval(*e.args[1]);
    }
    case Expr::Kind::kCompare: {
      Value left = Eval(*e.args[0]);
      for (size_t i = 0; i < e.ops.size(); ++i) {
        Value right = Eval(*e.args[i + 1]);
        line_ = e.line;
        const std::string& op = e.ops[i];
        const bool ok = op == "in"      ? Contains(right, left)
                        : op == "notin" ? !Contains(right, left)
                                        : Compare(op, left, right);
        if (!ok) return false;
        left = std::move(right);
      }
      return true;
    }
    case Expr::Kind::kCond:
      if (Eval(*e.args[0]).Truthy()) return Eval(*e.args[1]);
      if (e.args[2]) return Eval(*e.args[2]);
      return Value::Undefined("the inline if-expression on line " + std::to_string(e.line) +
                              " evaluated to false and no else section was defined.");
  }
  return Value();
}

Value Renderer::Call(const Value& fn, Args& args, Kwargs& kwargs) {
  if (fn.is_undefined()) FailUndefined(fn);
  if (fn.kind() != Value::Kind::kFunction)
    Fail(std::string("'") + fn.TypeName() + "' object is not callable");
  return fn.function()->call(*this, args, kwargs);
}

Value Renderer::CallMacro(const Stmt& macro, Args& args, Kwargs& kwargs) {
  if (args.size() > macro.params.size()) {
    Fail("macro '" + macro.text + "' takes not more than " + std::to_string(macro.params.size()) +
         " argument(s)");
  }
  for (const auto& [k, v] : kwargs) {
    bool known = false;
    for (const auto& p : macro.params) known = known || p.first == k;
    if (!known) Fail("macro '" + macro.text + "' takes no keyword argument '" + k + "'");
  }
  if (depth_ >= kMaxMacroDepth)
    Fail("macro calls nested over " + std::to_string(kMaxMacroDepth) + " deep");
  const size_t saved_base = scope_base_;
  const int saved_line = line_;
  ++depth_;
  frames_.push_back(std::make_unique<Frame>());
  scope_base_ = frames_.size() - 1;
  for (size_t i = 0; i < macro.params.size(); ++i) {
    const auto& [name, def] = macro.params[i];
    Value v;
    bool given = i < args.size();
    if (given) v = args[i];
    for (const auto& [k, kv] : kwargs) {
      if (k == name) {
        v = kv;
        given = true;
      }
    }
    if (!given)
      v = def ? Eval(*def) : Value::Undefined("parameter '" + name + "' was not provided");
    Assign(name, std::move(v));
  }
  std::string out = Capture(macro.body);
  frames_.pop_back();
  scope_base_ = saved_base;
  --depth_;
  line_ = saved_line;
  return Value(std::move(out));
}

// --- Template --------------------------------------------------------------------

namespace {

Status ToStatus(const TemplateError& e, const std::string& name, int line) {
  if (e.raised) return InvalidArgument(e.message);
  return Status(e.code,
                name + ", line " + std::to_string(e.line ? e.line : line) + ": " + e.message);
}

}  // namespace

Result<Template> Template::Parse(std::string_view source, std::string name) {
  try {
    return Template(ParseTemplate(source), name);
  } catch (const TemplateError& e) {
    return ToStatus(e, name, 0);
  } catch (const std::exception& e) {  // bad_alloc, or a bug: never past the library
    return Internal(name + ": " + e.what());
  }
}

Result<std::string> Template::Render(const Variables& variables) const {
  Renderer r;
  try {
    return r.Render(*body_, variables);
  } catch (const TemplateError& e) {
    return ToStatus(e, name_, r.line());
  } catch (const std::exception& e) {
    return Internal(name_ + ", line " + std::to_string(r.line()) + ": " + e.what());
  }
}

}  // namespace kdn::text::jinja
