#pragma once
// HfTokenizer: a Hugging Face tokenizer.json run the way `tokenizers` 0.19
// runs it (TokenizerImpl::encode_single_sequence, decode). Private to
// kdn_text; Tokenizer::Load makes one. Thread-safe after construction.
//
// Encode: the text is cut at the added tokens that are matched on the raw
// text (normalized: false), leftmost-longest with their single_word, lstrip
// and rstrip rules; each other piece is normalized and cut again at the
// added tokens matched on normalized text; each remaining piece is
// pre-tokenized into words, and BPE encodes each word. With add_bos the
// post-processor's special tokens go around the whole.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "bpe.h"
#include "decoder.h"
#include "kdn/text/tokenizer.h"
#include "normalize.h"
#include "pretokenize.h"

namespace kdn::text {

class HfTokenizer final : public Tokenizer {
 public:
  // From tokenizer.json (`tok`) and tokenizer_config.json (`config`, null
  // when absent). `file` names tokenizer.json in errors.
  static Result<std::unique_ptr<HfTokenizer>> FromJson(const nlohmann::json& tok,
                                                       const nlohmann::json& config,
                                                       const std::string& file);

  std::vector<int32_t> Encode(std::string_view text, bool add_bos) const override;
  std::unique_ptr<DecodeStream> NewDecodeStream() const override;
  int vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }

  // The string the decoder gets for `id`, or null for an id it skips
  // (special, or not in the vocabulary).
  const std::string* DecodeString(int32_t id) const;
  const Decoder& decoder() const { return *decoder_; }

 private:
  struct Added {
    std::string content;  // as the file gives it (and Decode shows it)
    std::string match;    // as matched: `content` normalized when `normalized`
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
  };
  // Added tokens to match in a text, by first byte, longest first.
  struct Matcher {
    std::vector<int> by_byte[256];
    bool empty = true;
  };
  struct Piece {
    size_t begin, end;
    int added;  // index in added_, or -1 for text
  };

  HfTokenizer() = default;
  Status LoadAdded(const nlohmann::json& tok, const std::string& file);
  Status LoadPostProcessor(const nlohmann::json& j, const std::string& where);
  // The pieces of `text` by the added tokens of `m` (AddedVocabulary::find_matches).
  std::vector<Piece> FindAdded(std::string_view text, const Matcher& m) const;
  void EncodeText(std::string_view text, bool at_start, BpeModel::Scratch& scratch,
                  std::vector<int32_t>* ids) const;

  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<Decoder> decoder_;
  std::vector<Added> added_;
  Matcher raw_matcher_, normalized_matcher_;
  std::vector<int32_t> added_by_id_;  // id -> index in added_, -1 for none
  bool has_template_ = false;
  bool add_bos_token_ = false;  // tokenizer_config.json's, used without a template
  std::vector<int32_t> prefix_ids_, suffix_ids_;  // put around a text with add_bos
  int vocab_size_ = 0;
  int32_t bos_ = -1, eos_ = -1;
};

}  // namespace kdn::text
