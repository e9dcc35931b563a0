#include "regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "utf8.h"

namespace kdn::text {

namespace {

// Oniguruma's \s (what `tokenizers` runs) is Unicode's White_Space; PCRE2's
// \s in UCP mode is \p{Z}, \h and \v, which takes U+180E (Mongolian vowel
// separator, no longer a space) too. \s and \S are rewritten to the property
// so the two split text alike. Inside a character class only \s can be (\S
// there is left as it is; no pattern in use has one).
std::string OnigurumaToPcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 16);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char n = p[i + 1];
      ++i;
      if (n == 's') {
        out += "\\p{White_Space}";
      } else if (n == 'S' && !in_class) {
        out += "\\P{White_Space}";
      } else {
        out.push_back('\\');
        out.push_back(n);
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out.push_back(c);
      // A ']' right after '[' or '[^' is a literal member, not the end.
      if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
      if (i + 1 < p.size() && p[i + 1] == ']') out.push_back(p[++i]);
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out.push_back(c);
  }
  return out;
}

pcre2_code* Code(void* p) { return static_cast<pcre2_code*>(p); }

}  // namespace

Result<std::unique_ptr<Regex>> Regex::Compile(std::string_view pattern, bool literal,
                                              const std::string& where) {
  const std::string p = literal ? std::string(pattern) : OnigurumaToPcre2(pattern);
  // (PCRE2 refuses UCP beside LITERAL, which has no classes to apply it to.)
  uint32_t options = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  int err = 0;
  PCRE2_SIZE err_at = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), options, &err,
                                   &err_at, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return InvalidArgument(where + ": the regex \"" + std::string(pattern) +
                           "\" does not compile (" + reinterpret_cast<const char*>(msg) +
                           " at offset " + std::to_string(err_at) + ")");
  }
  // Without JIT (a platform that lacks it) the interpreter gives the same
  // matches, only slower.
  const bool jit = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return std::unique_ptr<Regex>(new Regex(code, jit));
}

Regex::~Regex() { pcre2_code_free(Code(code_)); }

std::vector<std::pair<size_t, size_t>> Regex::FindAll(std::string_view text) const {
  std::vector<std::pair<size_t, size_t>> out;
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(Code(code_), nullptr);
  if (md == nullptr) return out;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t from = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (from <= text.size()) {
    int rc = jit_ ? pcre2_jit_match(Code(code_), subject, text.size(), from, 0, md, nullptr)
                  : PCRE2_ERROR_JIT_STACKLIMIT;
    // The JIT's stack is small; the interpreter keeps its backtracking on the
    // heap and so takes what the JIT cannot.
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      rc = pcre2_match(Code(code_), subject, text.size(), from, 0, md, nullptr);
    }
    if (rc < 0) break;  // no match (or a limit hit: the rest is left unmatched)
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t s = ov[0], e = ov[1];
    if (s == e && have_last && e == last_end) {
      // An empty match just after the previous one: step one character on.
      if (from >= text.size()) break;
      from += CharLength(text, from);
      continue;
    }
    out.emplace_back(s, e);
    have_last = true;
    last_end = e;
    from = e;
    if (s == e) {
      if (from >= text.size()) break;
      from += CharLength(text, from);
    }
  }
  pcre2_match_data_free(md);
  return out;
}

}  // namespace kdn::text
