#include "bpe.h"

#include <algorithm>
#include <cstdio>

#include "kdn/text/tokenizer.h"
#include "utf8.h"

namespace kdn::text {

using nlohmann::json;

// Merge ranks by pair of ids: open addressing with linear probing, at most
// half full. A std::unordered_map costs a node and a pointer chase per
// lookup, and BPE looks up a pair for every symbol it merges.
struct BpeModel::MergeTable {
  struct Slot {
    uint64_t key = kEmpty;
    int32_t rank = 0;
    int32_t new_id = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  explicit MergeTable(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    slots.resize(cap);
    mask = cap - 1;
  }
  static uint64_t Key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  size_t Home(uint64_t key) const { return (key * 0x9E3779B97F4A7C15ull >> 20) & mask; }
  // Inserts or, like the HashMap `tokenizers` collects merges into,
  // overwrites: a later duplicate merge wins.
  void Put(int32_t a, int32_t b, int32_t rank, int32_t new_id) {
    const uint64_t key = Key(a, b);
    for (size_t i = Home(key);; i = (i + 1) & mask) {
      if (slots[i].key == kEmpty || slots[i].key == key) {
        slots[i] = {key, rank, new_id};
        return;
      }
    }
  }
  const Slot* Find(int32_t a, int32_t b) const {
    const uint64_t key = Key(a, b);
    for (size_t i = Home(key);; i = (i + 1) & mask) {
      if (slots[i].key == key) return &slots[i];
      if (slots[i].key == kEmpty) return nullptr;
    }
  }

  std::vector<Slot> slots;
  size_t mask;
};

std::unique_ptr<BpeModel::Scratch> BpeModel::NewScratch() { return std::make_unique<Scratch>(); }

BpeModel::~BpeModel() = default;

namespace {

// A nullable string field: "" when null or absent.
Result<std::string> OptString(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || j.at(key).is_null()) return std::string();
  if (!j.at(key).is_string()) return InvalidArgument(where + "." + key + " is not a string");
  return j.at(key).get<std::string>();
}

Result<bool> OptBool(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || j.at(key).is_null()) return false;
  if (!j.at(key).is_boolean()) return InvalidArgument(where + "." + key + " is not a boolean");
  return j.at(key).get<bool>();
}

}  // namespace

