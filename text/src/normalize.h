#pragma once
// Normalizer: the `normalizer` of a tokenizer.json (Hugging Face
// `tokenizers`): NFC, NFD, NFKC, NFKD (by utf8proc), Prepend, Replace, and a
// Sequence of them. Private to kdn_text. Thread-safe after construction.

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdn/common/status.h"
#include "regex.h"

namespace kdn::text {

// A Replace's or Split's "pattern": {"String": s} or {"Regex": r}; `where`
// names the object holding it.
Result<std::unique_ptr<Regex>> PatternFromJson(const nlohmann::json& j, const std::string& where);

class Normalizer {
 public:
  // From the JSON value `j` (null for none). `where` names it in errors:
  // InvalidArgument for a malformed field, Unimplemented for a type not
  // handled here.
  static Result<std::unique_ptr<Normalizer>> FromJson(const nlohmann::json& j,
                                                      const std::string& where);

  bool empty() const { return ops_.empty(); }
  // The normalized text. Invalid UTF-8 in `text` is kept as it is; the
  // Unicode normal forms apply to the valid runs between.
  std::string Apply(std::string_view text) const;

 private:
  struct Op {
    enum Kind { kUnicode, kPrepend, kReplace } kind;
    int utf8proc_options = 0;        // kUnicode
    std::string text;                // kPrepend: the prefix; kReplace: the content
    std::unique_ptr<Regex> pattern;  // kReplace
  };
  static Status Add(const nlohmann::json& j, const std::string& where, Normalizer* n);

  std::vector<Op> ops_;
};

}  // namespace kdn::text
