#pragma once
// The tokenizer of a GGUF file (tokenizer.ggml.*) as the tokenizer.json and
// tokenizer_config.json that HfTokenizer reads, so that one implementation
// runs both sources. Private to kdn_text; Tokenizer::Load uses it.
//
// Built to give llama.cpp's ids for the file (llama-vocab.cpp, as vendored in
// llama-cpp-python 0.3.36):
// - model "gpt2": byte-level BPE over tokens and merges. The pre-tokenizer
//   is the regex list llama.cpp keeps for tokenizer.ggml.pre, each regex a
//   Split (Isolated) in turn, then ByteLevel without its own regex; the
//   Llama 3 family's "ignore merges" (a word that is a token is that token).
// - model "llama": sentencepiece BPE: merges rebuilt from the scores as
//   transformers' converter does, byte fallback, "▁" for spaces and in front
//   of the text (tokenizer.ggml.add_space_prefix, default true).
// - Control and unknown tokens (token_type 3 and 2) are special added
//   tokens; user-defined ones (4) are added tokens: all are matched in the
//   text, as llama.cpp does with parse_special.
// - add_bos: tokenizer.ggml.add_bos_token, else llama.cpp's default for the
//   model and pre-tokenizer. BOS, EOS and unknown ids the file does not give
//   are llama.cpp's defaults (model::GgufTokenId).
// Other models and pre-tokenizer names are Unimplemented, naming the key.

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdn/common/status.h"
#include "kdn/model/gguf.h"

namespace kdn::text {

struct GgufTokenizerJson {
  nlohmann::json tokenizer;  // tokenizer.json
  nlohmann::json config;     // tokenizer_config.json
};

Result<GgufTokenizerJson> TokenizerJsonFromGguf(const model::GgufFile& file);

// The pre-tokenizer regexes llama.cpp applies for tokenizer.ggml.pre `pre`
// (empty means "default"), whether it ignores merges and whether it adds a
// BOS by default for it; false when kdn does not know the name.
bool LlamaCppPreTokenizer(const std::string& pre, std::vector<std::string>* regexes,
                          bool* ignore_merges, bool* add_bos);

}  // namespace kdn::text
