#pragma once
// Tokenizer interface, its loader, and kdn's byte-level tokenizer.
//
// Tokenizer::Load reads a Hugging Face tokenizer.json and gives the ids that
// Hugging Face `tokenizers` gives for it: BPE models with merges over the
// ByteLevel alphabet (GPT-2, Llama 3, Qwen2, SmolLM2) and sentencepiece-style
// BPE (Llama 2, Mistral: Metaspace or the Prepend/Replace normalizers, byte
// fallback, unk); the pre-tokenizers Split, ByteLevel, Metaspace, Digits,
// Punctuation, Whitespace and WhitespaceSplit in a Sequence (ByteLevel
// last); added tokens with their flags; the NFC/NFD/NFKC/NFKD, Prepend and
// Replace normalizers; and the decoders those files use (docs/engine.md,
// "Tokenizer"). kdn's own
// generated models use a byte-level tokenizer.json (ByteTokenizerJson: one
// token per byte, no merges), which loads the same way.
//
// Thread-safe after construction; a DecodeStream is one sequence's.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::text {

// Decodes one sequence a token at a time. The text it gives, all pieces
// and Finish() together, is exactly Tokenizer::Decode of the whole
// sequence: a token that ends inside a UTF-8 character, inside a run of
// byte-fallback tokens, with characters the decoder may strip at the end,
// or with the start of a String a Replace after Fuse may match, has that
// text held back until what follows settles it (it never shows as U+FFFD
// unless the whole sequence decodes to one there). Decoders that judge the
// whole fused text (ByteFallback or ByteLevel after the fuse point, a Regex
// Replace after it) may hold it all until Finish. The sentencepiece
// decoders' leading-space strip applies to the first token of the sequence
// only. Not thread-safe; the tokenizer must outlive it.
class DecodeStream {
 public:
  virtual ~DecodeStream() = default;
  // The text that `id`, the next token of the sequence, makes final (often
  // empty for a byte of a longer character). Special tokens give none.
  virtual std::string Next(int32_t id) = 0;
  // The end of the sequence: the text held back, as Decode shows it.
  virtual std::string Finish() = 0;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // The ids of `text` (any bytes; invalid UTF-8 is encoded as bytes that
  // are no character). With `add_bos`, the special tokens the tokenizer puts
  // around a text: those of its TemplateProcessing post-processor (Llama 2 and
  // 3: the BOS), or without one the BOS when tokenizer_config.json's
  // add_bos_token is true (kdn's byte-level models); none for GPT-2 or Qwen2.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_bos) const = 0;
  // The text of `ids`, as Hugging Face `tokenizers` decodes them with
  // skip_special_tokens: special tokens and ids outside the vocabulary are
  // left out; always valid UTF-8. One DecodeStream run over the ids.
  std::string Decode(std::span<const int32_t> ids) const;
  virtual std::unique_ptr<DecodeStream> NewDecodeStream() const = 0;
  virtual int vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;  // -1 when the model has none
  virtual int32_t eos_id() const = 0;  // -1 when the model has none

  // Loads DIR/tokenizer.json (and DIR/tokenizer_config.json for bos, eos and
  // add_bos_token, when present), or, where `dir` is a GGUF file
  // (model::IsGgufPath), its tokenizer.ggml.* keys, which give llama.cpp's ids
  // (models gpt2 and llama; docs/engine.md, "GGUF"). InvalidArgument names the malformed field;
  // Unimplemented names a component type not supported.
  static Result<std::unique_ptr<Tokenizer>> Load(const std::filesystem::path& dir);
};

// The tokens of `ids` that hold the first occurrence of `needle` in their
// text (Tokenizer::Decode of them): [first, end), first the token whose text
// holds the needle's first byte, or an earlier one whose text the decoder
// held back with it (a character split across tokens), end one past the
// token whose text holds its last byte. nullopt for an empty needle or one
// the text does not hold. What an emphasized phrase of a document names
// (docs/serving.md, "Emphasis").
std::optional<std::pair<int64_t, int64_t>> TokensHolding(const Tokenizer& tokenizer,
                                                         std::span<const int32_t> ids,
                                                         std::string_view needle);

// The GPT-2 byte-to-unicode table: the printable code point the ByteLevel
// pre-tokenizer uses for each byte value.
char32_t ByteToUnicode(uint8_t b);

// A byte-level tokenizer built in code (tests, tools): byte b is id
// byte_ids[b], and Decode is that of a ByteLevel decoder (bytes, shown as
// lossy UTF-8). Encode adds `bos` when asked and it is not -1.
class ByteTokenizer final : public Tokenizer {
 public:
  // byte_ids[b] is the id of byte b; specials are named ids outside that.
  ByteTokenizer(std::vector<int32_t> byte_ids, int vocab_size, int32_t bos, int32_t eos);
  std::vector<int32_t> Encode(std::string_view text, bool add_bos) const override;
  std::unique_ptr<DecodeStream> NewDecodeStream() const override;
  int vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }

 private:
  std::vector<int32_t> byte_ids_;    // byte -> id
  std::vector<int16_t> id_to_byte_;  // id -> byte, -1 for specials
  int vocab_size_;
  int32_t bos_, eos_;
};

// The tokenizer.json and tokenizer_config.json texts of the byte-level
// tokenizer with ids 0..255 for bytes, 256 <s>, 257 </s> (kdn-mkmodel's).
std::string ByteTokenizerJson();
std::string ByteTokenizerConfigJson();

}  // namespace kdn::text
