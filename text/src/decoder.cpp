#include "decoder.h"

#include <algorithm>

#include "kdn/text/tokenizer.h"
#include "normalize.h"
#include "utf8.h"

namespace kdn::text {

using nlohmann::json;

namespace {

// ByteLevel characters back to bytes: -1 for a character not in the
// alphabet. The alphabet's code points are all below 324.
struct ByteLevelInverse {
  int16_t byte[324];
  ByteLevelInverse() {
    for (int16_t& b : byte) b = -1;
    for (int b = 0; b < 256; ++b)
      byte[ByteToUnicode(static_cast<uint8_t>(b))] = static_cast<int16_t>(b);
  }
};
const ByteLevelInverse& Inverse() {
  static const ByteLevelInverse inv;
  return inv;
}

// The byte of a byte-fallback token "<0xNN>" (as `tokenizers` reads it:
// u8::from_str_radix of the two characters), or -1.
int FallbackByte(std::string_view t) {
  if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (t[3] == '+') return hex(t[4]);  // from_str_radix takes a sign
  const int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// `tokenizers`' Strip decoder on one string: up to `start` leading and
// `stop` trailing `c` removed.
std::string StripToken(std::string_view s, std::string_view c, size_t start, size_t stop) {
  size_t b = 0, e = s.size();
  for (size_t k = 0; k < start && s.substr(b, c.size()) == c; ++k) b += c.size();
  for (size_t k = 0; k < stop && e >= b + c.size() && s.substr(e - c.size(), c.size()) == c; ++k) {
    e -= c.size();
  }
  return std::string(s.substr(b, e - b));
}

Result<size_t> Count(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j.at(key).is_number_unsigned()) {
    return InvalidArgument(where + "." + key + " is not a count");
  }
  return j.at(key).get<size_t>();
}

// Whether more text may still make `s` one byte-fallback token.
bool MayBecomeFallbackByte(std::string_view s) {
  static constexpr std::string_view kSome = "<0x00>";
  return s.size() <= kSome.size() &&
         FallbackByte(std::string(s) + std::string(kSome.substr(s.size()))) >= 0;
}

// Appends the bytes of the ByteLevel characters of `tok` to `bytes`; false
// (and `bytes` as it was) when one is not in the alphabet.
bool ByteLevelBytes(std::string_view tok, std::string* bytes) {
  const size_t mark = bytes->size();
  for (size_t i = 0; i < tok.size();) {
    const size_t len = CharLength(tok, i);
    const char32_t c = DecodeChar(tok, i, len);
    if (c >= 324 || Inverse().byte[c] < 0) {
      bytes->resize(mark);
      return false;
    }
    bytes->push_back(static_cast<char>(Inverse().byte[c]));
    i += len;
  }
  return true;
}

// `tok` with `matches` (ranges of it, in order) replaced by `content`.
std::string ReplaceMatches(std::string_view tok,
                           const std::vector<std::pair<size_t, size_t>>& matches,
                           const std::string& content) {
  std::string r;
  size_t at = 0;
  for (const auto& [b, e] : matches) {
    r.append(tok, at, b - at);
    r += content;
    at = e;
  }
  r.append(tok, at, std::string::npos);
  return r;
}

// The Metaspace decoder on one token: each replacement character becomes a
// space, or is dropped (`drop`: the token is the first, whose prefix the
// encoder added).
std::string MetaspaceToken(std::string_view tok, const std::string& replacement, bool drop) {
  std::string r;
  r.reserve(tok.size());
  for (size_t i = 0; i < tok.size();) {
    if (tok.compare(i, replacement.size(), replacement) == 0) {
      if (!drop) r.push_back(' ');
      i += replacement.size();
    } else {
      r.push_back(tok[i++]);
    }
  }
  return r;
}

std::string Take(std::string& s) {
  std::string t = std::move(s);
  s.clear();
  return t;
}

}  // namespace

Decoder::~Decoder() = default;

Status Decoder::Add(const json& j, const std::string& where, Decoder* d) {
  if (!j.is_object() || !j.contains("type") || !j.at("type").is_string()) {
    return InvalidArgument(where + " has no \"type\"");
  }
  const std::string type = j.at("type").get<std::string>();
  if (type == "Sequence") {
    if (!j.contains("decoders") || !j.at("decoders").is_array()) {
      return InvalidArgument(where + ".decoders is not an array");
    }
    const json& list = j.at("decoders");
    for (size_t i = 0; i < list.size(); ++i) {
      KDN_RETURN_IF_ERROR(Add(list[i], where + ".decoders[" + std::to_string(i) + "]", d));
    }
    return Status::Ok();
  }
  if (type == "Fuse" || (type == "ByteLevel" && !d->fused_)) {
    // The first is the fuse point; a Fuse after it joins a list of one.
    if (!d->fused_) d->fuse_ = type == "Fuse" ? Fuse::kConcat : Fuse::kByteLevel;
    d->fused_ = true;
    return Status::Ok();
  }
  Step step;
  if (type == "ByteLevel") {
    step.kind = Step::kByteLevel;
  } else if (type == "Replace") {
    step.kind = Step::kReplace;
    if (!j.contains("content") || !j.at("content").is_string()) {
      return InvalidArgument(where + ".content is not a string");
    }
    step.content = j.at("content").get<std::string>();
    if (!j.contains("pattern")) return InvalidArgument(where + " has no pattern");
    const json& p = j.at("pattern");
    KDN_ASSIGN_OR_RETURN(step.pattern, PatternFromJson(p, where));
    step.literal = p.contains("String") && p.at("String").is_string();
    if (step.literal) step.text = p.at("String").get<std::string>();
  } else if (type == "Metaspace") {
    step.kind = Step::kMetaspace;
    if (!j.contains("replacement") || !j.at("replacement").is_string() ||
        j.at("replacement").get<std::string>().empty()) {
      return InvalidArgument(where + ".replacement is not a character");
    }
    step.replacement = j.at("replacement").get<std::string>();
    if (j.contains("prepend_scheme")) {
      step.strip_first = j.at("prepend_scheme") != "never";
    } else if (j.contains("add_prefix_space")) {
      step.strip_first = j.at("add_prefix_space") != false;
    }
  } else if (type == "ByteFallback") {
    step.kind = Step::kByteFallback;
  } else if (type == "Strip") {
    step.kind = Step::kStrip;
    if (!j.contains("content") || !j.at("content").is_string()) {
      return InvalidArgument(where + ".content is not a character");
    }
    step.content = j.at("content").get<std::string>();
    if (step.content.empty() || CharLength(step.content, 0) != step.content.size()) {
      return InvalidArgument(where + ".content is not one character");
    }
    KDN_ASSIGN_OR_RETURN(step.start, Count(j, "start", where));
    KDN_ASSIGN_OR_RETURN(step.stop, Count(j, "stop", where));
  } else {
    return Unimplemented(where + ": the decoder type \"" + type + "\" is not supported");
  }
  (d->fused_ ? d->post_ : d->steps_).push_back(std::move(step));
  return Status::Ok();
}

Result<std::unique_ptr<Decoder>> Decoder::FromJson(const json& j, const std::string& where) {
  std::unique_ptr<Decoder> d(new Decoder());
  if (j.is_null()) {
    d->fuse_ = Fuse::kJoinSpaces;  // `tokenizers` joins the tokens with spaces
    return d;
  }
  KDN_RETURN_IF_ERROR(Add(j, where, d.get()));
  return d;
}

std::unique_ptr<Decoder::State> Decoder::NewState() const {
  auto st = std::make_unique<State>();
  st->seen.assign(steps_.size(), 0);
  st->group.assign(steps_.size(), std::string());
  st->post.assign(post_.size(), PostState());
  return st;
}

void Decoder::Push(State& st, std::string_view token, std::string* out) const {
  Run(st, 0, std::string(token), out);
}

void Decoder::Finish(State& st, std::string* out) const {
  for (size_t k = 0; k < steps_.size(); ++k) {
    if (steps_[k].kind == Step::kByteFallback) FlushGroup(st, k, out);
  }
  if (fuse_ == Fuse::kByteLevel && !st.bytes.empty()) {
    std::string text;
    AppendUtf8Lossy(st.bytes, /*final=*/true, &text);
    st.bytes.clear();
    Post(st, 0, std::move(text), out);
  }
  // Each step's end goes through the steps after it before they end.
  for (size_t j = 0; j < post_.size(); ++j) Post(st, j + 1, PostFinish(post_[j], st.post[j]), out);
}

// Step k of the per-token steps on one token; past the last step, the fuse.
void Decoder::Run(State& st, size_t k, std::string tok, std::string* out) const {
  if (k == steps_.size()) {
    Fused(st, tok, out);
    return;
  }
  const Step& step = steps_[k];
  const size_t index = st.seen[k]++;
  switch (step.kind) {
    case Step::kReplace: tok = ReplaceMatches(tok, step.pattern->FindAll(tok), step.content); break;
    case Step::kMetaspace:
      // The first token loses every replacement character (the prefix the
      // encoder added); the others turn them into spaces.
      tok = MetaspaceToken(tok, step.replacement, index == 0 && step.strip_first);
      break;
    case Step::kByteFallback: {
      const int b = FallbackByte(tok);
      if (b >= 0) {
        st.group[k].push_back(static_cast<char>(b));
        return;
      }
      FlushGroup(st, k, out);
      break;
    }
    case Step::kStrip: tok = StripToken(tok, step.content, step.start, step.stop); break;
    case Step::kByteLevel:  // always the fuse point before post_
      break;
  }
  Run(st, k + 1, std::move(tok), out);
}

// Ends the run of byte-fallback tokens step k holds: its bytes as one token
// when they are valid UTF-8, else one U+FFFD token per byte.
void Decoder::FlushGroup(State& st, size_t k, std::string* out) const {
  std::string g = Take(st.group[k]);
  if (g.empty()) return;
  if (IsValidUtf8(g)) {
    Run(st, k + 1, std::move(g), out);
  } else {
    for (size_t i = 0; i < g.size(); ++i) Run(st, k + 1, "\xEF\xBF\xBD", out);
  }
}

void Decoder::Fused(State& st, std::string_view tok, std::string* out) const {
  switch (fuse_) {
    case Fuse::kJoinSpaces:
      if (st.fused++ > 0) Post(st, 0, " ", out);
      Post(st, 0, std::string(tok), out);
      return;
    case Fuse::kConcat: Post(st, 0, std::string(tok), out); return;
    case Fuse::kByteLevel: {
      // A token with a character outside the alphabet is taken as its own
      // UTF-8 bytes, as `tokenizers` does.
      if (!ByteLevelBytes(tok, &st.bytes)) st.bytes.append(tok);
      std::string text;
      const size_t used = AppendUtf8Lossy(st.bytes, /*final=*/false, &text);
      st.bytes.erase(0, used);
      Post(st, 0, std::move(text), out);
      return;
    }
  }
}

void Decoder::Post(State& st, size_t j, std::string text, std::string* out) const {
  for (; j < post_.size() && !text.empty(); ++j)
    text = PostPush(post_[j], st.post[j], std::move(text));
  out->append(text);
}

// One step after the fuse point on the next part of the one text: what it
// makes final. The text comes in whole characters.
std::string Decoder::PostPush(const Step& s, PostState& ps, std::string text) const {
  switch (s.kind) {
    case Step::kReplace: {
      if (!s.literal || s.text.empty()) {
        ps.held += text;  // settled only at the end
        return "";
      }
      // Matches found are final (the leftmost come first); an end that may
      // begin one waits for what follows.
      std::string all = Take(ps.held) + text;
      const auto matches = s.pattern->FindAll(all);
      const size_t from = matches.empty() ? 0 : matches.back().second;
      size_t keep = all.size();
      for (size_t i = std::max(from, all.size() - std::min(all.size(), s.text.size() - 1));
           i < all.size(); ++i) {
        if (s.text.compare(0, all.size() - i, all, i) == 0) {
          keep = i;
          break;
        }
      }
      ps.held = all.substr(keep);
      all.resize(keep);
      return ReplaceMatches(all, matches, s.content);
    }
    case Step::kMetaspace:
      return MetaspaceToken(text, s.replacement, s.strip_first);  // the one token is the first
    case Step::kByteFallback:
    case Step::kByteLevel: {
      // Both look at the whole text: wait until what has come settles it.
      if (ps.settled) return text;
      ps.held += text;
      std::string bytes;
      ps.settled = s.kind == Step::kByteFallback ? !MayBecomeFallbackByte(ps.held)
                                                 : !ByteLevelBytes(text, &bytes);
      return ps.settled ? Take(ps.held) : "";
    }
    case Step::kStrip: {
      const std::string& c = s.content;
      if (!ps.lead_done) {
        size_t b = 0;
        while (ps.lead < s.start && text.compare(b, c.size(), c) == 0) {
          b += c.size();
          ++ps.lead;
        }
        if (b < text.size() || ps.lead == s.start) ps.lead_done = true;
        text.erase(0, b);
      }
      if (s.stop > 0) {
        // Hold the trailing run of `c` (up to `stop` of them) until a
        // character that stays follows it or the text ends.
        std::string all = Take(ps.held) + text;
        size_t e = all.size(), n = 0;
        while (n < s.stop && e >= c.size() && all.compare(e - c.size(), c.size(), c) == 0) {
          e -= c.size();
          ++n;
        }
        ps.held = all.substr(e);
        all.resize(e);
        text = std::move(all);
      }
      return text;
    }
  }
  return text;
}

// The end of the text for one step after the fuse point: what it held.
std::string Decoder::PostFinish(const Step& s, PostState& ps) const {
  std::string held = Take(ps.held);
  switch (s.kind) {
    case Step::kReplace: return ReplaceMatches(held, s.pattern->FindAll(held), s.content);
    case Step::kByteFallback:
      if (!ps.settled) {
        const int b = FallbackByte(held);
        // A lone byte is valid UTF-8 only below 0x80.
        if (b >= 0) return b < 0x80 ? std::string(1, static_cast<char>(b)) : "\xEF\xBF\xBD";
      }
      return held;
    case Step::kByteLevel:
      if (!ps.settled) {
        std::string bytes, text;
        ByteLevelBytes(held, &bytes);
        AppendUtf8Lossy(bytes, /*final=*/true, &text);
        return text;
      }
      return held;
    case Step::kStrip:  // what it holds is at the end of the text: stripped
    case Step::kMetaspace: return "";
  }
  return "";
}

}  // namespace kdn::text
