#include "kdn/text/tokenizer.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace kdn::text {

using nlohmann::json;

char32_t ByteToUnicode(uint8_t b) {
  // Printable Latin-1 bytes map to themselves; the rest to 256 + k in order.
  auto printable = [](int c) {
    return (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
  };
  if (printable(b)) return b;
  int k = 0;
  for (int c = 0; c < b; ++c) {
    if (!printable(c)) ++k;
  }
  return static_cast<char32_t>(256 + k);
}

namespace {

std::string Utf8(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (c >> 6)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xE0 | (c >> 12)));
    s.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
  return s;
}

Result<json> ReadJson(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return NotFound(path.string() + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded()) return InvalidArgument(path.string() + ": not valid JSON");
  return j;
}

// The largest token id taken: the id -> byte table is sized by the largest
// id, so a file must not make it any size it likes (the largest
// vocabularies in use are a few hundred thousand).
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

// Whether `v` is a token id: an integer in [0, kMaxTokenId].
bool IsTokenId(const json& v) {
  return v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= kMaxTokenId;
}

// The id of a special token given by its content in tokenizer_config.json
// (a string, or an object with "content"), looked up in added_tokens
// (whose ids Load has checked).
int32_t SpecialId(const json& cfg, const char* key, const json& tok) {
  if (!cfg.is_object() || !cfg.contains(key)) return -1;
  const json& v = cfg.at(key);
  std::string content;
  if (v.is_string()) content = v.get<std::string>();
  else if (v.is_object() && v.contains("content") && v.at("content").is_string()) content = v.at("content").get<std::string>();
  else return -1;
  if (tok.contains("added_tokens") && tok.at("added_tokens").is_array()) {
    for (const json& a : tok.at("added_tokens")) {
      if (a.value("content", std::string()) == content && a.contains("id")) return a.at("id").get<int32_t>();
    }
  }
  return -1;
}

}  // namespace

ByteTokenizer::ByteTokenizer(std::vector<int32_t> byte_ids, int vocab_size, int32_t bos, int32_t eos)
    : byte_ids_(std::move(byte_ids)), id_to_byte_(vocab_size, -1), vocab_size_(vocab_size),
      bos_(bos), eos_(eos) {
  for (int b = 0; b < 256; ++b) id_to_byte_[byte_ids_[b]] = static_cast<int16_t>(b);
}

std::vector<int32_t> ByteTokenizer::Encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() + 1);
  if (add_bos && bos_ >= 0) ids.push_back(bos_);
  for (unsigned char ch : text) ids.push_back(byte_ids_[ch]);
  return ids;
}

std::string ByteTokenizer::Decode(std::span<const int32_t> ids) const {
  std::string s;
  s.reserve(ids.size());
  for (int32_t id : ids) {
    if (id >= 0 && id < vocab_size_ && id_to_byte_[id] >= 0) s.push_back(static_cast<char>(id_to_byte_[id]));
  }
  return s;
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::filesystem::path& dir) {
  const auto path = dir / "tokenizer.json";
  KDN_ASSIGN_OR_RETURN(json tok, ReadJson(path));
  // Fields are read with at(), never const operator[] (undefined behaviour
  // for a missing key): a file without them is malformed, not a crash.
  try {
    if (!tok.is_object()) return InvalidArgument(path.string() + ": not a JSON object");
    const json& model = tok.at("model");
    const bool byte_level = tok.contains("pre_tokenizer") && tok.at("pre_tokenizer").is_object() &&
                            tok.at("pre_tokenizer").value("type", "") == "ByteLevel";
    if (!model.is_object() || model.value("type", "") != "BPE" || !byte_level ||
        !model.at("merges").empty()) {
      return Unimplemented(path.string() +
                           ": only byte-level tokenizers (BPE without merges over the ByteLevel "
                           "alphabet) are supported so far");
    }
    const json& vocab = model.at("vocab");
    if (!vocab.is_object()) return InvalidArgument(path.string() + ": model.vocab is not an object");
    auto bad_id = [&](const std::string& what) {
      return InvalidArgument(path.string() + ": the id of " + what + " is not an integer in [0, " +
                             std::to_string(kMaxTokenId) + "]");
    };
    std::vector<int32_t> byte_ids(256, -1);
    int vocab_size = 0;
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      if (!IsTokenId(*it)) return bad_id("token \"" + it.key() + "\"");
      vocab_size = std::max(vocab_size, it->get<int>() + 1);
    }
    if (tok.contains("added_tokens")) {
      for (const json& a : tok.at("added_tokens")) {
        if (!a.is_object() || !a.contains("id") || !IsTokenId(a.at("id"))) return bad_id("an added token");
        vocab_size = std::max(vocab_size, a.at("id").get<int>() + 1);
      }
    }
    // Two bytes with one id could not be told apart by Decode.
    std::vector<bool> taken(vocab_size, false);
    for (int b = 0; b < 256; ++b) {
      auto it = vocab.find(Utf8(ByteToUnicode(static_cast<uint8_t>(b))));
      if (it == vocab.end()) {
        return InvalidArgument(path.string() + ": byte " + std::to_string(b) + " has no token");
      }
      byte_ids[b] = it->get<int32_t>();
      if (taken[byte_ids[b]]) {
        return InvalidArgument(path.string() + ": byte " + std::to_string(b) + " has the id " +
                               std::to_string(byte_ids[b]) + " of another byte");
      }
      taken[byte_ids[b]] = true;
    }
    int32_t bos = -1, eos = -1;
    auto cfg = ReadJson(dir / "tokenizer_config.json");
    if (cfg.ok()) {
      bos = SpecialId(*cfg, "bos_token", tok);
      eos = SpecialId(*cfg, "eos_token", tok);
    }
    // Decode leaves special tokens out: one with a byte's id would be shown.
    for (const auto& [name, id] : {std::pair{"BOS", bos}, std::pair{"EOS", eos}}) {
      if (id >= 0 && taken[id]) {
        return InvalidArgument(path.string() + ": the " + name + " token has the id " +
                               std::to_string(id) + " of a byte");
      }
    }
    return std::unique_ptr<Tokenizer>(new ByteTokenizer(std::move(byte_ids), vocab_size, bos, eos));
  } catch (const json::exception& e) {
    return InvalidArgument(path.string() + ": malformed: " + e.what());
  }
}

std::string ByteTokenizerJson() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[Utf8(ByteToUnicode(static_cast<uint8_t>(b)))] = b;
  auto added = [](int id, const char* content) {
    return json{{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  json j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", {added(256, "<s>"), added(257, "</s>")}},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"post_processor", nullptr},
      {"decoder",
       {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
        {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
        {"vocab", vocab}, {"merges", json::array()}}},
  };
  return j.dump(2) + "\n";
}

std::string ByteTokenizerConfigJson() {
  json j = {{"tokenizer_class", "PreTrainedTokenizerFast"},
            {"bos_token", "<s>"},
            {"eos_token", "</s>"},
            {"add_bos_token", true},
            {"clean_up_tokenization_spaces", false},
            {"model_max_length", 1000000}};
  return j.dump(2) + "\n";
}

}  // namespace kdn::text