Result<std::unique_ptr<BpeModel>> BpeModel::FromJson(const json& j, bool byte_level,
                                                     const std::string& where) {
  if (!j.is_object()) return InvalidArgument(where + " is not an object");
  if (!j.contains("type") || !j.at("type").is_string()) {
    return InvalidArgument(where + " has no \"type\"");
  }
  if (j.at("type").get<std::string>() != "BPE") {
    return Unimplemented(where + ": the model type \"" + j.at("type").get<std::string>() +
                         "\" is not supported (only BPE)");
  }
  std::unique_ptr<BpeModel> m(new BpeModel());
  m->byte_level_ = byte_level;
  if (!j.contains("vocab") || !j.at("vocab").is_object()) {
    return InvalidArgument(where + ".vocab is not an object");
  }
  const json& vocab = j.at("vocab");
  int64_t max_id = -1;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (!IsTokenId(*it)) {
      return InvalidArgument(where + ".vocab: the id of token \"" + it.key() +
                             "\" is not an integer in [0, " + std::to_string(kMaxTokenId) + "]");
    }
    max_id = std::max(max_id, it->get<int64_t>());
  }
  m->tokens_.resize(max_id + 1);
  m->has_.assign(max_id + 1, false);
  m->vocab_.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const int32_t id = it->get<int32_t>();
    if (m->has_[id]) {
      // Decoding could not tell the two apart.
      return InvalidArgument(where + ".vocab: tokens \"" + m->tokens_[id] + "\" and \"" + it.key() +
                             "\" share the id " + std::to_string(id));
    }
    m->has_[id] = true;
    m->tokens_[id] = it.key();
    m->vocab_.emplace(it.key(), id);
  }

  KDN_ASSIGN_OR_RETURN(m->prefix_, OptString(j, "continuing_subword_prefix", where));
  KDN_ASSIGN_OR_RETURN(m->suffix_, OptString(j, "end_of_word_suffix", where));
  if (byte_level && (!m->prefix_.empty() || !m->suffix_.empty())) {
    return Unimplemented(where +
                         ": continuing_subword_prefix or end_of_word_suffix with the "
                         "ByteLevel pre-tokenizer is not supported");
  }
  KDN_ASSIGN_OR_RETURN(m->ignore_merges_, OptBool(j, "ignore_merges", where));
  KDN_ASSIGN_OR_RETURN(m->byte_fallback_, OptBool(j, "byte_fallback", where));
  KDN_ASSIGN_OR_RETURN(m->fuse_unk_, OptBool(j, "fuse_unk", where));
  if (j.contains("dropout") && !j.at("dropout").is_null() &&
      !(j.at("dropout").is_number() && j.at("dropout").get<double>() == 0.0)) {
    return Unimplemented(where + ".dropout: BPE dropout (random merges) is not supported");
  }
  KDN_ASSIGN_OR_RETURN(const std::string unk, OptString(j, "unk_token", where));
  if (!unk.empty()) {
    auto it = m->vocab_.find(unk);
    if (it == m->vocab_.end()) {
      return InvalidArgument(where + ".unk_token \"" + unk + "\" is not in the vocabulary");
    }
    m->unk_ = it->second;
  }

  if (!j.contains("merges") || !j.at("merges").is_array()) {
    return InvalidArgument(where + ".merges is not an array");
  }
  const json& merges = j.at("merges");
  m->merges_ = std::make_unique<MergeTable>(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const json& mj = merges[r];
    const std::string at = where + ".merges[" + std::to_string(r) + "]";
    std::string a, b;
    // "a b" (tokenizers before 0.20) or ["a", "b"].
    if (mj.is_string()) {
      const std::string s = mj.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        return InvalidArgument(at + " is not two tokens separated by one space");
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (mj.is_array() && mj.size() == 2 && mj[0].is_string() && mj[1].is_string()) {
      a = mj[0].get<std::string>();
      b = mj[1].get<std::string>();
    } else {
      return InvalidArgument(at + " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    if (b.compare(0, m->prefix_.size(), m->prefix_) != 0) {
      return InvalidArgument(at + ": \"" + b + "\" does not begin with continuing_subword_prefix");
    }
    const std::string merged = a + b.substr(m->prefix_.size());
    auto ia = m->vocab_.find(a), ib = m->vocab_.find(b), im = m->vocab_.find(merged);
    if (ia == m->vocab_.end() || ib == m->vocab_.end() || im == m->vocab_.end()) {
      return InvalidArgument(at + ": \"" +
                             (ia == m->vocab_.end()   ? a
                              : ib == m->vocab_.end() ? b
                                                      : merged) +
                             "\" is not in the vocabulary");
    }
    m->merges_->Put(ia->second, ib->second, static_cast<int32_t>(r), im->second);
  }

  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = m->vocab_.find(std::string_view(name));
    m->fallback_ids_[b] = it == m->vocab_.end() ? -1 : it->second;
    m->byte_chars_[b].clear();
    AppendUtf8(ByteToUnicode(static_cast<uint8_t>(b)), &m->byte_chars_[b]);
    auto bt = m->vocab_.find(m->byte_chars_[b]);
    m->byte_ids_[b] = bt == m->vocab_.end() ? -1 : bt->second;
  }
  // A sentencepiece text with no pre-tokenizer is one word, and merging a
  // word costs O(n log n) with poor locality. When no token has a "▁" after
  // another character, no merge can join the symbol ending before such a
  // "▁" to the one starting with it (its result would be such a token), so
  // the parts between those points merge alone to the same result, the
  // merges within each part being done in the same order. (With
  // ignore_merges a whole part found in the vocabulary would be taken as it
  // is, which the whole word would not; prefixes and suffixes change the
  // symbols' strings: neither is cut.)
  constexpr std::string_view kMeta = "\u2581";
  if (!byte_level && !m->ignore_merges_ && m->prefix_.empty() && m->suffix_.empty() &&
      m->vocab_.count(kMeta) != 0) {
    m->split_at_metaspace_ = true;
    for (const auto& [tok, id] : m->vocab_) {
      for (size_t at = tok.find(kMeta, 1); at != std::string::npos; at = tok.find(kMeta, at + 1)) {
        if (at < kMeta.size() || tok.compare(at - kMeta.size(), kMeta.size(), kMeta) != 0) {
          m->split_at_metaspace_ = false;
        }
      }
      if (!m->split_at_metaspace_) break;
    }
  }
  if (byte_level && m->ignore_merges_) {
    // Tokens of ByteLevel characters only, by their bytes.
    std::unordered_map<char32_t, uint8_t> char_byte;
    for (int b = 0; b < 256; ++b)
      char_byte[ByteToUnicode(static_cast<uint8_t>(b))] = static_cast<uint8_t>(b);
    for (const auto& [tok, id] : m->vocab_) {
      std::string raw;
      bool ok = true;
      for (size_t i = 0; i < tok.size() && ok;) {
        const size_t len = CharLength(tok, i);
        auto it = char_byte.find(DecodeChar(tok, i, len));
        ok = it != char_byte.end();
        if (ok) raw.push_back(static_cast<char>(it->second));
        i += len;
      }
      if (ok) m->raw_vocab_.emplace(std::move(raw), id);
    }
  }
  return m;
}

