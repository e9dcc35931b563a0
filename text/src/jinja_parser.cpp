// The Jinja2 parser (kdn/text/jinja.h), after jinja2's parser.py: the same
// statements and the same operator precedence.
#include <set>

#include "jinja_internal.h"

namespace kdn::text::jinja {

namespace {

std::string Describe(const Token& t) {
  switch (t.kind) {
    case Tok::kVarEnd: return "end of print statement";
    case Tok::kBlockEnd: return "end of statement block";
    case Tok::kEof: return "end of template";
    case Tok::kString: return "string";
    default: return t.text;
  }
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  std::shared_ptr<Body> Run() {
    auto body = std::make_shared<Body>();
    std::string end;
    *body = ParseBody({}, &end, "", 0);
    return body;
  }

 private:
  const Token& Peek(size_t ahead = 0) const { return t_[std::min(i_ + ahead, t_.size() - 1)]; }
  const Token& Next() {
    const Token& t = t_[i_];
    if (i_ + 1 < t_.size()) ++i_;
    return t;
  }
  bool IsOp(const char* op, size_t ahead = 0) const {
    return Peek(ahead).kind == Tok::kOp && Peek(ahead).text == op;
  }
  bool IsName(const char* name, size_t ahead = 0) const {
    return Peek(ahead).kind == Tok::kName && Peek(ahead).text == name;
  }
  bool SkipOp(const char* op) {
    if (!IsOp(op)) return false;
    Next();
    return true;
  }
  bool SkipName(const char* name) {
    if (!IsName(name)) return false;
    Next();
    return true;
  }
  [[noreturn]] void Unexpected(const std::string& expected) {
    Fail("expected " + expected + ", got '" + Describe(Peek()) + "'", Peek().line);
  }
  void ExpectOp(const char* op) {
    if (!SkipOp(op)) Unexpected(std::string("'") + op + "'");
  }
  void ExpectEnd(Tok kind) {
    if (Peek().kind != kind) {
      Unexpected(kind == Tok::kBlockEnd ? "'end of statement block'" : "'end of print statement'");
    }
    Next();
  }
  std::string ExpectName() {
    if (Peek().kind != Tok::kName) Unexpected("a name");
    return Next().text;
  }

  ExprPtr Node(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // Statements up to a `{% name` with name in `ends` (consumed; the rest of
  // that tag is the caller's), returned in `*end`. `opener` names the block
  // for the error when the template ends first.
  Body ParseBody(const std::set<std::string>& ends, std::string* end, const std::string& opener,
                 int opener_line) {
    Body body;
    for (;;) {
      const Token& t = Peek();
      if (t.kind == Tok::kEof) {
        if (ends.empty()) return body;
        std::string want;
        for (const auto& e : ends) want += (want.empty() ? "'" : " or '") + e + "'";
        Fail("unexpected end of template: the '" + opener + "' of line " +
                 std::to_string(opener_line) + " is not closed (looking for " + want + ")",
             t.line);
      }
      if (t.kind == Tok::kText) {
        auto s = NewStmt(Stmt::Kind::kText, t.line);
        s->text = Next().text;
        body.stmts.push_back(std::move(s));
      } else if (t.kind == Tok::kVarBegin) {
        auto s = NewStmt(Stmt::Kind::kOutput, Next().line);
        s->expr = ParseTuple(true, false);
        ExpectEnd(Tok::kVarEnd);
        FailUnknown();
        body.stmts.push_back(std::move(s));
      } else if (t.kind == Tok::kBlockBegin) {
        Next();
        if (Peek().kind != Tok::kName) Unexpected("a tag name");
        if (ends.count(Peek().text)) {
          *end = Next().text;
          return body;
        }
        body.stmts.push_back(ParseStatement());
        FailUnknown();
      } else {
        Fail("unexpected '" + Describe(t) + "'", t.line);
      }
    }
  }

  // The body of a block with a scope of its own (for, macro, set, filter):
  // not soft, even inside an `if`, as in jinja2.
  Body Inner(const std::set<std::string>& ends, std::string* end, const std::string& opener,
             int opener_line) {
    const bool soft = soft_;
    soft_ = false;
    Body body = ParseBody(ends, end, opener, opener_line);
    soft_ = soft;
    return body;
  }

  // A filter or test that does not exist: an error when the statement is
  // parsed, unless it is inside an `if` or a conditional expression, where
  // jinja2 lets a template use one that only some environments define and
  // fails only if it is applied.
  void Unknown(std::string message, int line) {
    if (!soft_) unknown_.emplace_back(std::move(message), line);
  }
  void FailUnknown() {
    if (!unknown_.empty()) Fail(unknown_[0].first, unknown_[0].second);
  }

  std::unique_ptr<Stmt> NewStmt(Stmt::Kind kind, int line) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = line;
    return s;
  }

  std::unique_ptr<Stmt> ParseStatement() {
    const Token& tag = Next();
    const int line = tag.line;
    const std::string name = tag.text;
    std::string end;
    if (name == "if") {
      const bool soft = soft_;
      soft_ = true;
      auto s = NewStmt(Stmt::Kind::kIf, line);
      ExprPtr cond = ParseTuple(false, false);
      for (;;) {
        ExpectEnd(Tok::kBlockEnd);
        Body b = ParseBody({"elif", "else", "endif"}, &end, "if", line);
        s->branches.emplace_back(std::move(cond), std::move(b));
        if (end == "endif") break;
        if (end == "else") {
          ExpectEnd(Tok::kBlockEnd);
          s->branches.emplace_back(nullptr, ParseBody({"endif"}, &end, "if", line));
          break;
        }
        cond = ParseTuple(false, false);
      }
      ExpectEnd(Tok::kBlockEnd);
      soft_ = soft;
      return s;
    }
    if (name == "for") {
      auto s = NewStmt(Stmt::Kind::kFor, line);
      do {
        s->targets.push_back(ExpectName());
      } while (SkipOp(","));
      if (!SkipName("in")) Unexpected("'in'");
      s->expr = ParseTuple(false, false);
      if (SkipName("if")) s->cond = ParseExpression(true);
      if (IsName("recursive")) FailUnsupported("recursive for loops are not supported", line);
      ExpectEnd(Tok::kBlockEnd);
      ++loops_;
      s->body = Inner({"else", "endfor"}, &end, "for", line);
      --loops_;
      if (end == "else") {
        ExpectEnd(Tok::kBlockEnd);
        s->else_body = Inner({"endfor"}, &end, "for", line);
      }
      ExpectEnd(Tok::kBlockEnd);
      return s;
    }
    if (name == "set") {
      auto s = NewStmt(Stmt::Kind::kSet, line);
      s->targets.push_back(ExpectName());
      if (SkipOp(".")) {
        s->attr = ExpectName();
      } else {
        while (SkipOp(",")) s->targets.push_back(ExpectName());
      }
      if (SkipOp("=")) {
        s->expr = ParseTuple(true, false);
        ExpectEnd(Tok::kBlockEnd);
        return s;
      }
      if (!s->attr.empty() || s->targets.size() > 1) Unexpected("'='");
      s->kind = Stmt::Kind::kSetBlock;
      if (IsOp("|")) s->expr = ParseFilterExpr(nullptr);
      ExpectEnd(Tok::kBlockEnd);
      s->body = Inner({"endset"}, &end, "set", line);
      ExpectEnd(Tok::kBlockEnd);
      return s;
    }
    if (name == "macro") {
      auto s = NewStmt(Stmt::Kind::kMacro, line);
      s->text = ExpectName();
      ExpectOp("(");
      while (!SkipOp(")")) {
        if (!s->params.empty()) ExpectOp(",");
        if (SkipOp(")")) break;
        std::string param = ExpectName();
        ExprPtr def;
        if (SkipOp("=")) def = ParseExpression(true);
        s->params.emplace_back(std::move(param), std::move(def));
      }
      ExpectEnd(Tok::kBlockEnd);
      const int loops = loops_;
      loops_ = 0;  // a loop outside a macro is not one its body can leave
      s->body = Inner({"endmacro"}, &end, "macro", line);
      loops_ = loops;
      ExpectEnd(Tok::kBlockEnd);
      return s;
    }
    if (name == "break" || name == "continue") {
      if (loops_ == 0) Fail("Tried to leave a loop outside of a loop", line);
      ExpectEnd(Tok::kBlockEnd);
      return NewStmt(name == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue, line);
    }
    if (name == "generation") {
      auto s = NewStmt(Stmt::Kind::kScope, line);
      ExpectEnd(Tok::kBlockEnd);
      s->body = Inner({"endgeneration"}, &end, "generation", line);
      ExpectEnd(Tok::kBlockEnd);
      return s;
    }
    if (name == "filter") {
      auto s = NewStmt(Stmt::Kind::kFilterBlock, line);
      s->expr = ParseFilter(nullptr);
      s->expr = ParseFilterExpr(std::move(s->expr));
      ExpectEnd(Tok::kBlockEnd);
      s->body = Inner({"endfilter"}, &end, "filter", line);
      ExpectEnd(Tok::kBlockEnd);
      return s;
    }
    static const std::set<std::string> kUnsupported = {
        "call", "with", "raw", "include", "import", "from", "extends", "block", "do", "autoescape"};
    if (kUnsupported.count(name)) {
      FailUnsupported("the '" + name + "' tag is not supported by kdn's Jinja", line);
    }
    Fail("Encountered unknown tag '" + name + "'.", line);
  }

  // Expressions separated by commas: a tuple when there is a comma.
  ExprPtr ParseTuple(bool with_condexpr, bool explicit_parens) {
    const int line = Peek().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    for (;;) {
      if (!items.empty()) ExpectOp(",");
      const Token& t = Peek();
      if (t.kind == Tok::kVarEnd || t.kind == Tok::kBlockEnd || IsOp(")")) break;
      items.push_back(ParseExpression(with_condexpr));
      if (IsOp(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) Unexpected("an expression");
    }
    auto e = Node(Expr::Kind::kTuple, line);
    e->args = std::move(items);
    return e;
  }

  ExprPtr ParseExpression(bool with_condexpr) {
    if (!with_condexpr) return ParseOr();
    const size_t unknown = unknown_.size();
    ExprPtr e = ParseOr();
    const bool soft = soft_;
    if (IsName("if")) {
      unknown_.resize(unknown);  // the whole conditional expression is soft
      soft_ = true;
    }
    while (IsName("if")) {
      const int line = Next().line;
      auto c = Node(Expr::Kind::kCond, line);
      ExprPtr cond = ParseOr();
      ExprPtr other = SkipName("else") ? ParseExpression(true) : nullptr;
      c->args.push_back(std::move(cond));
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(other));
      e = std::move(c);
    }
    soft_ = soft;
    return e;
  }

  ExprPtr Binary(Expr::Kind kind, std::string op, ExprPtr a, ExprPtr b, int line) {
    auto e = Node(kind, line);
    e->name = std::move(op);
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }

  ExprPtr ParseOr() {
    ExprPtr e = ParseAnd();
    while (IsName("or")) {
      const int line = Next().line;
      e = Binary(Expr::Kind::kOr, "or", std::move(e), ParseAnd(), line);
    }
    return e;
  }

  ExprPtr ParseAnd() {
    ExprPtr e = ParseNot();
    while (IsName("and")) {
      const int line = Next().line;
      e = Binary(Expr::Kind::kAnd, "and", std::move(e), ParseNot(), line);
    }
    return e;
  }

  ExprPtr ParseNot() {
    if (IsName("not")) {
      auto e = Node(Expr::Kind::kUnary, Next().line);
      e->name = "not";
      e->args.push_back(ParseNot());
      return e;
    }
    return ParseCompare();
  }

  ExprPtr ParseCompare() {
    const int line = Peek().line;
    ExprPtr first = ParseMath1();
    auto e = Node(Expr::Kind::kCompare, line);
    for (;;) {
      const Token& t = Peek();
      if (t.kind == Tok::kOp && (t.text == "==" || t.text == "!=" || t.text == "<" ||
                                 t.text == "<=" || t.text == ">" || t.text == ">=")) {
        e->ops.push_back(Next().text);
      } else if (SkipName("in")) {
        e->ops.push_back("in");
      } else if (IsName("not") && IsName("in", 1)) {
        Next();
        Next();
        e->ops.push_back("notin");
      } else {
        break;
      }
      if (e->args.empty()) e->args.push_back(std::move(first));
      e->args.push_back(ParseMath1());
    }
    return e->ops.empty() ? std::move(first) : std::move(e);
  }

  ExprPtr ParseMath1() {
    ExprPtr e = ParseConcat();
    while (IsOp("+") || IsOp("-")) {
      const Token& op = Next();
      e = Binary(Expr::Kind::kBinary, op.text, std::move(e), ParseConcat(), op.line);
    }
    return e;
  }

  ExprPtr ParseConcat() {
    ExprPtr e = ParseMath2();
    while (IsOp("~")) {
      const int line = Next().line;
      e = Binary(Expr::Kind::kBinary, "~", std::move(e), ParseMath2(), line);
    }
    return e;
  }

  ExprPtr ParseMath2() {
    ExprPtr e = ParsePow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const Token& op = Next();
      e = Binary(Expr::Kind::kBinary, op.text, std::move(e), ParsePow(), op.line);
    }
    return e;
  }

