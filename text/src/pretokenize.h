#pragma once
// PreTokenizer: the `pre_tokenizer` of a tokenizer.json (Hugging Face
// `tokenizers`), which cuts normalized text into the words BPE encodes one
// at a time: Split (a regex, with its behavior and invert); Digits,
// Punctuation, Whitespace and WhitespaceSplit (each a Split by a fixed
// character class, as `tokenizers` runs them); ByteLevel (the GPT-2 split,
// and the byte-to-unicode alphabet); Metaspace (sentencepiece's "▁"); and a
// Sequence of them, in any order but for ByteLevel's. Private to kdn_text.
// Thread-safe after construction.
//
// The words keep their bytes: the ByteLevel alphabet is applied by the BPE
// model itself (BpeModel's byte-level mode), which looks bytes up directly,
// so a ByteLevel step must come last.

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdn/common/status.h"
#include "regex.h"

namespace kdn::text {

// Words as ranges of one buffer.
struct Words {
  struct Range {
    size_t begin, end;
    bool at_start;  // begins where the whole input text begins
  };
  std::string buf;
  std::vector<Range> list;

  std::string_view Get(const Range& r) const {
    return std::string_view(buf).substr(r.begin, r.end - r.begin);
  }
};

class PreTokenizer {
 public:
  // From the JSON value `j` (null for none). `where` names it in errors.
  static Result<std::unique_ptr<PreTokenizer>> FromJson(const nlohmann::json& j,
                                                        const std::string& where);
  ~PreTokenizer();

  // Whether the words are to be encoded over the ByteLevel alphabet.
  bool byte_level() const { return byte_level_; }

  // Cuts `text`, which begins the input when `at_start` (the Metaspace
  // "first" scheme needs to know), into words appended to `out` (each
  // non-empty).
  void Run(std::string_view text, bool at_start, Words* out) const;

 private:
  struct Step;
  static Status Add(const nlohmann::json& j, const std::string& where, PreTokenizer* p);
  static void Apply(const Step& step, Words* words);

  std::vector<std::unique_ptr<Step>> steps_;
  bool byte_level_ = false;
};

}  // namespace kdn::text
