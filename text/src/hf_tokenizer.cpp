#include "hf_tokenizer.h"

#include <algorithm>

#include <utf8proc.h>

#include "utf8.h"

namespace kdn::text {

using nlohmann::json;

namespace {

// Rust regex's \w, which `tokenizers` uses for single_word: alphabetic,
// marks, decimal digits, connector punctuation, joiners.
bool IsWordChar(char32_t c) {
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC: return true;
    default: return false;
  }
}

// The start of the character that ends at s[end - 1]; -1 when `end` is 0.
// Returns its code point in *c (U+FFFD for an invalid byte).
size_t LastChar(std::string_view s, size_t end, char32_t* c) {
  size_t b = end - 1;
  while (b > 0 && end - b < 4 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  const size_t len = CharLength(s, b);
  if (b + len != end) {  // not a whole character: the last byte alone
    *c = 0xFFFD;
    return end - 1;
  }
  *c = DecodeChar(s, b, len);
  return b;
}

// tokenizer_config.json's bos_token / eos_token: a string or {"content": s}.
std::string SpecialContent(const json& cfg, const char* key) {
  if (!cfg.is_object() || !cfg.contains(key)) return "";
  const json& v = cfg.at(key);
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v.at("content").is_string()) {
    return v.at("content").get<std::string>();
  }
  return "";
}

Result<bool> Flag(const json& a, const char* key, bool dflt, const std::string& where) {
  if (!a.contains(key)) return dflt;
  if (!a.at(key).is_boolean()) return InvalidArgument(where + "." + key + " is not a boolean");
  return a.at(key).get<bool>();
}

class HfDecodeStream final : public DecodeStream {
 public:
  explicit HfDecodeStream(const HfTokenizer& t) : t_(t), st_(t.decoder().NewState()) {}
  std::string Next(int32_t id) override {
    std::string out;
    if (const std::string* s = t_.DecodeString(id)) t_.decoder().Push(*st_, *s, &out);
    return out;
  }
  std::string Finish() override {
    std::string out;
    t_.decoder().Finish(*st_, &out);
    return out;
  }

 private:
  const HfTokenizer& t_;
  std::unique_ptr<Decoder::State> st_;
};

}  // namespace

Status HfTokenizer::LoadAdded(const json& tok, const std::string& file) {
  if (!tok.contains("added_tokens") || tok.at("added_tokens").is_null()) return Status::Ok();
  const json& list = tok.at("added_tokens");
  if (!list.is_array()) return InvalidArgument(file + ": added_tokens is not an array");
  for (size_t i = 0; i < list.size(); ++i) {
    const json& a = list[i];
    const std::string where = file + ": added_tokens[" + std::to_string(i) + "]";
    if (!a.is_object()) return InvalidArgument(where + " is not an object");
    if (!a.contains("id") || !IsTokenId(a.at("id"))) {
      return InvalidArgument(where + ".id is not an integer in [0, " + std::to_string(kMaxTokenId) +
                             "]");
    }
    if (!a.contains("content") || !a.at("content").is_string() ||
        a.at("content").get<std::string>().empty()) {
      return InvalidArgument(where + ".content is not a non-empty string");
    }
    Added t;
    t.content = a.at("content").get<std::string>();
    t.id = a.at("id").get<int32_t>();
    KDN_ASSIGN_OR_RETURN(t.special, Flag(a, "special", false, where));
    KDN_ASSIGN_OR_RETURN(t.lstrip, Flag(a, "lstrip", false, where));
    KDN_ASSIGN_OR_RETURN(t.rstrip, Flag(a, "rstrip", false, where));
    KDN_ASSIGN_OR_RETURN(t.single_word, Flag(a, "single_word", false, where));
    KDN_ASSIGN_OR_RETURN(t.normalized, Flag(a, "normalized", true, where));
    // An added token may repeat a vocabulary token (Llama 2's <s>), but one
    // that took another token's id would make that token's text undecodable.
    if (model_->has_token(t.id) && model_->tokens()[t.id] != t.content) {
      return InvalidArgument(where + ": id " + std::to_string(t.id) +
                             " is the vocabulary's token \"" + model_->tokens()[t.id] +
                             "\", not \"" + t.content + "\"");
    }
    if (static_cast<size_t>(t.id) >= added_by_id_.size()) added_by_id_.resize(t.id + 1, -1);
    if (added_by_id_[t.id] >= 0) {
      return InvalidArgument(where + ": id " + std::to_string(t.id) +
                             " is taken by another added token");
    }
    added_by_id_[t.id] = static_cast<int32_t>(added_.size());
    t.match = t.normalized && normalizer_ ? normalizer_->Apply(t.content) : t.content;
    added_.push_back(std::move(t));
  }
  for (size_t i = 0; i < added_.size(); ++i) {
    const Added& t = added_[i];
    if (t.match.empty()) continue;
    Matcher& m = t.normalized ? normalized_matcher_ : raw_matcher_;
    m.by_byte[static_cast<unsigned char>(t.match[0])].push_back(static_cast<int>(i));
    m.empty = false;
  }
  for (Matcher* m : {&raw_matcher_, &normalized_matcher_}) {
    for (auto& list : m->by_byte) {
      std::stable_sort(list.begin(), list.end(), [&](int a, int b) {
        return added_[a].match.size() > added_[b].match.size();
      });
    }
  }
  return Status::Ok();
}

