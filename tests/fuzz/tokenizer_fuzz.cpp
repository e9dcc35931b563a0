// libFuzzer harness for the tokenizer (kdn/text/tokenizer.h).
//
// The first byte picks what the rest is:
// - 0 mod 3: text, encoded by models/kdn-qa's tokenizer: every id inside the
//   vocabulary, the BOS first when asked for, and decoding gives the text
//   back;
// - 1 mod 3: token ids (4 bytes each, any value), decoded by the same
//   tokenizer: never a crash, one byte at most per id, specials left out;
// - 2 mod 3: a tokenizer.json and, after the first NUL, a
//   tokenizer_config.json, loaded from a folder (Tokenizer::Load). Either a
//   Status, or a tokenizer that encodes every byte to an id inside its
//   vocabulary and decodes it back, with BOS and EOS inside it or -1.
//
// Built with clang's -fsanitize=fuzzer,address,undefined (tests/fuzz); the
// test `tokenizer_fuzz` (label fuzz) runs it over tests/fuzz/corpus/tokenizer.
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

void CheckRoundTrip(const text::Tokenizer& tok, std::string_view text) {
  for (bool bos : {false, true}) {
    const std::vector<int32_t> ids = tok.Encode(text, bos);
    const bool has_bos = bos && tok.bos_id() >= 0;
    Check(ids.size() == text.size() + (has_bos ? 1 : 0), "one id per byte (a byte-level tokenizer)");
    if (has_bos) Check(!ids.empty() && ids[0] == tok.bos_id(), "BOS first when asked for");
    for (int32_t id : ids) Check(id >= 0 && id < tok.vocab_size(), "ids inside the vocabulary");
    Check(tok.Decode(ids) == text, "decoding gives the text back");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 3) {
    case 0:
      CheckRoundTrip(Shipped(), rest);
      break;
    case 1: {
      std::vector<int32_t> ids(rest.size() / 4);
      if (!ids.empty()) std::memcpy(ids.data(), rest.data(), ids.size() * 4);
      Check(Shipped().Decode(ids).size() <= ids.size(), "a byte per id at most");
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
      CheckRoundTrip(t, every_byte);
      break;
    }
  }
  return 0;
}
