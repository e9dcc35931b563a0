#include "pretokenize.h"

#include <algorithm>

#include "normalize.h"

namespace kdn::text {

using nlohmann::json;

namespace {

// The regex of the GPT-2 ByteLevel pre-tokenizer (`tokenizers`'
// byte_level.rs).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The fixed splits of the character-class pre-tokenizers, each the same set
// of characters as the Rust predicate or regex `tokenizers` uses, so that they
// run as a Split with that behavior. One character a match, as `tokenizers`'
// Pattern for a char predicate finds them.
//   Digits: char::is_numeric (Nd, Nl, No).
constexpr const char* kNumeric = R"(\p{N})";
//   Punctuation: char::is_ascii_punctuation or unicode_categories'
//   is_punctuation (the P categories).
constexpr const char* kPunctuation =
    R"([\p{P}\x{21}-\x{2F}\x{3A}-\x{40}\x{5B}-\x{60}\x{7B}-\x{7E}])";
//   WhitespaceSplit: char::is_whitespace.
constexpr const char* kWhiteSpace = R"(\p{White_Space})";
//   Whitespace: the regex crate's \w+|[^\w\s]+, with its Unicode \w and \s
//   spelled out (\w: Alphabetic, marks, Nd, Pc, Join_Control).
constexpr const char* kWordsOrSymbols =
    R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}]+)"
    R"(|[^\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}\p{White_Space}]+)";

// `tokenizers`' SplitDelimiterBehavior.
enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct Segment {
  size_t begin, end;
  bool match;
};

// The segments of `n` bytes that `matches` make: each match and each gap
// between, in order (`tokenizers`' Pattern::find_matches).
std::vector<Segment> Segments(const std::vector<std::pair<size_t, size_t>>& matches, size_t n) {
  std::vector<Segment> segs;
  if (n == 0) return {{0, 0, false}};
  size_t prev = 0;
  for (const auto& [b, e] : matches) {
    if (prev != b) segs.push_back({prev, b, false});
    segs.push_back({b, e, true});
    prev = e;
  }
  if (prev != n) segs.push_back({prev, n, false});
  return segs;
}

