// The Jinja2 lexer (kdn/text/jinja.h), after jinja2's lexer.py: the same
// whitespace rules (trim_blocks, lstrip_blocks, - and +), the same tokens.
#include <cstring>

#include "jinja_internal.h"

namespace kdn::text::jinja {

namespace {

// What Python's \s matches, for whitespace control (the template's own text
// is matched by code point, so a multi-byte space counts too).
size_t SpaceAt(std::string_view s, size_t i) {
  const unsigned char c = s[i];
  if (c < 0x80) return IsPySpace(c) ? 1 : 0;
  char32_t cp = 0;
  size_t len = (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
  if (len == 0 || i + len > s.size()) return 0;
  cp = c & (0xff >> (len + 1));
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (s[i + k] & 0x3f);
  return IsPySpace(cp) ? len : 0;
}

bool AllSpace(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const size_t n = SpaceAt(s, i);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string RStripSpace(std::string_view s) {
  // Whitespace is found scanning forward (UTF-8 cannot be walked back
  // reliably by its first byte alone).
  size_t keep = 0;
  for (size_t i = 0; i < s.size();) {
    const size_t n = SpaceAt(s, i);
    if (n == 0) {
      const unsigned char c = s[i];
      i += c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : 4;
      keep = std::min(i, s.size());
    } else {
      i += n;
    }
  }
  return std::string(s.substr(0, keep));
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// A string literal's body as Python's unicode-escape codec reads it (what
// jinja2 applies); unknown escapes stay as written.
std::string Unescape(std::string_view s, int line) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    const char c = s[++i];
    switch (c) {
      case '\n': break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'v': out += '\v'; break;
      case 'x':
      case 'u':
      case 'U': {
        const size_t digits = c == 'x' ? 2 : c == 'u' ? 4 : 8;
        char32_t cp = 0;
        for (size_t k = 1; k <= digits; ++k) {
          const int h = i + k < s.size() ? HexValue(s[i + k]) : -1;
          if (h < 0) Fail("truncated \\" + std::string(1, c) + " escape in a string", line);
          cp = cp * 16 + h;
        }
        if (cp > 0x10ffff) Fail("illegal Unicode character in a string", line);
        AppendUtf8(cp, &out);
        i += digits;
        break;
      }
      default:
        if (c >= '0' && c <= '7') {
          char32_t cp = 0;
          size_t k = 0;
          for (; k < 3 && i + k < s.size() && s[i + k] >= '0' && s[i + k] <= '7'; ++k) {
            cp = cp * 8 + (s[i + k] - '0');
          }
          AppendUtf8(cp, &out);
          i += k - 1;
        } else {
          out += '\\';
          out += c;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string source) : src_(std::move(source)) {}

  std::vector<Token> Run() {
    bool line_starting = true;
    while (pos_ < src_.size()) {
      size_t start = pos_;
      while ((start = src_.find('{', start)) != std::string::npos) {
        if (start + 1 < src_.size() && std::strchr("{%#", src_[start + 1]) != nullptr) break;
        ++start;
      }
      if (start == std::string::npos) {
        Emit(Tok::kText, src_.substr(pos_));
        break;
      }
      std::string text = src_.substr(pos_, start - pos_);
      const char type = src_[start + 1];
      const char sign =
          start + 2 < src_.size() && (src_[start + 2] == '-' || src_[start + 2] == '+')
              ? src_[start + 2]
              : 0;
      if (sign == '-') {
        text = RStripSpace(text);
      } else if (sign != '+' && type != '{') {  // lstrip_blocks
        size_t l = text.rfind('\n');
        l = l == std::string::npos ? 0 : l + 1;
        if ((l > 0 || line_starting) && AllSpace(std::string_view(text).substr(l))) text.resize(l);
      }
      if (!text.empty()) Emit(Tok::kText, text);
      Advance(start + 2 + (sign ? 1 : 0));
      if (type == '#') {
        line_starting = Comment();
      } else {
        line_starting = Tag(type == '{');
      }
    }
    Emit(Tok::kEof, "");
    return std::move(tokens_);
  }

 private:
  // Moves to `to`, counting the lines passed.
  void Advance(size_t to) {
    for (; pos_ < to; ++pos_) line_ += src_[pos_] == '\n';
  }

  void Emit(Tok kind, std::string text) { tokens_.push_back({kind, std::move(text), line_}); }

  // Whitespace control after a tag: `-` eats all whitespace, trim_blocks one
  // newline. Returns whether what it ate ends a line (lstrip_blocks then
  // applies to the next tag even with no newline before it).
  bool AfterEnd(char sign, bool block) {
    const size_t from = pos_;
    if (sign == '-') {
      size_t p = pos_;
      while (p < src_.size()) {
        const size_t n = SpaceAt(src_, p);
        if (n == 0) break;
        p += n;
      }
      Advance(p);
    } else if (sign != '+' && block && pos_ < src_.size() && src_[pos_] == '\n') {
      Advance(pos_ + 1);
    }
    return pos_ > from && src_[pos_ - 1] == '\n';
  }

  bool Comment() {
    const int line = line_;
    const size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) Fail("Missing end of comment tag", line);
    char sign = 0;
    if (end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+')) sign = src_[end - 1];
    Advance(end + 2);
    return AfterEnd(sign, true);
  }

  bool Tag(bool variable) {
    Emit(variable ? Tok::kVarBegin : Tok::kBlockBegin, "");
    std::vector<char> balance;
    const char* close = variable ? "}}" : "%}";
    for (;;) {
      while (pos_ < src_.size() && IsPySpace(static_cast<unsigned char>(src_[pos_])))
        Advance(pos_ + 1);
      if (pos_ >= src_.size()) {
        Fail(variable ? "unexpected end of template, expected 'end of print statement'"
                      : "unexpected end of template, expected 'end of statement block'",
             line_);
      }
      const std::string_view rest = std::string_view(src_).substr(pos_);
      if (balance.empty()) {
        for (const char sign : {'-', '+', '\0'}) {
          if (sign == '+' && variable) continue;
          const std::string end = sign ? std::string(1, sign) + close : std::string(close);
          if (rest.substr(0, end.size()) == end) {
            Advance(pos_ + end.size());
            Emit(variable ? Tok::kVarEnd : Tok::kBlockEnd, "");
            return AfterEnd(sign, !variable);
          }
        }
      }
      const char c = rest[0];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t n = 1;
        while (n < rest.size() &&
               (std::isalnum(static_cast<unsigned char>(rest[n])) || rest[n] == '_'))
          ++n;
        Emit(Tok::kName, std::string(rest.substr(0, n)));
        Advance(pos_ + n);
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        Number(rest);
      } else if (c == '\'' || c == '"') {
        size_t n = 1;
        while (n < rest.size() && rest[n] != c) n += rest[n] == '\\' ? 2 : 1;
        if (n >= rest.size()) Fail(std::string("unexpected char '") + c + "'", line_);
        Emit(Tok::kString, Unescape(rest.substr(1, n - 1), line_));
        Advance(pos_ + n + 1);
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "/",
                                     "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                     "<",  ">",  "=",  ".",  ":",  "|",  ",", ";"};
        std::string op;
        for (const char* o : kOps) {
          if (rest.substr(0, std::strlen(o)) == o) {
            op = o;
            break;
          }
        }
        if (op.empty()) Fail(std::string("unexpected char '") + c + "'", line_);
        if (op == "(" || op == "[" || op == "{") {
          balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
        } else if (op == ")" || op == "]" || op == "}") {
          if (balance.empty()) Fail("unexpected '" + op + "'", line_);
          if (balance.back() != op[0]) {
            Fail("unexpected '" + op + "', expected '" + std::string(1, balance.back()) + "'",
                 line_);
          }
          balance.pop_back();
        }
        Emit(Tok::kOp, op);
        Advance(pos_ + op.size());
      }
    }
  }

  // An integer or a float; `_` between digits as Python allows. After a dot
  // (`x.0.1`) only integers, as jinja2's float rule's lookbehind says.
  void Number(std::string_view rest) {
    auto digits = [&](size_t i) {
      while (i < rest.size() && (std::isdigit(static_cast<unsigned char>(rest[i])) ||
                                 (rest[i] == '_' && i + 1 < rest.size() &&
                                  std::isdigit(static_cast<unsigned char>(rest[i + 1]))))) {
        ++i;
      }
      return i;
    };
    size_t n = digits(0);
    bool is_float = false;
    const bool after_dot =
        !tokens_.empty() && tokens_.back().kind == Tok::kOp && tokens_.back().text == ".";
    if (!after_dot && n + 1 < rest.size() && rest[n] == '.' &&
        std::isdigit(static_cast<unsigned char>(rest[n + 1]))) {
      n = digits(n + 1);
      is_float = true;
    }
    if (!after_dot && n < rest.size() && (rest[n] == 'e' || rest[n] == 'E')) {
      size_t e = n + 1;
      if (e < rest.size() && (rest[e] == '+' || rest[e] == '-')) ++e;
      if (e < rest.size() && std::isdigit(static_cast<unsigned char>(rest[e]))) {
        n = digits(e);
        is_float = true;
      }
    }
    std::string text;
    for (char ch : rest.substr(0, n)) {
      if (ch != '_') text += ch;
    }
    Token t{is_float ? Tok::kFloat : Tok::kInt, text, line_};
    if (is_float) {
      ParsePyFloat(text, &t.float_value);
    } else if (!ParsePyInt(text, 10, &t.int_value)) {
      Fail("integer literal " + text + " is out of range", line_);
    }
    tokens_.push_back(std::move(t));
    Advance(pos_ + n);
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> Lex(std::string source) { return Lexer(std::move(source)).Run(); }

}  // namespace kdn::text::jinja
