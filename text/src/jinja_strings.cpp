// Python's string rules for the Jinja2 interpreter (kdn/text/jinja.h):
// strings as code points, whitespace, strip, split, case mapping, and the
// parsing and printing of numbers.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "jinja_internal.h"

namespace kdn::text::jinja {

std::u32string DecodeUtf8(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = s[i];
    size_t len = c < 0x80             ? 1
                 : (c & 0xe0) == 0xc0 ? 2
                 : (c & 0xf0) == 0xe0 ? 3
                 : (c & 0xf8) == 0xf0 ? 4
                                      : 0;
    if (len == 0 || i + len > s.size()) {
      out += U'\xfffd';  // not UTF-8: Python would not have the string at all
      ++i;
      continue;
    }
    char32_t cp = len == 1 ? c : c & (0xff >> (len + 1));
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (s[i + k] & 0x3f);
    out += cp;
    i += len;
  }
  return out;
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    *out += static_cast<char>(c);
  } else if (c < 0x800) {
    *out += static_cast<char>(0xc0 | (c >> 6));
    *out += static_cast<char>(0x80 | (c & 0x3f));
  } else if (c < 0x10000) {
    *out += static_cast<char>(0xe0 | (c >> 12));
    *out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
    *out += static_cast<char>(0x80 | (c & 0x3f));
  } else {
    *out += static_cast<char>(0xf0 | (c >> 18));
    *out += static_cast<char>(0x80 | ((c >> 12) & 0x3f));
    *out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
    *out += static_cast<char>(0x80 | (c & 0x3f));
  }
}

std::string EncodeUtf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) AppendUtf8(c, &out);
  return out;
}

bool IsPySpace(char32_t c) {
  // Python's str.isspace(): the ASCII ones, the information separators
  // \x1c-\x1f, and Unicode's spaces.
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

std::string PyStrip(std::string_view s, const std::string* chars, bool left, bool right) {
  const std::u32string u = DecodeUtf8(s);
  const std::u32string set = chars ? DecodeUtf8(*chars) : std::u32string();
  auto strip = [&](char32_t c) {
    return chars ? set.find(c) != std::u32string::npos : IsPySpace(c);
  };
  size_t b = 0, e = u.size();
  if (left) {
    while (b < e && strip(u[b])) ++b;
  }
  if (right) {
    while (e > b && strip(u[e - 1])) --e;
  }
  return EncodeUtf8(std::u32string_view(u).substr(b, e - b));
}

bool ParsePyInt(std::string_view s, int base, int64_t* out) {
  std::string t = PyStrip(s, nullptr, true, true);
  t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
  bool neg = false;
  size_t i = 0;
  if (i < t.size() && (t[i] == '+' || t[i] == '-')) neg = t[i++] == '-';
  if (i + 1 < t.size() && t[i] == '0') {
    // Python takes a base's prefix where the base is that one or 0 (any).
    const char p = static_cast<char>(std::tolower(static_cast<unsigned char>(t[i + 1])));
    const int prefixed = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
    if (prefixed != 0 && (base == prefixed || base == 0)) {
      base = prefixed;
      i += 2;
    }
  }
  if (base == 0) base = 10;
  if (i == t.size()) return false;
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(t.data() + i, t.data() + t.size(), v, base);
  if (ec != std::errc() || end != t.data() + t.size()) return false;
  if (v > (neg ? uint64_t{1} << 63 : (uint64_t{1} << 63) - 1)) return false;
  *out = neg ? static_cast<int64_t>(0 - v) : static_cast<int64_t>(v);
  return true;
}

bool ParsePyFloat(std::string_view s, double* out) {
  std::string t = PyStrip(s, nullptr, true, true);
  std::string lower;
  for (char c : t) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const bool neg = !lower.empty() && lower[0] == '-';
  const std::string body =
      !lower.empty() && (lower[0] == '-' || lower[0] == '+') ? lower.substr(1) : lower;
  if (body == "inf" || body == "infinity" || body == "nan") {
    *out = body == "nan" ? NAN : (neg ? -INFINITY : INFINITY);
    return true;
  }
  if (!t.empty() && t[0] == '+') t.erase(0, 1);
  auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), *out);
  return !t.empty() && ec == std::errc() && end == t.data() + t.size();
}

