#pragma once
// Decoder: the `decoder` of a tokenizer.json (Hugging Face `tokenizers`)
// run as a stream, so that a sequence decoded one token at a time gives,
// piece by piece, exactly the text that decoding it whole gives. Private to
// kdn_text. Thread-safe after construction; a State is one sequence's.
//
// `tokenizers` 0.19 runs a decoder (or a Sequence of them, in any order) on
// the list of token strings, and joins what comes out. Here that list is
// split at its fuse point, the first Fuse or ByteLevel, which turns the list
// into one text (ByteLevel also turns its characters back into bytes and
// decodes them as lossy UTF-8). The steps before it (Replace, Metaspace,
// ByteFallback, Strip) run on each token as it comes. Every step after it
// runs on that one text as a stream: Replace, Metaspace (a first token: it
// drops every replacement character unless prepend_scheme is "never"),
// Strip, ByteFallback (the text becomes a byte only when it is exactly one
// "<0xNN>"), ByteLevel (one token: bytes only if every character is in
// the alphabet, else the text as it is) and Fuse (nothing to join). With no
// fuse point the tokens are concatenated; with no decoder at all, joined
// with spaces. WordPiece, CTC and BPEDecoder are refused.
//
// Text is held back only while what follows may change it: the bytes of an
// unfinished run of byte-fallback tokens (a run that is not valid UTF-8 as a
// whole becomes one U+FFFD per byte), an incomplete UTF-8 character of
// ByteLevel bytes, characters a trailing Strip may remove, the end of the
// text that may begin a Replace's String pattern; and all of the fused text
// while it may still be a "<0xNN>" (ByteFallback after the fuse point), while
// every character of it is in the ByteLevel alphabet (ByteLevel after the
// fuse point), and for a Regex Replace after the fuse point (a regex match
// may reach any distance back), until the sequence ends.

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

  // What a step after the fuse point holds of the text.
  struct PostState {
    std::string held;        // text not yet given on
    bool settled = false;    // ByteLevel: a character outside the alphabet seen;
                             // ByteFallback: the text cannot be one "<0xNN>"
    size_t lead = 0;         // Strip: leading characters removed
    bool lead_done = false;  // ... or a character that stays was seen
  };
  struct State {
    std::vector<size_t> seen;        // tokens each per-token step has had (Metaspace's index)
    std::vector<std::string> group;  // each ByteFallback step's unfinished run
    size_t fused = 0;                // tokens joined (kJoinSpaces)
    std::string bytes;               // kByteLevel: bytes of an unfinished character
    std::vector<PostState> post;     // each step after the fuse point
  };
  std::unique_ptr<State> NewState() const;
  // Feeds the string of the next token (special tokens the caller skips)
  // and appends the text it makes final to `out`.
  void Push(State& st, std::string_view token, std::string* out) const;
  // Ends the sequence: appends the text held back.
  void Finish(State& st, std::string* out) const;

 private:
  struct Step {
    enum Kind { kReplace, kMetaspace, kByteFallback, kStrip, kByteLevel } kind;
    std::unique_ptr<Regex> pattern;  // kReplace
    bool literal = false;            // kReplace: a String pattern, `text`
    std::string text;                // kReplace: the String pattern
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
  // The fused text through the steps after the fuse point from post_[j] on.
  void Post(State& st, size_t j, std::string text, std::string* out) const;
  std::string PostPush(const Step& s, PostState& ps, std::string text) const;
  std::string PostFinish(const Step& s, PostState& ps) const;

  std::vector<Step> steps_;  // per token, before the fuse point
  Fuse fuse_ = Fuse::kConcat;
  bool fused_ = false;      // a fuse step was seen (while parsing)
  std::vector<Step> post_;  // on the one fused text, after the fuse point
};

}  // namespace kdn::text