Status HfTokenizer::LoadPostProcessor(const json& j, const std::string& where) {
  if (j.is_null()) return Status::Ok();
  if (!j.is_object() || !j.contains("type") || !j.at("type").is_string()) {
    return InvalidArgument(where + " has no \"type\"");
  }
  const std::string type = j.at("type").get<std::string>();
  if (type == "Sequence") {
    if (!j.contains("processors") || !j.at("processors").is_array()) {
      return InvalidArgument(where + ".processors is not an array");
    }
    const json& list = j.at("processors");
    for (size_t i = 0; i < list.size(); ++i) {
      KDN_RETURN_IF_ERROR(
          LoadPostProcessor(list[i], where + ".processors[" + std::to_string(i) + "]"));
    }
    return Status::Ok();
  }
  if (type == "ByteLevel") return Status::Ok();  // it only trims offsets
  if (type != "TemplateProcessing") {
    return Unimplemented(where + ": the post-processor type \"" + type + "\" is not supported");
  }
  if (has_template_) return Unimplemented(where + ": a second TemplateProcessing is not supported");
  has_template_ = true;
  if (!j.contains("single") || !j.at("single").is_array()) {
    return InvalidArgument(where + ".single is not an array");
  }
  const json& specials = j.contains("special_tokens") ? j.at("special_tokens") : json::object();
  if (!specials.is_object()) return InvalidArgument(where + ".special_tokens is not an object");
  bool seen_a = false;
  const json& single = j.at("single");
  for (size_t i = 0; i < single.size(); ++i) {
    const json& item = single[i];
    const std::string at = where + ".single[" + std::to_string(i) + "]";
    if (item.is_object() && item.contains("Sequence")) {
      if (seen_a) return Unimplemented(at + ": a second sequence in the template is not supported");
      seen_a = true;
      continue;
    }
    if (!item.is_object() || !item.contains("SpecialToken") ||
        !item.at("SpecialToken").is_object() || !item.at("SpecialToken").contains("id") ||
        !item.at("SpecialToken").at("id").is_string()) {
      return InvalidArgument(at + " is neither a Sequence nor a SpecialToken with an id");
    }
    const std::string name = item.at("SpecialToken").at("id").get<std::string>();
    if (!specials.contains(name) || !specials.at(name).is_object() ||
        !specials.at(name).contains("ids") || !specials.at(name).at("ids").is_array()) {
      return InvalidArgument(at + ": special token \"" + name + "\" has no ids in special_tokens");
    }
    for (const json& id : specials.at(name).at("ids")) {
      if (!IsTokenId(id)) {
        return InvalidArgument(where + ".special_tokens[\"" + name + "\"].ids holds a non-id");
      }
      (seen_a ? suffix_ids_ : prefix_ids_).push_back(id.get<int32_t>());
    }
  }
  if (!seen_a) return InvalidArgument(where + ".single has no Sequence");
  return Status::Ok();
}

Result<std::unique_ptr<HfTokenizer>> HfTokenizer::FromJson(const json& tok, const json& config,
                                                           const std::string& file) {
  if (!tok.is_object()) return InvalidArgument(file + ": not a JSON object");
  std::unique_ptr<HfTokenizer> t(new HfTokenizer());
  auto field = [&](const char* key) -> const json& {
    static const json kNull;
    return tok.contains(key) ? tok.at(key) : kNull;
  };
  KDN_ASSIGN_OR_RETURN(t->normalizer_,
                       Normalizer::FromJson(field("normalizer"), file + ": normalizer"));
  KDN_ASSIGN_OR_RETURN(t->pre_tokenizer_,
                       PreTokenizer::FromJson(field("pre_tokenizer"), file + ": pre_tokenizer"));
  if (!tok.contains("model")) return InvalidArgument(file + ": no model");
  KDN_ASSIGN_OR_RETURN(
      t->model_,
      BpeModel::FromJson(tok.at("model"), t->pre_tokenizer_->byte_level(), file + ": model"));
  KDN_ASSIGN_OR_RETURN(t->decoder_, Decoder::FromJson(field("decoder"), file + ": decoder"));
  KDN_RETURN_IF_ERROR(t->LoadAdded(tok, file));
  KDN_RETURN_IF_ERROR(t->LoadPostProcessor(field("post_processor"), file + ": post_processor"));

  t->vocab_size_ = static_cast<int>(std::max(t->model_->tokens().size(), t->added_by_id_.size()));
  if (t->vocab_size_ == 0) return InvalidArgument(file + ": the vocabulary is empty");
  auto id_of = [&](const std::string& content) -> int32_t {
    if (content.empty()) return -1;
    for (const Added& a : t->added_) {
      if (a.content == content) return a.id;
    }
    auto it = t->model_->vocab().find(content);
    return it == t->model_->vocab().end() ? -1 : it->second;
  };
  t->bos_ = id_of(SpecialContent(config, "bos_token"));
  t->eos_ = id_of(SpecialContent(config, "eos_token"));
  if (config.is_object() && config.contains("add_bos_token") &&
      config.at("add_bos_token").is_boolean()) {
    t->add_bos_token_ = config.at("add_bos_token").get<bool>();
  }
  if (!t->has_template_ && t->add_bos_token_ && t->bos_ >= 0) t->prefix_ids_ = {t->bos_};
  for (int32_t id : t->prefix_ids_) {
    if (id >= t->vocab_size_)
      return InvalidArgument(file + ": post_processor adds id " + std::to_string(id) +
                             ", outside the vocabulary");
  }
  for (int32_t id : t->suffix_ids_) {
    if (id >= t->vocab_size_)
      return InvalidArgument(file + ": post_processor adds id " + std::to_string(id) +
                             ", outside the vocabulary");
  }
  return t;
}