  ExprPtr ParsePow() {
    ExprPtr e = ParseUnary(true);
    while (IsOp("**")) {
      const int line = Next().line;
      e = Binary(Expr::Kind::kBinary, "**", std::move(e), ParseUnary(true), line);
    }
    return e;
  }

  // jinja2 applies postfix operators and filters after a sign: `-x|abs` is
  // abs(-x).
  ExprPtr ParseUnary(bool with_filter) {
    ExprPtr e;
    if (IsOp("-") || IsOp("+")) {
      const Token& op = Next();
      e = Node(Expr::Kind::kUnary, op.line);
      e->name = op.text;
      e->args.push_back(ParseUnary(false));
    } else {
      e = ParsePrimary();
    }
    e = ParsePostfix(std::move(e));
    return with_filter ? ParseFilterExpr(std::move(e)) : std::move(e);
  }

  ExprPtr Literal(Value v, int line) {
    auto e = Node(Expr::Kind::kLiteral, line);
    e->literal = std::move(v);
    return e;
  }

  ExprPtr ParsePrimary() {
    const Token& t = Peek();
    const int line = t.line;
    switch (t.kind) {
      case Tok::kName: {
        const std::string name = Next().text;
        if (name == "true" || name == "True") return Literal(true, line);
        if (name == "false" || name == "False") return Literal(false, line);
        if (name == "none" || name == "None") return Literal(Value::None(), line);
        auto e = Node(Expr::Kind::kName, line);
        e->name = name;
        return e;
      }
      case Tok::kString: {
        std::string s;
        while (Peek().kind == Tok::kString) s += Next().text;
        return Literal(Value(std::move(s)), line);
      }
      case Tok::kInt: return Literal(Value(Next().int_value), line);
      case Tok::kFloat: return Literal(Value(Next().float_value), line);
      default: break;
    }
    if (SkipOp("(")) {
      ExprPtr e = ParseTuple(true, true);
      ExpectOp(")");
      return e;
    }
    if (SkipOp("[")) {
      auto e = Node(Expr::Kind::kList, line);
      while (!SkipOp("]")) {
        if (!e->args.empty()) ExpectOp(",");
        if (SkipOp("]")) break;
        e->args.push_back(ParseExpression(true));
      }
      return e;
    }
    if (SkipOp("{")) {
      auto e = Node(Expr::Kind::kDict, line);
      while (!SkipOp("}")) {
        if (!e->args.empty()) ExpectOp(",");
        if (SkipOp("}")) break;
        e->args.push_back(ParseExpression(true));
        ExpectOp(":");
        e->args.push_back(ParseExpression(true));
      }
      return e;
    }
    Unexpected("an expression");
  }

