#include "kdn/text/tokenizer.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gguf_tokenizer.h"
#include "hf_tokenizer.h"
#include "kdn/model/gguf.h"
#include "utf8.h"

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
  AppendUtf8(c, &s);
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

}  // namespace

ByteTokenizer::ByteTokenizer(std::vector<int32_t> byte_ids, int vocab_size, int32_t bos,
                             int32_t eos)
    : byte_ids_(std::move(byte_ids)),
      id_to_byte_(vocab_size, -1),
      vocab_size_(vocab_size),
      bos_(bos),
      eos_(eos) {
  for (int b = 0; b < 256; ++b) id_to_byte_[byte_ids_[b]] = static_cast<int16_t>(b);
}

std::vector<int32_t> ByteTokenizer::Encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() + 1);
  if (add_bos && bos_ >= 0) ids.push_back(bos_);
  for (unsigned char ch : text) ids.push_back(byte_ids_[ch]);
  return ids;
}

namespace {

// A ByteLevel decoder over kdn's byte ids: bytes as lossy UTF-8, an
// incomplete character held back.
class ByteDecodeStream final : public DecodeStream {
 public:
  explicit ByteDecodeStream(const std::vector<int16_t>& id_to_byte) : id_to_byte_(id_to_byte) {}
  std::string Next(int32_t id) override {
    std::string out;
    if (id < 0 || static_cast<size_t>(id) >= id_to_byte_.size() || id_to_byte_[id] < 0) return out;
    pending_.push_back(static_cast<char>(id_to_byte_[id]));
    pending_.erase(0, AppendUtf8Lossy(pending_, /*final=*/false, &out));
    return out;
  }
  std::string Finish() override {
    std::string out;
    AppendUtf8Lossy(pending_, /*final=*/true, &out);
    pending_.clear();
    return out;
  }

 private:
  const std::vector<int16_t>& id_to_byte_;
  std::string pending_;
};

}  // namespace

std::unique_ptr<DecodeStream> ByteTokenizer::NewDecodeStream() const {
  return std::make_unique<ByteDecodeStream>(id_to_byte_);
}

std::string Tokenizer::Decode(std::span<const int32_t> ids) const {
  auto stream = NewDecodeStream();
  std::string s;
  s.reserve(ids.size() * 4);
  for (int32_t id : ids) s += stream->Next(id);
  s += stream->Finish();
  return s;
}

std::optional<std::pair<int64_t, int64_t>> TokensHolding(const Tokenizer& tokenizer,
                                                         std::span<const int32_t> ids,
                                                         std::string_view needle) {
  if (needle.empty()) return std::nullopt;
  // ends[i]: the length of the text once token i's piece is out.
  auto stream = tokenizer.NewDecodeStream();
  std::string text;
  std::vector<size_t> ends;
  ends.reserve(ids.size());
  for (int32_t id : ids) {
    text += stream->Next(id);
    ends.push_back(text.size());
  }
  text += stream->Finish();
  if (!ends.empty()) ends.back() = text.size();
  const size_t at = text.find(needle);
  if (at == std::string::npos) return std::nullopt;
  const size_t last = at + needle.size();  // one past the needle's last byte
  const auto n = static_cast<int64_t>(ids.size());
  int64_t first = 0;
  while (first < n && ends[first] <= at) ++first;
  // Tokens before it whose piece came out with it (held back).
  while (first > 0 && (first == 1 ? 0 : ends[first - 2]) == ends[first - 1]) --first;
  int64_t end = first;
  while (end < n && ends[end] < last) ++end;
  return std::make_pair(first, std::min(end + 1, n));
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::filesystem::path& dir) {
  if (model::IsGgufPath(dir)) {
    KDN_ASSIGN_OR_RETURN(auto file, model::GgufFile::Open(dir));
    KDN_ASSIGN_OR_RETURN(GgufTokenizerJson j, TokenizerJsonFromGguf(*file));
    try {
      KDN_ASSIGN_OR_RETURN(auto t, HfTokenizer::FromJson(j.tokenizer, j.config,
                                                         dir.string() + " (tokenizer.ggml.*)"));
      return std::unique_ptr<Tokenizer>(std::move(t));
    } catch (const json::exception& e) {
      return InvalidArgument(dir.string() + ": tokenizer.ggml.*: " + e.what());
    }
  }
  const auto path = dir / "tokenizer.json";
  KDN_ASSIGN_OR_RETURN(json tok, ReadJson(path));
  json config;  // null when there is none
  if (std::filesystem::exists(dir / "tokenizer_config.json")) {
    KDN_ASSIGN_OR_RETURN(config, ReadJson(dir / "tokenizer_config.json"));
  }
  // Fields are read with at() after contains(), never const operator[]
  // (undefined behaviour for a missing key); what nlohmann still throws
  // (a number out of range) becomes InvalidArgument here.
  try {
    KDN_ASSIGN_OR_RETURN(auto t, HfTokenizer::FromJson(tok, config, path.string()));
    return std::unique_ptr<Tokenizer>(std::move(t));
  } catch (const json::exception& e) {
    return InvalidArgument(path.string() + ": malformed: " + e.what());
  }
}

std::string ByteTokenizerJson() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[Utf8(ByteToUnicode(static_cast<uint8_t>(b)))] = b;
  auto added = [](int id, const char* content) {
    return json{{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", true}};
  };
  json j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", {added(256, "<s>"), added(257, "</s>")}},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "ByteLevel"},
        {"add_prefix_space", false},
        {"trim_offsets", false},
        {"use_regex", false}}},
      {"post_processor", nullptr},
      {"decoder",
       {{"type", "ByteLevel"},
        {"add_prefix_space", false},
        {"trim_offsets", false},
        {"use_regex", false}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", json::array()}}},
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
