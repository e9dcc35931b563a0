#pragma once
// Real English prose for the fidelity workloads (blend-fidelity,
// prune-fidelity): every regular file of a folder (default
// /usr/share/common-licenses, the licence texts Debian's base-files installs
// on every system), split into paragraphs, consecutive paragraphs of one
// file joined into documents of a least a given number of tokens.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/engine.h"
#include "kdn/text/tokenizer.h"

namespace kdn::bench {

struct ProseDocument {
  std::string text;  // ends with a blank line
  std::vector<int32_t> tokens;
  int source = 0;  // which file
};

// Text to tokens: `model_dir`'s tokenizer into *tok (with no model folder, a
// preset, the text's bytes modulo `vocab` are the tokens and *tok stays null).
using Encoder = std::function<std::vector<int32_t>(const std::string&)>;
Result<Encoder> ProseEncoder(const std::string& model_dir, int vocab,
                             std::unique_ptr<text::Tokenizer>* tok);

// The documents of `dir`'s files (sorted by name): runs of whole paragraphs
// of one file of at least `min_tokens` tokens, at most twice that (a run
// past it, one huge paragraph, is left out). `files` receives the number of
// files read. NOT_FOUND when there is no file.
Result<std::vector<ProseDocument>> ProseDocuments(
    const std::string& dir, int min_tokens,
    const std::function<std::vector<int32_t>(const std::string&)>& encode, size_t* files);

// A distinctive word of `text` (the longest alphabetic one), for a question.
std::string KeyWord(const std::string& text);

// The next-token logits at each of tokens' positions: `logits` (the
// prompt's, in `seq`) for the first, then one pass over tokens[0..n-2] on
// top of `seq` (all logits) for the rest.
Result<std::vector<std::vector<float>>> TeacherForced(engine::Engine& model,
                                                      engine::KvSequence& seq,
                                                      std::vector<float> logits,
                                                      const std::vector<int32_t>& tokens);

}  // namespace kdn::bench