// The pieces `behavior` keeps of `segs` (NormalizedString::split); a Removed
// match is dropped. Empty pieces are left for the caller to drop.
std::vector<std::pair<size_t, size_t>> ApplyBehavior(const std::vector<Segment>& segs,
                                                     Behavior behavior) {
  std::vector<std::pair<size_t, size_t>> out;
  switch (behavior) {
    case Behavior::kIsolated:
      for (const Segment& s : segs) out.emplace_back(s.begin, s.end);
      break;
    case Behavior::kRemoved:
      for (const Segment& s : segs) {
        if (!s.match) out.emplace_back(s.begin, s.end);
      }
      break;
    case Behavior::kContiguous: {
      bool prev = false;
      for (const Segment& s : segs) {
        if (s.match == prev && !out.empty())
          out.back().second = s.end;
        else
          out.emplace_back(s.begin, s.end);
        prev = s.match;
      }
      break;
    }
    case Behavior::kMergedWithPrevious: {
      bool prev = false;
      for (const Segment& s : segs) {
        if (s.match && !prev && !out.empty())
          out.back().second = s.end;
        else
          out.emplace_back(s.begin, s.end);
        prev = s.match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool prev = false;
      for (size_t i = segs.size(); i-- > 0;) {
        const Segment& s = segs[i];
        if (s.match && !prev && !out.empty())
          out.back().first = s.begin;
        else
          out.emplace_back(s.begin, s.end);
        prev = s.match;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
  }
  return out;
}

// Replaces each word of `w` by its non-empty pieces by `regex` and
// `behavior`.
void SplitWords(const Regex& regex, Behavior behavior, bool invert, Words* w) {
  std::vector<Words::Range> out;
  out.reserve(w->list.size() * 4);
  for (const Words::Range& r : w->list) {
    const std::string_view s = w->Get(r);
    std::vector<Segment> segs = Segments(regex.FindAll(s), s.size());
    if (invert) {
      for (Segment& g : segs) g.match = !g.match;
    }
    for (const auto& [b, e] : ApplyBehavior(segs, behavior)) {
      if (b == e) continue;
      out.push_back({r.begin + b, r.begin + e, r.at_start && b == 0});
    }
  }
  w->list = std::move(out);
}

Result<Behavior> BehaviorFromJson(const json& j, const std::string& where) {
  if (!j.contains("behavior") || !j.at("behavior").is_string()) {
    return InvalidArgument(where + ".behavior is not a string");
  }
  const std::string b = j.at("behavior").get<std::string>();
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  return InvalidArgument(where + ".behavior \"" + b + "\" is not a SplitDelimiterBehavior");
}

Result<bool> Bool(const json& j, const char* key, bool dflt, const std::string& where) {
  if (!j.contains(key)) return dflt;
  if (!j.at(key).is_boolean()) return InvalidArgument(where + "." + key + " is not a boolean");
  return j.at(key).get<bool>();
}

}  // namespace

struct PreTokenizer::Step {
  enum Kind { kSplit, kByteLevel, kMetaspace } kind;
  std::unique_ptr<Regex> regex;  // kSplit; kByteLevel with use_regex
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;  // kByteLevel
  std::string replacement;        // kMetaspace
  enum Prepend { kAlways, kFirst, kNever } prepend = kAlways;
  bool split = true;  // kMetaspace
};

PreTokenizer::~PreTokenizer() = default;

Status PreTokenizer::Add(const json& j, const std::string& where, PreTokenizer* p) {
  if (j.is_null()) return Status::Ok();
  if (!j.is_object() || !j.contains("type") || !j.at("type").is_string()) {
    return InvalidArgument(where + " has no \"type\"");
  }
  if (p->byte_level_) {
    return Unimplemented(where + ": a pre-tokenizer after ByteLevel is not supported");
  }
  const std::string type = j.at("type").get<std::string>();
  auto step = std::make_unique<Step>();
  if (type == "Sequence") {
    if (!j.contains("pretokenizers") || !j.at("pretokenizers").is_array()) {
      return InvalidArgument(where + ".pretokenizers is not an array");
    }
    const json& list = j.at("pretokenizers");
    for (size_t i = 0; i < list.size(); ++i) {
      KDN_RETURN_IF_ERROR(Add(list[i], where + ".pretokenizers[" + std::to_string(i) + "]", p));
    }
    return Status::Ok();
  } else if (type == "Split") {
    step->kind = Step::kSplit;
    if (!j.contains("pattern")) return InvalidArgument(where + " has no pattern");
    KDN_ASSIGN_OR_RETURN(step->regex, PatternFromJson(j.at("pattern"), where));
    KDN_ASSIGN_OR_RETURN(step->behavior, BehaviorFromJson(j, where));
    KDN_ASSIGN_OR_RETURN(step->invert, Bool(j, "invert", false, where));
  } else if (type == "Digits") {
    // digits.rs: each digit alone, or runs of them.
    if (!j.contains("individual_digits") || !j.at("individual_digits").is_boolean()) {
      return InvalidArgument(where + ".individual_digits is not a boolean");
    }
    step->kind = Step::kSplit;
    KDN_ASSIGN_OR_RETURN(step->regex, Regex::Compile(kNumeric, false, where));
    step->behavior =
        j.at("individual_digits").get<bool>() ? Behavior::kIsolated : Behavior::kContiguous;
  } else if (type == "Punctuation") {
    step->kind = Step::kSplit;
    KDN_ASSIGN_OR_RETURN(step->regex, Regex::Compile(kPunctuation, false, where));
    if (j.contains("behavior")) {
      KDN_ASSIGN_OR_RETURN(step->behavior, BehaviorFromJson(j, where));
    }
  } else if (type == "Whitespace") {
    // whitespace.rs: the matches are the words; what lies between goes.
    step->kind = Step::kSplit;
    KDN_ASSIGN_OR_RETURN(step->regex, Regex::Compile(kWordsOrSymbols, false, where));
    step->behavior = Behavior::kRemoved;
    step->invert = true;
  } else if (type == "WhitespaceSplit") {
    step->kind = Step::kSplit;
    KDN_ASSIGN_OR_RETURN(step->regex, Regex::Compile(kWhiteSpace, false, where));
    step->behavior = Behavior::kRemoved;
  } else if (type == "ByteLevel") {
    step->kind = Step::kByteLevel;
    KDN_ASSIGN_OR_RETURN(step->add_prefix_space, Bool(j, "add_prefix_space", true, where));
    KDN_ASSIGN_OR_RETURN(const bool use_regex, Bool(j, "use_regex", true, where));
    if (use_regex) {
      KDN_ASSIGN_OR_RETURN(step->regex, Regex::Compile(kGpt2Pattern, false, where));
    }
    p->byte_level_ = true;
  } else if (type == "Metaspace") {
    step->kind = Step::kMetaspace;
    if (!j.contains("replacement") || !j.at("replacement").is_string() ||
        j.at("replacement").get<std::string>().empty()) {
      return InvalidArgument(where + ".replacement is not a character");
    }
    step->replacement = j.at("replacement").get<std::string>();
    if (j.contains("prepend_scheme")) {
      const json& s = j.at("prepend_scheme");
      if (s == "always")
        step->prepend = Step::kAlways;
      else if (s == "first")
        step->prepend = Step::kFirst;
      else if (s == "never")
        step->prepend = Step::kNever;
      else
        return InvalidArgument(where + ".prepend_scheme is not always, first or never");
    } else {
      // Files older than prepend_scheme say add_prefix_space.
      KDN_ASSIGN_OR_RETURN(const bool add, Bool(j, "add_prefix_space", true, where));
      step->prepend = add ? Step::kAlways : Step::kNever;
    }
    KDN_ASSIGN_OR_RETURN(step->split, Bool(j, "split", true, where));
  } else {
    return Unimplemented(where + ": the pre-tokenizer type \"" + type + "\" is not supported");
  }
  p->steps_.push_back(std::move(step));
  return Status::Ok();
}

Result<std::unique_ptr<PreTokenizer>> PreTokenizer::FromJson(const json& j,
                                                             const std::string& where) {
  std::unique_ptr<PreTokenizer> p(new PreTokenizer());
  KDN_RETURN_IF_ERROR(Add(j, where, p.get()));
  return p;
}

void PreTokenizer::Apply(const Step& step, Words* w) {
  switch (step.kind) {
    case Step::kSplit: SplitWords(*step.regex, step.behavior, step.invert, w); return;
    case Step::kByteLevel:
      if (step.add_prefix_space) {
        Words n;
        n.buf.reserve(w->buf.size() + w->list.size());
        for (const Words::Range& r : w->list) {
          const std::string_view s = w->Get(r);
          const size_t b = n.buf.size();
          if (s.empty() || s[0] != ' ') n.buf.push_back(' ');
          n.buf.append(s);
          n.list.push_back({b, n.buf.size(), r.at_start});
        }
        *w = std::move(n);
      }
      if (step.regex) SplitWords(*step.regex, Behavior::kIsolated, false, w);
      return;
    case Step::kMetaspace: {
      Words n;
      n.buf.reserve(w->buf.size() * 3 / 2 + 8);
      std::vector<Words::Range> pieces;
      for (const Words::Range& r : w->list) {
        const std::string_view s = w->Get(r);
        const size_t b = n.buf.size();
        const bool starts = s.substr(0, step.replacement.size()) == step.replacement ||
                            (!s.empty() && s[0] == ' ');  // a space becomes the replacement
        if (!starts &&
            (step.prepend == Step::kAlways || (step.prepend == Step::kFirst && r.at_start))) {
          n.buf += step.replacement;
        }
        for (char c : s) {
          if (c == ' ')
            n.buf += step.replacement;
          else
            n.buf.push_back(c);
        }
        if (!step.split) {
          n.list.push_back({b, n.buf.size(), r.at_start});
          continue;
        }
        // Split before each replacement (MergedWithNext).
        size_t at = b;
        for (size_t i = b; i < n.buf.size();) {
          const size_t next = n.buf.compare(i, step.replacement.size(), step.replacement) == 0
                                  ? i + step.replacement.size()
                                  : i + 1;
          if (next != i + 1 && i > at) {
            n.list.push_back({at, i, r.at_start && at == b});
            at = i;
          }
          i = next;
        }
        if (n.buf.size() > at) n.list.push_back({at, n.buf.size(), r.at_start && at == b});
      }
      *w = std::move(n);
      return;
    }
  }
}

void PreTokenizer::Run(std::string_view text, bool at_start, Words* out) const {
  Words w;
  w.buf.assign(text);
  if (!text.empty()) w.list.push_back({0, text.size(), at_start});
  for (const auto& step : steps_) Apply(*step, &w);
  const size_t base = out->buf.size();
  out->buf += w.buf;
  for (const Words::Range& r : w.list) {
    if (r.end > r.begin) out->list.push_back({base + r.begin, base + r.end, r.at_start});
  }
}

}  // namespace kdn::text
