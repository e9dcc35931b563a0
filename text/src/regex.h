#pragma once
// Regex: a PCRE2 pattern (UTF and Unicode-property mode, JIT-compiled when
// the platform allows) standing in for the Oniguruma regexes of Hugging Face
// `tokenizers` (its Split pre-tokenizer, the GPT-2 ByteLevel split, Replace).
// Private to kdn_text. Thread-safe after construction: each search makes its
// own match data.

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::text {

class Regex {
 public:
  // `pattern` is Oniguruma syntax as tokenizer.json files hold it; `literal`
  // takes it as a plain string instead (a {"String": ...} pattern).
  // InvalidArgument, naming `where`, when PCRE2 refuses it.
  static Result<std::unique_ptr<Regex>> Compile(std::string_view pattern, bool literal,
                                                const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // The [begin, end) byte ranges of the successive non-overlapping matches
  // in `text`, found the way Oniguruma's find_iter finds them (an empty match
  // right after the previous match is skipped). Invalid UTF-8 in `text`
  // matches nothing but does not stop the search.
  std::vector<std::pair<size_t, size_t>> FindAll(std::string_view text) const;

 private:
  explicit Regex(void* code, bool jit) : code_(code), jit_(jit) {}
  void* code_;  // pcre2_code_8
  bool jit_;
};

}  // namespace kdn::text
