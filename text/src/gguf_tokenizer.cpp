#include "gguf_tokenizer.h"

#include <algorithm>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

namespace kdn::text {

using nlohmann::json;

namespace {

// llama.cpp's token types (tokenizer.ggml.token_type).
constexpr int64_t kUnknown = 2, kControl = 3, kUserDefined = 4;
constexpr size_t kMaxMergedPieceBytes = 256;

// GPT-2's regex, which several pre-tokenizers share.
constexpr const char* kGpt2Regex =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)";
constexpr const char* kLlama3Regex =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2Regex =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

json AddedToken(int64_t id, const std::string& content, bool special) {
  return {{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", false}, {"special", special}};
}

// transformers' SentencePieceExtractor (4.44): every split of a token into
// two tokens is a merge, ranked by the whole token's score (highest first),
// ties by the pieces' ids.
json SentencePieceMerges(const std::vector<std::string>& tokens,
                         const std::vector<double>& scores) {
  std::unordered_map<std::string, int64_t> id;
  for (size_t i = 0; i < tokens.size(); ++i) id.emplace(tokens[i], static_cast<int64_t>(i));
  struct Merge {
    int64_t left, right;
    double score;
  };
  std::vector<Merge> merges;
  for (size_t t = 0; t < tokens.size(); ++t) {
    const std::string& piece = tokens[t];
    // Each split costs the piece's length, so a hostile megabyte-long token
    // would cost its length squared. Real sentencepiece pieces are tens of
    // bytes; one over kMaxMergedPieceBytes is never built from two pieces.
    if (piece.size() > kMaxMergedPieceBytes) continue;
    std::vector<Merge> local;
    for (size_t k = 1; k < piece.size(); ++k) {
      auto l = id.find(piece.substr(0, k));
      auto r = id.find(piece.substr(k));
      if (l != id.end() && r != id.end()) local.push_back({l->second, r->second, scores[t]});
    }
    std::sort(local.begin(), local.end(), [](const Merge& a, const Merge& b) {
      return a.left != b.left ? a.left < b.left : a.right < b.right;
    });
    merges.insert(merges.end(), local.begin(), local.end());
  }
  std::stable_sort(merges.begin(), merges.end(),
                   [](const Merge& a, const Merge& b) { return a.score > b.score; });
  json out = json::array();
  for (const Merge& m : merges) out.push_back(tokens[m.left] + " " + tokens[m.right]);
  return out;
}

json Bpe(json vocab, json merges) {
  return {{"type", "BPE"},
          {"dropout", nullptr},
          {"unk_token", nullptr},
          {"continuing_subword_prefix", nullptr},
          {"end_of_word_suffix", nullptr},
          {"fuse_unk", false},
          {"byte_fallback", false},
          {"ignore_merges", false},
          {"vocab", std::move(vocab)},
          {"merges", std::move(merges)}};
}

}  // namespace

bool LlamaCppPreTokenizer(const std::string& pre, std::vector<std::string>* regexes,
                          bool* ignore_merges, bool* add_bos) {
  *ignore_merges = false;
  *add_bos = false;
  static const std::vector<std::string> kLlama3 = {"llama3", "llama-v3", "llama-bpe", "falcon3",
                                                   "pixtral"};
  static const std::vector<std::string> kStarcoder = {"starcoder", "refact",    "command-r",
                                                      "smollm",    "codeshell", "minerva-7b"};
  static const std::vector<std::string> kGpt2 = {"gpt-2", "phi-2", "mpt", "olmo", "jais"};
  static const std::vector<std::string> kQwen2 = {"qwen2", "stablelm2", "megrez",
                                                  "deepseek-r1-qwen"};
  auto in = [&](const std::vector<std::string>& names) {
    return std::find(names.begin(), names.end(), pre) != names.end();
  };
  if (pre.empty() || pre == "default") {
    *regexes = {"[\\p{P}\\$\\+<=>\\^~\\|]+", kGpt2Regex, "\\p{N}+", "[0-9][0-9][0-9]"};
  } else if (in(kLlama3)) {
    *regexes = {kLlama3Regex};
    *ignore_merges = true;
    *add_bos = true;
  } else if (in(kStarcoder)) {
    *regexes = {"\\p{N}", kGpt2Regex};
  } else if (in(kGpt2)) {
    *regexes = {kGpt2Regex};
  } else if (in(kQwen2)) {
    *regexes = {kQwen2Regex};
  } else if (pre == "falcon") {
    *regexes = {"[\\p{P}\\$\\+<=>\\^~\\|`]+", kGpt2Regex, "[0-9][0-9][0-9]"};
  } else {
    return false;
  }
  return true;
}

Result<GgufTokenizerJson> TokenizerJsonFromGguf(const model::GgufFile& f) {
  KDN_ASSIGN_OR_RETURN(const std::string model, f.String("tokenizer.ggml.model"));
  KDN_ASSIGN_OR_RETURN(const std::vector<std::string> tokens, f.Strings("tokenizer.ggml.tokens"));
  std::vector<int64_t> types(tokens.size(), 1);
  if (f.Find("tokenizer.ggml.token_type") != nullptr) {
    KDN_ASSIGN_OR_RETURN(types, f.Ints("tokenizer.ggml.token_type"));
    if (types.size() != tokens.size()) {
      return InvalidArgument(f.Where("tokenizer.ggml.token_type has " +
                                     std::to_string(types.size()) + " entries for " +
                                     std::to_string(tokens.size()) + " tokens"));
    }
  }
  auto token_of = [&](const char* key) -> Result<json> {
    KDN_ASSIGN_OR_RETURN(const int64_t id, model::GgufTokenId(f, key));
    if (id < 0 || id >= static_cast<int64_t>(tokens.size())) {
      // A default the vocabulary does not reach means none; a key, an error.
      if (f.Find(key) == nullptr) return json(nullptr);
      return InvalidArgument(f.Where(std::string(key) + " " + std::to_string(id) +
                                     " is not a token id (" + std::to_string(tokens.size()) +
                                     " tokens)"));
    }
    return json(tokens[static_cast<size_t>(id)]);
  };

  GgufTokenizerJson out;
  json& tok = out.tokenizer;
  tok = {{"version", "1.0"},
         {"truncation", nullptr},
         {"padding", nullptr},
         {"normalizer", nullptr},
         {"post_processor", nullptr}};
  json added = json::array();
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (types[i] == kControl || types[i] == kUnknown || types[i] == kUserDefined) {
      added.push_back(AddedToken(static_cast<int64_t>(i), tokens[i], types[i] != kUserDefined));
    }
  }
  tok["added_tokens"] = std::move(added);
  json vocab = json::object();
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!vocab.contains(tokens[i])) vocab[tokens[i]] = i;
  }

  bool add_bos = false;
  if (model == "gpt2") {
    std::string pre;
    if (f.Find("tokenizer.ggml.pre") != nullptr) {
      KDN_ASSIGN_OR_RETURN(pre, f.String("tokenizer.ggml.pre"));
    }
    std::vector<std::string> regexes;
    bool ignore_merges = false;
    if (!LlamaCppPreTokenizer(pre, &regexes, &ignore_merges, &add_bos)) {
      return Unimplemented(
          f.Where("tokenizer.ggml.pre \"" + pre +
                  "\" is not supported (default, llama-bpe, qwen2, gpt-2, "
                  "smollm, falcon and the names llama.cpp gives the same regexes)"));
    }
    json steps = json::array();
    for (const std::string& r : regexes) {
      steps.push_back({{"type", "Split"},
                       {"pattern", {{"Regex", r}}},
                       {"behavior", "Isolated"},
                       {"invert", false}});
    }
    steps.push_back({{"type", "ByteLevel"},
                     {"add_prefix_space", false},
                     {"trim_offsets", false},
                     {"use_regex", false}});
    tok["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", std::move(steps)}};
    tok["decoder"] = {{"type", "ByteLevel"},
                      {"add_prefix_space", false},
                      {"trim_offsets", false},
                      {"use_regex", false}};
    KDN_ASSIGN_OR_RETURN(const std::vector<std::string> merges, f.Strings("tokenizer.ggml.merges"));
    tok["model"] = Bpe(std::move(vocab), merges);
    tok["model"]["ignore_merges"] = ignore_merges;
  } else if (model == "llama") {
    KDN_ASSIGN_OR_RETURN(const std::vector<double> scores, f.Floats("tokenizer.ggml.scores"));
    if (scores.size() != tokens.size()) {
      return InvalidArgument(f.Where("tokenizer.ggml.scores has " + std::to_string(scores.size()) +
                                     " entries for " + std::to_string(tokens.size()) + " tokens"));
    }
    bool space_prefix = true;
    if (f.Find("tokenizer.ggml.add_space_prefix") != nullptr) {
      KDN_ASSIGN_OR_RETURN(space_prefix, f.Bool("tokenizer.ggml.add_space_prefix"));
    }
    const std::string kSpace = "\xE2\x96\x81";  // U+2581, sentencepiece's space
    json normalizers = json::array();
    if (space_prefix) normalizers.push_back({{"type", "Prepend"}, {"prepend", kSpace}});
    normalizers.push_back(
        {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kSpace}});
    tok["normalizer"] = {{"type", "Sequence"}, {"normalizers", std::move(normalizers)}};
    tok["pre_tokenizer"] = nullptr;
    json decoders = {{{"type", "Replace"}, {"pattern", {{"String", kSpace}}}, {"content", " "}},
                     {{"type", "ByteFallback"}},
                     {{"type", "Fuse"}}};
    if (space_prefix) {
      decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1u}, {"stop", 0u}});
    }
    tok["decoder"] = {{"type", "Sequence"}, {"decoders", std::move(decoders)}};
    KDN_ASSIGN_OR_RETURN(json unk, token_of("tokenizer.ggml.unknown_token_id"));
    tok["model"] = Bpe(std::move(vocab), SentencePieceMerges(tokens, scores));
    tok["model"]["unk_token"] = unk;
    tok["model"]["fuse_unk"] = true;
    tok["model"]["byte_fallback"] = true;
    add_bos = true;
  } else {
    return Unimplemented(
        f.Where("tokenizer.ggml.model \"" + model + "\" is not supported (gpt2, llama)"));
  }
  if (f.Find("tokenizer.ggml.add_bos_token") != nullptr) {
    KDN_ASSIGN_OR_RETURN(add_bos, f.Bool("tokenizer.ggml.add_bos_token"));
  }
  KDN_ASSIGN_OR_RETURN(json bos, token_of("tokenizer.ggml.bos_token_id"));
  KDN_ASSIGN_OR_RETURN(json eos, token_of("tokenizer.ggml.eos_token_id"));
  out.config = {
      {"bos_token", bos}, {"eos_token", eos}, {"add_bos_token", add_bos && !bos.is_null()}};
  return out;
}

}  // namespace kdn::text