void BpeModel::Tokenize(std::string_view word, Scratch& s, std::vector<int32_t>* ids) const {
  if (!split_at_metaspace_) {
    TokenizePart(word, s, ids);
    return;
  }
  constexpr std::string_view kMeta = "\u2581";
  size_t begin = 0;
  for (size_t at = word.find(kMeta, 1); at != std::string_view::npos;
       at = word.find(kMeta, at + 1)) {
    // Within a run of "▁" there is no cut.
    if (at >= kMeta.size() && word.compare(at - kMeta.size(), kMeta.size(), kMeta) == 0) continue;
    TokenizePart(word.substr(begin, at - begin), s, ids);
    begin = at;
  }
  TokenizePart(word.substr(begin), s, ids);
}

void BpeModel::TokenizePart(std::string_view word, Scratch& s, std::vector<int32_t>* ids) const {
  if (ignore_merges_) {
    const TokenMap& whole = byte_level_ ? raw_vocab_ : vocab_;
    auto it = whole.find(word);
    if (it != whole.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  // The initial symbols: one per character (per byte in byte-level mode),
  // as `tokenizers`' BPE::merge_word makes them, unknown characters
  // included.
  s.symbols.clear();
  auto add = [&](int32_t id) {
    const int32_t n = static_cast<int32_t>(s.symbols.size());
    s.symbols.push_back({id, n - 1, -1, true});
    if (n > 0) s.symbols[n - 1].next = n;
  };
  int32_t unk_pending = -1;  // an unknown run not yet added (fuse_unk)
  for (size_t i = 0; i < word.size();) {
    const size_t len = byte_level_ ? 1 : CharLength(word, i);
    const bool first = i == 0, last = i + len == word.size();
    int32_t id = -1;
    std::string_view piece;
    if (byte_level_) {
      piece = byte_chars_[static_cast<uint8_t>(word[i])];
      id = byte_ids_[static_cast<uint8_t>(word[i])];
    } else if ((first || prefix_.empty()) && (!last || suffix_.empty())) {
      piece = word.substr(i, len);
      auto it = vocab_.find(piece);
      if (it != vocab_.end()) id = it->second;
    } else {
      s.piece.clear();
      if (!first) s.piece += prefix_;
      s.piece.append(word.substr(i, len));
      if (last) s.piece += suffix_;
      piece = s.piece;
      auto it = vocab_.find(piece);
      if (it != vocab_.end()) id = it->second;
    }
    i += len;
    if (id >= 0) {
      if (unk_pending >= 0) add(unk_pending);
      unk_pending = -1;
      add(id);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : piece) all = all && fallback_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all) {
        // As `tokenizers` does, ahead of an unknown run still pending.
        for (char c : piece) add(fallback_ids_[static_cast<uint8_t>(c)]);
        continue;
      }
    }
    if (unk_ >= 0) {
      if (unk_pending >= 0 && !fuse_unk_) add(unk_pending);
      unk_pending = unk_;
    }
    // Without an unk token an unknown character is dropped, as in `tokenizers`.
  }
  if (unk_pending >= 0) add(unk_pending);
  MergeWord(s);
  for (const auto& sym : s.symbols) {
    if (sym.alive) ids->push_back(sym.id);
  }
}

void BpeModel::MergeWord(Scratch& s) const {
  auto& sym = s.symbols;
  if (sym.size() < 2) return;
  auto& heap = s.heap;
  heap.clear();
  // std::*_heap keep the largest on top; "larger" here is the merge to do
  // first: the lowest rank, then the leftmost.
  auto later = [](const Scratch::Merge& a, const Scratch::Merge& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  for (size_t i = 0; i + 1 < sym.size(); ++i) {
    if (const auto* m = merges_->Find(sym[i].id, sym[i + 1].id)) {
      heap.push_back({m->rank, static_cast<int32_t>(i), m->new_id});
    }
  }
  std::make_heap(heap.begin(), heap.end(), later);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Scratch::Merge top = heap.back();
    heap.pop_back();
    auto& cur = sym[top.pos];
    if (!cur.alive || cur.next < 0) continue;
    // An entry is stale when either symbol of its pair has changed since:
    // the pair there now merges into another token.
    const auto* now = merges_->Find(cur.id, sym[cur.next].id);
    if (now == nullptr || now->new_id != top.new_id) continue;
    const int32_t right = cur.next;
    cur.id = top.new_id;
    sym[right].alive = false;
    cur.next = sym[right].next;
    if (cur.next >= 0) sym[cur.next].prev = top.pos;
    if (cur.prev >= 0) {
      if (const auto* m = merges_->Find(sym[cur.prev].id, cur.id)) {
        heap.push_back({m->rank, cur.prev, m->new_id});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    }
    if (cur.next >= 0) {
      if (const auto* m = merges_->Find(cur.id, sym[cur.next].id)) {
        heap.push_back({m->rank, top.pos, m->new_id});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    }
  }
}

}  // namespace kdn::text
