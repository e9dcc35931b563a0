#pragma once
// UTF-8 helpers of the tokenizer (private to kdn_text). Text reaching the
// tokenizer is bytes: it may hold invalid UTF-8, which every helper here
// handles without reading past the end.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kdn::text {

// Appends the UTF-8 encoding of `c` (a code point below 0x110000).
void AppendUtf8(char32_t c, std::string* out);

// The length of the character that starts at s[i]: 1 to 4 when s[i..] holds a
// valid UTF-8 character, 1 for a byte that does not begin one (so an invalid
// byte is a character of its own).
size_t CharLength(std::string_view s, size_t i);

// The code point of the valid character of `len` bytes at s[i] (CharLength).
char32_t DecodeChar(std::string_view s, size_t i, size_t len);

// Whether `s` is valid UTF-8.
bool IsValidUtf8(std::string_view s);

// Appends `bytes` to `out` as Rust's String::from_utf8_lossy does: each
// maximal prefix of an invalid sequence becomes one U+FFFD. Unless `final`, a
// trailing sequence that is valid so far but incomplete is left unconsumed,
// so that it can be decoded once its remaining bytes arrive; the result of
// decoding in pieces is then the result of decoding the whole. Returns the
// number of bytes consumed.
size_t AppendUtf8Lossy(std::string_view bytes, bool final, std::string* out);

// Rust's char::is_whitespace (Unicode White_Space).
bool IsWhiteSpace(char32_t c);

}  // namespace kdn::text
