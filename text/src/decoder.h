#pragma once
// Decoder: the `decoder` of a tokenizer.json (Hugging Face `tokenizers`)
// run as a stream, so that a sequence decoded one token at a time gives,
// piece by piece, exactly the text that decoding it whole gives. Private to
// kdn_text. Thread-safe after construction; a State is one sequence's.
//
// The decoders handled, as `tokenizers` 0.19 runs them on the list of token
// strings: first per-token steps (Replace, Metaspace, ByteFallback, Strip),
// then the point where the list becomes one text (Fuse; ByteLevel, which
// also turns its characters back into bytes and decodes them as lossy UTF-8;
// or, after the last step, concatenation; with no decoder at all, joining
// with spaces), then Strip on that text. Other orders are refused.
//
// Text is held back only while what follows may change it: the bytes of an
// unfinished run of byte-fallback tokens (a run that is not valid UTF-8 as a
// whole becomes one U+FFFD per byte), an incomplete UTF-8 character of
// ByteLevel bytes, and characters a trailing Strip may remove.

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdn/common/status.h"
#include "regex.h"

namespace kdn::text {

class Decoder {
 public:
  // From the JSON value `j` (null: no decoder). `where` names it in errors.
  static Result<std::unique_ptr<Decoder>> FromJson(const nlohmann::json& j,
                                                   const std::string& where);
  ~Decoder();

  struct State {
    std::vector<size_t> seen;         // tokens each per-token step has had (Metaspace's index)
    std::vector<std::string> group;   // each ByteFallback step's unfinished run
    size_t fused = 0;                 // tokens joined (kJoinSpaces)
    std::string bytes;                // kByteLevel: bytes of an unfinished character
    std::vector<size_t> lead;         // each post Strip: leading characters removed
    std::vector<bool> lead_done;      // ... or a character that stays was seen
    std::vector<std::string> trail;   // each post Strip: trailing characters held
  };
  std::unique_ptr<State> NewState() const;
  // Feeds the string of the next token (special tokens the caller skips)
  // and appends the text it makes final to `out`.
  void Push(State& st, std::string_view token, std::string* out) const;
  // Ends the sequence: appends the text held back.
  void Finish(State& st, std::string* out) const;

 private:
  struct Step {
    enum Kind { kReplace, kMetaspace, kByteFallback, kStrip } kind;
    std::unique_ptr<Regex> pattern;  // kReplace
    std::string content;             // kReplace: the replacement; kStrip: the character
    std::string replacement;         // kMetaspace
    bool strip_first = true;         // kMetaspace: prepend_scheme is not "never"
    size_t start = 0, stop = 0;      // kStrip
  };
  enum class Fuse { kJoinSpaces, kConcat, kByteLevel };

  static Status Add(const nlohmann::json& j, const std::string& where, Decoder* d);
  void Run(State& st, size_t k, std::string tok, std::string* out) const;
  void FlushGroup(State& st, size_t k, std::string* out) const;
  void Fused(State& st, std::string_view tok, std::string* out) const;
  void Post(State& st, std::string text, std::string* out) const;

  std::vector<Step> steps_;  // per token, before the fuse point
  Fuse fuse_ = Fuse::kConcat;
  bool fused_ = false;       // a fuse step was seen (while parsing)
  std::vector<Step> post_;   // kStrip steps on the fused text
};

}  // namespace kdn::text
