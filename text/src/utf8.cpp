#include "utf8.h"

namespace kdn::text {

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

namespace {

bool Cont(unsigned char c) { return (c & 0xC0) == 0x80; }

// How many bytes of the sequence at s[i] are valid (the Unicode "maximal
// subpart" rules that Rust's Utf8Chunks follows), and how many the whole
// character needs: valid == need for a complete character; valid < need and
// i + valid == s.size() for one cut short by the end of `s`.
void Scan(std::string_view s, size_t i, size_t* valid, size_t* need) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    *valid = *need = 1;
    return;
  }
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // the range allowed for the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    *valid = 0;  // never begins a character
    *need = 1;
    return;
  }
  *need = n;
  size_t k = 1;
  if (i + k < s.size()) {
    const auto b1 = static_cast<unsigned char>(s[i + k]);
    if (b1 < lo || b1 > hi) {
      *valid = 1;
      return;
    }
    ++k;
    while (k < n && i + k < s.size() && Cont(static_cast<unsigned char>(s[i + k]))) ++k;
  }
  *valid = k;
}

}  // namespace

size_t CharLength(std::string_view s, size_t i) {
  size_t valid, need;
  Scan(s, i, &valid, &need);
  return valid == need ? need : 1;
}

char32_t DecodeChar(std::string_view s, size_t i, size_t len) {
  const auto b = [&](size_t k) {
    return static_cast<char32_t>(static_cast<unsigned char>(s[i + k]));
  };
  switch (len) {
    case 1: return b(0);
    case 2: return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3: return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

bool IsValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    size_t valid, need;
    Scan(s, i, &valid, &need);
    if (valid != need) return false;
    i += need;
  }
  return true;
}

size_t AppendUtf8Lossy(std::string_view bytes, bool final, std::string* out) {
  size_t i = 0;
  while (i < bytes.size()) {
    size_t valid, need;
    Scan(bytes, i, &valid, &need);
    if (valid == need) {
      out->append(bytes.substr(i, need));
      i += need;
    } else if (valid > 0 && i + valid == bytes.size() && !final) {
      break;  // may still complete
    } else {
      out->append("\xEF\xBF\xBD");  // U+FFFD for the maximal invalid prefix
      i += valid > 0 ? valid : 1;
    }
  }
  return i;
}

bool IsWhiteSpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

}  // namespace kdn::text
