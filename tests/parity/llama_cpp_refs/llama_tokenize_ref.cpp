// llama_tokenize_ref: llama.cpp's own tokenizer on a GGUF file, through
// llama.h's public API only, as the reference kdn's GGUF tokenizer is
// compared against (tests/parity/llama_cpp_tokenize.py).
//
//   llama_tokenize_ref MODEL.gguf          JSON lines in, JSON lines out
//   llama_tokenize_ref MODEL.gguf --info   one JSON object about the vocabulary
//
// Each input line is one of
//   {"text": STR, "add_special": BOOL, "parse_special": BOOL}   (flags default false)
//   {"ids": [INT...]}
// and each output line, flushed at once, is
//   {"ids": [...], "text": STR, "text_special": STR}
// where ids is llama_tokenize(text, add_special, parse_special) (or the ids
// given), text is llama_detokenize(ids, remove_special=false,
// unparse_special=false) (control tokens render as nothing) and text_special
// the same with unparse_special=true. Bytes that are not UTF-8 in the
// detokenized text come out as U+FFFD. A line that is neither form, or an id
// outside the vocabulary, ends the program with status 2; a model that does
// not load, with status 1.
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "llama.h"

namespace {

using json = nlohmann::json;

// Only llama.cpp's errors reach stderr; its loading chatter would drown them.
void LogErrorsOnly(ggml_log_level level, const char* text, void* /*user_data*/) {
  if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

std::vector<llama_token> Tokenize(const llama_vocab* vocab, const std::string& text,
                                  bool add_special, bool parse_special) {
  // llama_tokenize returns minus the count it needs when the buffer is short.
  std::vector<llama_token> ids(text.size() + 8);
  int32_t n = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), ids.data(),
                             static_cast<int32_t>(ids.size()), add_special, parse_special);
  if (n < 0 && n != INT32_MIN) {
    ids.resize(static_cast<size_t>(-n));
    n = llama_tokenize(vocab, text.data(), static_cast<int32_t>(text.size()), ids.data(),
                       static_cast<int32_t>(ids.size()), add_special, parse_special);
  }
  ids.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return ids;
}

std::string Detokenize(const llama_vocab* vocab, const std::vector<llama_token>& ids,
                       bool unparse_special) {
  std::string text(ids.size() * 8 + 16, '\0');
  int32_t n = llama_detokenize(vocab, ids.data(), static_cast<int32_t>(ids.size()), text.data(),
                               static_cast<int32_t>(text.size()), /*remove_special=*/false,
                               unparse_special);
  if (n < 0) {
    text.resize(static_cast<size_t>(-n));
    n = llama_detokenize(vocab, ids.data(), static_cast<int32_t>(ids.size()), text.data(),
                         static_cast<int32_t>(text.size()), false, unparse_special);
  }
  text.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return text;
}

// Fills *ids from one input line: the text's tokens, or the ids it lists
// (each checked against the vocabulary, which llama_detokenize does not do).
bool ParseRequest(const json& in, const llama_vocab* vocab, std::vector<llama_token>* ids) {
  if (!in.is_object()) return false;
  if (in.contains("text") && in["text"].is_string()) {
    const bool add_special = in.contains("add_special") && in["add_special"] == true;
    const bool parse_special = in.contains("parse_special") && in["parse_special"] == true;
    *ids = Tokenize(vocab, in["text"].get<std::string>(), add_special, parse_special);
    return true;
  }
  if (!in.contains("ids") || !in["ids"].is_array()) return false;
  const int32_t n_tokens = llama_vocab_n_tokens(vocab);
  for (const json& id : in["ids"]) {
    if (!id.is_number_integer()) return false;
    const int64_t v = id.get<int64_t>();
    if (v < 0 || v >= n_tokens) return false;
    ids->push_back(static_cast<llama_token>(v));
  }
  return true;
}

json Info(const llama_vocab* vocab) {
  return {{"n_tokens", llama_vocab_n_tokens(vocab)},
          {"type", static_cast<int>(llama_vocab_type(vocab))},
          {"bos", llama_vocab_bos(vocab)},
          {"eos", llama_vocab_eos(vocab)},
          {"add_bos", llama_vocab_get_add_bos(vocab)},
          {"add_eos", llama_vocab_get_add_eos(vocab)}};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3 || (argc == 3 && std::string(argv[2]) != "--info")) {
    std::fprintf(stderr, "usage: %s MODEL.gguf [--info] < texts.jsonl\n", argv[0]);
    return 2;
  }
  llama_log_set(LogErrorsOnly, nullptr);
  llama_backend_init();
  llama_model_params params = llama_model_default_params();
  params.vocab_only = true;
  llama_model* model = llama_model_load_from_file(argv[1], params);
  if (model == nullptr) {
    std::fprintf(stderr, "llama_tokenize_ref: cannot load %s\n", argv[1]);
    return 1;
  }
  const llama_vocab* vocab = llama_model_get_vocab(model);
  constexpr auto kReplace = json::error_handler_t::replace;

  int status = 0;
  if (argc == 3) {
    std::cout << Info(vocab).dump(-1, ' ', false, kReplace) << '\n';
  } else {
    std::string line;
    while (std::getline(std::cin, line)) {
      json in = json::parse(line, nullptr, /*allow_exceptions=*/false);
      std::vector<llama_token> ids;
      if (!ParseRequest(in, vocab, &ids)) {
        std::fprintf(stderr, "llama_tokenize_ref: not {\"text\": ...} or {\"ids\": [...]}: %s\n",
                     line.c_str());
        status = 2;
        break;
      }
      json out = {{"ids", ids},
                  {"text", Detokenize(vocab, ids, false)},
                  {"text_special", Detokenize(vocab, ids, true)}};
      std::cout << out.dump(-1, ' ', false, kReplace) << '\n' << std::flush;
    }
  }
  llama_model_free(model);
  llama_backend_free();
  return status;
}
