#pragma once
// BpeModel: the BPE `model` of a tokenizer.json (Hugging Face `tokenizers`'
// models/bpe): vocab and merges, continuing_subword_prefix and
// end_of_word_suffix, ignore_merges, byte_fallback (<0xNN> tokens), unk_token
// and fuse_unk. Private to kdn_text. Thread-safe after construction.
//
// A word is merged the way `tokenizers` merges it (Word::merge_all): the pair
// of lowest merge rank first, the leftmost of equal ranks, over a linked list
// of symbols with a binary heap of candidate merges, O(n log n) in the
// word's length (a sentencepiece text without a pre-tokenizer is one word).
// Merge ranks are found in an open-addressing table keyed by the pair of ids.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdn/common/status.h"

namespace kdn::text {

// The largest token id taken: tables are sized by the largest id, so a file
// must not make them any size it likes (the largest vocabularies in use are
// a few hundred thousand).
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// Whether a tokenizer.json value is a token id: an integer in [0, kMaxTokenId].
inline bool IsTokenId(const nlohmann::json& v) {
  return v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= kMaxTokenId;
}

// Hashing that lets a map keyed by std::string be searched by string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // From tokenizer.json's "model" object. In `byte_level` mode words are raw
  // bytes and each byte is the symbol of its ByteLevel character. `where`
  // names the object in errors.
  static Result<std::unique_ptr<BpeModel>> FromJson(const nlohmann::json& j, bool byte_level,
                                                    const std::string& where);
  ~BpeModel();

  // Scratch space one Encode reuses across its words.
  struct Scratch {
    struct Symbol {
      int32_t id;
      int32_t prev, next;  // -1 at the ends
      bool alive;
    };
    struct Merge {
      int32_t rank, pos, new_id;
    };
    std::vector<Symbol> symbols;
    std::vector<Merge> heap;
    std::string piece;
  };
  static std::unique_ptr<Scratch> NewScratch();

  // Appends the ids of `word` (non-empty) to `ids`.
  void Tokenize(std::string_view word, Scratch& scratch, std::vector<int32_t>* ids) const;

  // The vocabulary, token string to id; ids index `tokens()`.
  const TokenMap& vocab() const { return vocab_; }
  // Token strings by id; ids missing from the vocabulary hold "" and are
  // not `has_token`.
  const std::vector<std::string>& tokens() const { return tokens_; }
  bool has_token(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < has_.size() && has_[id];
  }

 private:
  BpeModel() = default;
  struct MergeTable;
  void MergeWord(Scratch& s) const;
  void TokenizePart(std::string_view word, Scratch& s, std::vector<int32_t>* ids) const;

  TokenMap vocab_;
  std::vector<std::string> tokens_;
  std::vector<bool> has_;
  std::unique_ptr<MergeTable> merges_;
  // Whether a word may be cut before each "▁" that follows another
  // character and each part merged alone (sentencepiece vocabularies): see
  // FromJson.
  bool split_at_metaspace_ = false;
  bool byte_level_ = false;
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  int32_t unk_ = -1;
  std::string prefix_, suffix_;  // continuing_subword_prefix, end_of_word_suffix
  // byte_level_: the id of each byte's ByteLevel character (-1 when the
  // vocabulary lacks it), its UTF-8 text, and the tokens whose characters
  // all are ByteLevel characters, keyed by their bytes (for ignore_merges).
  int32_t byte_ids_[256];
  std::string byte_chars_[256];
  TokenMap raw_vocab_;
  // The ids of the <0xNN> tokens (byte_fallback_), -1 where missing.
  int32_t fallback_ids_[256];
};

}  // namespace kdn::text
