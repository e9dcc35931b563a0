// libFuzzer harness for the tokenizer (kdn/text/tokenizer.h).
//
// The first byte picks what the rest is:
// - 0 mod 3: text, encoded by models/kdn-qa's byte-level tokenizer: every id
//   inside the vocabulary, the BOS first when asked for, one id per byte
//   (unless the text holds an added token's text, <s> or </s>), and decoding
//   gives valid UTF-8 text back;
// - 1 mod 3: token ids (4 bytes each, any value), decoded by the same
//   tokenizer: never a crash, at most one U+FFFD (3 bytes) per id;
// - 2 mod 3: a tokenizer.json and, after the first NUL, a
//   tokenizer_config.json, loaded from a folder (Tokenizer::Load). Either a
//   Status, or a tokenizer that encodes every byte value and its own input
//   to ids inside its vocabulary and decodes them to valid UTF-8, with BOS
//   and EOS inside it or -1.
// Every decode is checked against a DecodeStream fed one id at a time: the
// two give the same text.
//
// Built with clang's -fsanitize=fuzzer,address,undefined (tests/fuzz); the
// test `tokenizer_fuzz` (label fuzz) runs it over tests/fuzz/corpus/tokenizer.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "kdn/text/tokenizer.h"

using namespace kdn;
using kdn::fuzz::Check;

namespace {

const text::Tokenizer& Shipped() {
  static const text::Tokenizer* tok = [] {
    auto t = text::Tokenizer::Load(std::string(KDN_SOURCE_DIR) + "/models/kdn-qa");
    Check(t.ok(), "models/kdn-qa's tokenizer loads");
    return std::move(t).value().release();
  }();
  return *tok;
}

bool ValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80                   ? 1
                     : (c >= 0xC2 && c <= 0xDF) ? 2
                     : (c >= 0xE0 && c <= 0xEF) ? 3
                     : (c >= 0xF0 && c <= 0xF4) ? 4
                                                : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    const auto c1 = static_cast<unsigned char>(n > 1 ? s[i + 1] : 0);
    if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 > 0x9F) || (c == 0xF0 && c1 < 0x90) ||
        (c == 0xF4 && c1 > 0x8F)) {
      return false;
    }
    i += n;
  }
  return true;
}

// Decode(ids), checked against a DecodeStream fed one id at a time.
std::string CheckedDecode(const text::Tokenizer& tok, const std::vector<int32_t>& ids) {
  const std::string text = tok.Decode(ids);
  auto stream = tok.NewDecodeStream();
  std::string streamed;
  for (int32_t id : ids) streamed += stream->Next(id);
  streamed += stream->Finish();
  Check(streamed == text, "decoding token by token gives Decode's text");
  Check(ValidUtf8(text), "decoded text is valid UTF-8");
  return text;
}

// Encodes `text` with and without the special tokens the tokenizer adds
// (add_bos): ids inside the vocabulary, and the ids without them found
// inside the ids with them; returns the ids without.
std::vector<int32_t> CheckedEncode(const text::Tokenizer& tok, std::string_view text) {
  const std::vector<int32_t> plain = tok.Encode(text, false);
  const std::vector<int32_t> with = tok.Encode(text, true);
  for (int32_t id : plain) Check(id >= 0 && id < tok.vocab_size(), "ids inside the vocabulary");
  for (int32_t id : with) Check(id >= 0 && id < tok.vocab_size(), "ids inside the vocabulary");
  Check(std::search(with.begin(), with.end(), plain.begin(), plain.end()) != with.end(),
        "the text's ids inside those with the added special tokens");
  return plain;
}

void CheckByteLevel(const text::Tokenizer& tok, std::string_view text) {
  const std::vector<int32_t> ids = CheckedEncode(tok, text);
  const std::vector<int32_t> with_bos = tok.Encode(text, true);
  Check(!with_bos.empty() && with_bos[0] == tok.bos_id(), "BOS first when asked for");
  const std::string decoded = CheckedDecode(tok, ids);
  if (text.find("<s>") == std::string_view::npos && text.find("</s>") == std::string_view::npos) {
    Check(ids.size() == text.size(), "one id per byte (a byte-level tokenizer)");
    if (ValidUtf8(text)) Check(decoded == text, "decoding gives valid UTF-8 text back");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 3) {
    case 0: CheckByteLevel(Shipped(), rest); break;
    case 1: {
      std::vector<int32_t> ids(rest.size() / 4);
      if (!ids.empty()) std::memcpy(ids.data(), rest.data(), ids.size() * 4);
      Check(CheckedDecode(Shipped(), ids).size() <= 3 * ids.size(), "a U+FFFD per id at most");
      break;
    }
    default: {
      const auto dir = fuzz::ScratchDir() / "tokenizer";
      std::filesystem::create_directories(dir);
      const size_t nul = rest.find('\0');
      fuzz::WriteFile(dir / "tokenizer.json", rest.substr(0, nul));
      std::filesystem::remove(dir / "tokenizer_config.json");
      if (nul != std::string_view::npos) {
        fuzz::WriteFile(dir / "tokenizer_config.json", rest.substr(nul + 1));
      }
      auto tok = text::Tokenizer::Load(dir);
      if (!tok.ok()) break;
      const text::Tokenizer& t = **tok;
      Check(t.vocab_size() > 0, "a vocabulary");
      Check(t.bos_id() >= -1 && t.bos_id() < t.vocab_size(), "BOS inside the vocabulary or -1");
      Check(t.eos_id() >= -1 && t.eos_id() < t.vocab_size(), "EOS inside the vocabulary or -1");
      std::string every_byte(256, '\0');
      for (int b = 0; b < 256; ++b) every_byte[b] = static_cast<char>(b);
      CheckedDecode(t, CheckedEncode(t, every_byte));
      CheckedDecode(t, CheckedEncode(t, rest));
      break;
    }
  }
  return 0;
}