const std::string* HfTokenizer::DecodeString(int32_t id) const {
  if (id < 0) return nullptr;
  if (static_cast<size_t>(id) < added_by_id_.size() && added_by_id_[id] >= 0) {
    const Added& a = added_[added_by_id_[id]];
    return a.special ? nullptr : &a.content;
  }
  return model_->has_token(id) ? &model_->tokens()[id] : nullptr;
}

std::vector<HfTokenizer::Piece> HfTokenizer::FindAdded(std::string_view text,
                                                       const Matcher& m) const {
  std::vector<Piece> out;
  const size_t n = text.size();
  if (m.empty) {
    if (n > 0) out.push_back({0, n, -1});
    return out;
  }
  size_t done = 0;  // the end of the last piece
  for (size_t pos = 0; pos < n;) {
    // Leftmost-longest, as the Aho-Corasick automaton of `tokenizers` finds
    // them; a match dropped by single_word is still passed over.
    int hit = -1;
    for (int i : m.by_byte[static_cast<unsigned char>(text[pos])]) {
      const std::string& c = added_[i].match;
      if (text.compare(pos, c.size(), c) == 0) {
        hit = i;
        break;
      }
    }
    if (hit < 0) {
      ++pos;
      continue;
    }
    const Added& a = added_[hit];
    size_t s = pos, e = pos + a.match.size();
    pos = e;
    if (a.single_word) {
      char32_t c;
      const bool start_ok = s == 0 || (LastChar(text, s, &c), !IsWordChar(c));
      bool end_ok = e == n;
      if (!end_ok) {
        const size_t len = CharLength(text, e);
        end_ok = !IsWordChar(len == 1 && static_cast<unsigned char>(text[e]) >= 0x80
                                 ? 0xFFFD
                                 : DecodeChar(text, e, len));
      }
      if (!start_ok || !end_ok) continue;
    }
    if (a.lstrip) {
      size_t b = s;
      while (b > done) {
        char32_t c;
        const size_t prev = LastChar(text, b, &c);
        if (!IsWhiteSpace(c)) break;
        b = prev;
      }
      s = std::max(b, done);
    }
    if (a.rstrip) {
      while (e < n) {
        const size_t len = CharLength(text, e);
        if (!(len > 1 || static_cast<unsigned char>(text[e]) < 0x80) ||
            !IsWhiteSpace(DecodeChar(text, e, len))) {
          break;
        }
        e += len;
      }
      pos = std::max(pos, e);  // what rstrip took is not searched again
    }
    if (done < s) out.push_back({done, s, -1});
    out.push_back({s, e, hit});
    done = e;
  }
  if (done < n) out.push_back({done, n, -1});
  return out;
}

void HfTokenizer::EncodeText(std::string_view text, bool at_start, BpeModel::Scratch& scratch,
                             std::vector<int32_t>* ids) const {
  Words words;
  pre_tokenizer_->Run(text, at_start, &words);
  for (const Words::Range& r : words.list) model_->Tokenize(words.Get(r), scratch, ids);
}

std::vector<int32_t> HfTokenizer::Encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_bos) ids.insert(ids.end(), prefix_ids_.begin(), prefix_ids_.end());
  auto scratch = BpeModel::NewScratch();
  for (const Piece& p : FindAdded(text, raw_matcher_)) {
    if (p.added >= 0) {
      ids.push_back(added_[p.added].id);
      continue;
    }
    const std::string_view raw = text.substr(p.begin, p.end - p.begin);
    const bool at_start = p.begin == 0;
    std::string normalized;
    std::string_view piece = raw;
    if (!normalizer_->empty()) {
      normalized = normalizer_->Apply(raw);
      piece = normalized;
    }
    for (const Piece& q : FindAdded(piece, normalized_matcher_)) {
      if (q.added >= 0) {
        ids.push_back(added_[q.added].id);
      } else {
        EncodeText(piece.substr(q.begin, q.end - q.begin), at_start && q.begin == 0, *scratch,
                   &ids);
      }
    }
  }
  if (add_bos) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  return ids;
}

std::unique_ptr<DecodeStream> HfTokenizer::NewDecodeStream() const {
  return std::make_unique<HfDecodeStream>(*this);
}

}  // namespace kdn::text
