#pragma once
// Tokenizer interface and its byte-level implementation.
//
// The byte-level tokenizer is what kdn's generated and trained models use: one
// token per byte, plus special tokens, described by a Hugging Face
// tokenizer.json (a BPE model with no merges over the 256 byte symbols of the
// ByteLevel pre-tokenizer), so Hugging Face `tokenizers` produces the same ids.
// Thread-safe after construction.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::text {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_bos) const = 0;
  // Special tokens are left out of the text.
  virtual std::string Decode(std::span<const int32_t> ids) const = 0;
  virtual int vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;  // -1 when the model has none
  virtual int32_t eos_id() const = 0;

  // Loads DIR/tokenizer.json (and tokenizer_config.json for bos/eos). A
  // tokenizer.json that is not byte-level is refused as Unimplemented.
  static Result<std::unique_ptr<Tokenizer>> Load(const std::filesystem::path& dir);
};

// The GPT-2 byte-to-unicode table: the printable code point the ByteLevel
// pre-tokenizer uses for each byte value.
char32_t ByteToUnicode(uint8_t b);

class ByteTokenizer final : public Tokenizer {
 public:
  // byte_ids[b] is the id of byte b; specials are named ids outside that.
  ByteTokenizer(std::vector<int32_t> byte_ids, int vocab_size, int32_t bos, int32_t eos);
  std::vector<int32_t> Encode(std::string_view text, bool add_bos) const override;
  std::string Decode(std::span<const int32_t> ids) const override;
  int vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }

 private:
  std::vector<int32_t> byte_ids_;   // byte -> id
  std::vector<int16_t> id_to_byte_;  // id -> byte, -1 for specials
  int vocab_size_;
  int32_t bos_, eos_;
};

// The tokenizer.json and tokenizer_config.json texts of the byte-level
// tokenizer with ids 0..255 for bytes, 256 <s>, 257 </s> (kdn-mkmodel's).
std::string ByteTokenizerJson();
std::string ByteTokenizerConfigJson();

}  // namespace kdn::text
