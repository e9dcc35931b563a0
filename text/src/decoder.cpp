#include "decoder.h"

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
    for (int b = 0; b < 256; ++b) byte[ByteToUnicode(static_cast<uint8_t>(b))] = static_cast<int16_t>(b);
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
  if (type == "Fuse" || type == "ByteLevel") {
    if (d->fused_ && type == "ByteLevel") {
      return Unimplemented(where + ": a ByteLevel decoder after Fuse is not supported");
    }
    if (!d->fused_) d->fuse_ = type == "Fuse" ? Fuse::kConcat : Fuse::kByteLevel;
    d->fused_ = true;
    return Status::Ok();
  }
  Step step;
  if (type == "Replace") {
    step.kind = Step::kReplace;
    if (!j.contains("content") || !j.at("content").is_string()) {
      return InvalidArgument(where + ".content is not a string");
    }
    step.content = j.at("content").get<std::string>();
    if (!j.contains("pattern")) return InvalidArgument(where + " has no pattern");
    KDN_ASSIGN_OR_RETURN(step.pattern, PatternFromJson(j.at("pattern"), where));
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
  if (d->fused_) {
    // On the one fused text only Strip can run as a stream here.
    if (step.kind != Step::kStrip) {
      return Unimplemented(where + ": a " + type + " decoder after Fuse or ByteLevel is not supported");
    }
    d->post_.push_back(std::move(step));
  } else {
    d->steps_.push_back(std::move(step));
  }
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
  st->lead.assign(post_.size(), 0);
  st->lead_done.assign(post_.size(), false);
  st->trail.assign(post_.size(), std::string());
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
    Post(st, std::move(text), out);
  }
  // What trailing Strips hold is at the end of the text: it is stripped.
  for (std::string& t : st.trail) t.clear();
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
    case Step::kReplace: {
      const auto matches = step.pattern->FindAll(tok);
      if (!matches.empty()) {
        std::string r;
        size_t at = 0;
        for (const auto& [b, e] : matches) {
          r.append(tok, at, b - at);
          r += step.content;
          at = e;
        }
        r.append(tok, at, std::string::npos);
        tok = std::move(r);
      }
      break;
    }
    case Step::kMetaspace: {
      // The first token loses every replacement character (the prefix the
      // encoder added); the others turn them into spaces.
      const bool drop = index == 0 && step.strip_first;
      std::string r;
      r.reserve(tok.size());
      for (size_t i = 0; i < tok.size();) {
        if (tok.compare(i, step.replacement.size(), step.replacement) == 0) {
          if (!drop) r.push_back(' ');
          i += step.replacement.size();
        } else {
          r.push_back(tok[i++]);
        }
      }
      tok = std::move(r);
      break;
    }
    case Step::kByteFallback: {
      const int b = FallbackByte(tok);
      if (b >= 0) {
        st.group[k].push_back(static_cast<char>(b));
        return;
      }
      FlushGroup(st, k, out);
      break;
    }
    case Step::kStrip:
      tok = StripToken(tok, step.content, step.start, step.stop);
      break;
  }
  Run(st, k + 1, std::move(tok), out);
}

// Ends the run of byte-fallback tokens step k holds: its bytes as one token
// when they are valid UTF-8, else one U+FFFD token per byte.
void Decoder::FlushGroup(State& st, size_t k, std::string* out) const {
  std::string g = std::move(st.group[k]);
  st.group[k].clear();
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
      if (st.fused++ > 0) Post(st, " ", out);
      Post(st, std::string(tok), out);
      return;
    case Fuse::kConcat:
      Post(st, std::string(tok), out);
      return;
    case Fuse::kByteLevel: {
      // A token with a character outside the alphabet is taken as its own
      // UTF-8 bytes, as `tokenizers` does.
      const size_t mark = st.bytes.size();
      bool ok = true;
      for (size_t i = 0; i < tok.size() && ok;) {
        const size_t len = CharLength(tok, i);
        const char32_t c = DecodeChar(tok, i, len);
        ok = c < 324 && Inverse().byte[c] >= 0;
        if (ok) st.bytes.push_back(static_cast<char>(Inverse().byte[c]));
        i += len;
      }
      if (!ok) {
        st.bytes.resize(mark);
        st.bytes.append(tok);
      }
      std::string text;
      const size_t used = AppendUtf8Lossy(st.bytes, /*final=*/false, &text);
      st.bytes.erase(0, used);
      Post(st, std::move(text), out);
      return;
    }
  }
}

// The fused text through the post-fuse Strips, as a stream.
void Decoder::Post(State& st, std::string text, std::string* out) const {
  for (size_t j = 0; j < post_.size() && !text.empty(); ++j) {
    const Step& s = post_[j];
    const std::string& c = s.content;
    if (!st.lead_done[j]) {
      size_t b = 0;
      while (st.lead[j] < s.start && text.compare(b, c.size(), c) == 0) {
        b += c.size();
        ++st.lead[j];
      }
      if (b < text.size() || st.lead[j] == s.start) st.lead_done[j] = true;
      text.erase(0, b);
    }
    if (s.stop > 0) {
      // Hold the trailing run of `c` (up to `stop` of them) until a character
      // that stays follows it or the text ends.
      std::string all = std::move(st.trail[j]) + text;
      size_t e = all.size(), n = 0;
      while (n < s.stop && e >= c.size() && all.compare(e - c.size(), c.size(), c) == 0) {
        e -= c.size();
        ++n;
      }
      st.trail[j] = all.substr(e);
      all.resize(e);
      text = std::move(all);
    }
  }
  out->append(text);
}

}  // namespace kdn::text