std::string FloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  // The shortest digits that round-trip, placed as Python's repr places
  // them: positional for exponents in [-4, 16), else scientific.
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, end);
  const size_t e_at = sci.find('e');
  const int exp = std::stoi(sci.substr(e_at + 1));
  std::string mant = sci.substr(0, e_at);
  const bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant) {
    if (c != '.') digits += c;
  }
  std::string out = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out += "0." + std::string(-exp - 1, '0') + digits;
    } else if (static_cast<size_t>(exp) + 1 >= digits.size()) {
      out += digits + std::string(exp + 1 - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) {
    // Appended in two steps: GCC 12 warns (-Wrestrict, a false positive) on
    // "." + std::string here.
    out += '.';
    out.append(digits, 1);
  }
  char e[16];
  std::snprintf(e, sizeof e, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
  return out + e;
}

bool IsCased(char32_t c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c >= 0xc0 && c <= 0x24f && c != 0xd7 && c != 0xf7);
}
bool IsUpper(char32_t c) { return (c >= 'A' && c <= 'Z') || (c >= 0xc0 && c <= 0xde && c != 0xd7); }
bool IsLower(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 0xdf && c <= 0xff && c != 0xf7); }
char32_t ToUpper(char32_t c) {
  if (c >= 'a' && c <= 'z') return c - 32;
  if (c >= 0xe0 && c <= 0xfe && c != 0xf7) return c - 32;
  return c;
}
char32_t ToLower(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c >= 0xc0 && c <= 0xde && c != 0xd7) return c + 32;
  return c;
}

std::string MapCase(const std::string& s, char32_t (*f)(char32_t)) {
  std::u32string u = DecodeUtf8(s);
  for (char32_t& c : u) c = f(c);
  return EncodeUtf8(u);
}

std::string Title(const std::string& s) {
  std::u32string u = DecodeUtf8(s);
  bool prev_cased = false;
  for (char32_t& c : u) {
    c = prev_cased ? ToLower(c) : ToUpper(c);
    prev_cased = IsCased(c);
  }
  return EncodeUtf8(u);
}

std::string Capitalize(const std::string& s) {
  std::u32string u = DecodeUtf8(s);
  for (size_t i = 0; i < u.size(); ++i) u[i] = i == 0 ? ToUpper(u[i]) : ToLower(u[i]);
  return EncodeUtf8(u);
}

std::vector<Value> Split(const std::string& s, const Value& sep_v, int64_t maxsplit,
                         bool from_right) {
  std::vector<std::string> parts;
  if (sep_v.is_none() || sep_v.is_undefined()) {
    // Runs of whitespace, none at either end.
    std::u32string u = DecodeUtf8(s);
    if (from_right) std::reverse(u.begin(), u.end());
    size_t i = 0;
    while (i < u.size()) {
      while (i < u.size() && IsPySpace(u[i])) ++i;
      if (i == u.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        size_t e = u.size();
        while (e > i && IsPySpace(u[e - 1])) --e;
        std::u32string rest = u.substr(i, e - i);
        if (from_right) std::reverse(rest.begin(), rest.end());
        parts.push_back(EncodeUtf8(rest));
        break;
      }
      size_t j = i;
      while (j < u.size() && !IsPySpace(u[j])) ++j;
      std::u32string word = u.substr(i, j - i);
      if (from_right) std::reverse(word.begin(), word.end());
      parts.push_back(EncodeUtf8(word));
      i = j;
    }
    if (from_right) std::reverse(parts.begin(), parts.end());
  } else {
    const std::string sep = StringArg(sep_v, "the separator");
    if (sep.empty()) Fail("empty separator");
    if (!from_right) {
      size_t from = 0, at;
      while ((maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) &&
             (at = s.find(sep, from)) != std::string::npos) {
        parts.push_back(s.substr(from, at - from));
        from = at + sep.size();
      }
      parts.push_back(s.substr(from));
    } else {
      size_t end = s.size();
      while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
        if (end < sep.size()) break;
        const size_t at = s.rfind(sep, end - sep.size());
        if (at == std::string::npos) break;
        parts.push_back(s.substr(at + sep.size(), end - at - sep.size()));
        end = at;
      }
      parts.push_back(s.substr(0, end));
      std::reverse(parts.begin(), parts.end());
    }
  }
  std::vector<Value> out;
  for (auto& p : parts) out.emplace_back(std::move(p));
  return out;
}

// str.splitlines(): Python's line boundaries, the separators dropped.
std::vector<std::string> SplitLines(const std::string& s) {
  std::vector<std::string> lines;
  const std::u32string u = DecodeUtf8(s);
  std::u32string cur;
  for (size_t i = 0; i < u.size(); ++i) {
    const char32_t c = u[i];
    if (c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e ||
        c == 0x85 || c == 0x2028 || c == 0x2029) {
      if (c == '\r' && i + 1 < u.size() && u[i + 1] == '\n') ++i;
      lines.push_back(EncodeUtf8(cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) lines.push_back(EncodeUtf8(cur));
  return lines;
}

std::string Replace(const std::string& s, const std::string& old, const std::string& repl,
                    int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts `repl` around every character.
    const std::u32string u = DecodeUtf8(s);
    int64_t n = 0;
    for (size_t i = 0; i <= u.size(); ++i) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
      }
      if (i < u.size()) AppendUtf8(u[i], &out);
    }
    return out;
  }
  size_t from = 0, at;
  int64_t n = 0;
  while ((count < 0 || n < count) && (at = s.find(old, from)) != std::string::npos) {
    out += s.substr(from, at - from) + repl;
    from = at + old.size();
    ++n;
  }
  return out + s.substr(from);
}

}  // namespace kdn::text::jinja