  ExprPtr ParsePostfix(ExprPtr e) {
    for (;;) {
      const int line = Peek().line;
      if (SkipOp(".")) {
        if (Peek().kind == Tok::kInt) {
          auto g = Node(Expr::Kind::kGetItem, line);
          g->args.push_back(std::move(e));
          g->args.push_back(Literal(Value(Next().int_value), line));
          e = std::move(g);
        } else {
          auto g = Node(Expr::Kind::kGetAttr, line);
          g->name = ExpectName();
          g->args.push_back(std::move(e));
          e = std::move(g);
        }
      } else if (SkipOp("[")) {
        e = ParseSubscript(std::move(e), line);
      } else if (IsOp("(")) {
        e = ParseCall(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr ParseSubscript(ExprPtr obj, int line) {
    ExprPtr bounds[3];
    bool slice = false;
    if (!IsOp(":")) bounds[0] = ParseExpression(true);
    if (SkipOp(":")) {
      slice = true;
      if (!IsOp("]") && !IsOp(":")) bounds[1] = ParseExpression(true);
      if (SkipOp(":") && !IsOp("]")) bounds[2] = ParseExpression(true);
    }
    ExpectOp("]");
    auto e = Node(slice ? Expr::Kind::kSlice : Expr::Kind::kGetItem, line);
    e->args.push_back(std::move(obj));
    e->args.push_back(std::move(bounds[0]));
    if (slice) {
      e->args.push_back(std::move(bounds[1]));
      e->args.push_back(std::move(bounds[2]));
    }
    return e;
  }

  // `(a, b, k=v)` into e->args (after what is already there) and e->kwargs.
  void ParseCallArgs(Expr* e) {
    ExpectOp("(");
    bool first = true;
    while (!SkipOp(")")) {
      if (!first) ExpectOp(",");
      first = false;
      if (SkipOp(")")) break;
      if (IsOp("*") || IsOp("**"))
        FailUnsupported("*args and **kwargs in calls are not supported", Peek().line);
      if (Peek().kind == Tok::kName && IsOp("=", 1)) {
        std::string key = Next().text;
        Next();
        e->kwargs.emplace_back(std::move(key), ParseExpression(true));
      } else {
        if (!e->kwargs.empty())
          Fail("a positional argument follows keyword arguments", Peek().line);
        e->args.push_back(ParseExpression(true));
      }
    }
  }

  ExprPtr ParseCall(ExprPtr callee) {
    auto e = Node(Expr::Kind::kCall, Peek().line);
    e->args.push_back(std::move(callee));
    ParseCallArgs(e.get());
    return e;
  }

  std::string DottedName() {
    std::string name = ExpectName();
    while (IsOp(".") && Peek(1).kind == Tok::kName) {
      Next();
      name += "." + Next().text;
    }
    return name;
  }

  // One filter (after the `|`) applied to `input`.
  ExprPtr ParseFilter(ExprPtr input) {
    auto e = Node(Expr::Kind::kFilter, Peek().line);
    e->name = DottedName();
    if (FindFilter(e->name) == nullptr) Unknown("No filter named '" + e->name + "'.", e->line);
    e->args.push_back(std::move(input));
    if (IsOp("(")) ParseCallArgs(e.get());
    return e;
  }

  ExprPtr ParseFilterExpr(ExprPtr e) {
    for (;;) {
      if (SkipOp("|")) {
        e = ParseFilter(std::move(e));
      } else if (IsName("is")) {
        e = ParseTest(std::move(e));
      } else if (IsOp("(")) {
        e = ParseCall(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr ParseTest(ExprPtr input) {
    auto e = Node(Expr::Kind::kTest, Next().line);
    e->negated = SkipName("not");
    e->name = DottedName();
    if (FindTest(e->name) == nullptr) Unknown("No test named '" + e->name + "'.", e->line);
    e->args.push_back(std::move(input));
    const Token& t = Peek();
    if (IsOp("(")) {
      ParseCallArgs(e.get());
      if (!e->kwargs.empty())
        FailUnsupported("keyword arguments to tests are not supported", e->line);
    } else if ((t.kind == Tok::kName || t.kind == Tok::kString || t.kind == Tok::kInt ||
                t.kind == Tok::kFloat || IsOp("[") || IsOp("{")) &&
               !IsName("else") && !IsName("or") && !IsName("and")) {
      if (IsName("is")) Fail("You cannot chain multiple tests with is", t.line);
      e->args.push_back(ParsePostfix(ParsePrimary()));
    }
    return e;
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int loops_ = 0;      // for loops around what is being parsed (within one macro)
  bool soft_ = false;  // inside an `if` or a conditional expression
  std::vector<std::pair<std::string, int>> unknown_;  // filters and tests not soft
};

}  // namespace

std::shared_ptr<Body> ParseTemplate(std::string_view source) {
  // jinja2 turns \r\n and \r into \n and drops one trailing newline
  // (keep_trailing_newline is off).
  std::string s;
  s.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      s += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      s += source[i];
    }
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();
  return Parser(Lex(std::move(s))).Run();
}

}  // namespace kdn::text::jinja
