// The pieces of the Hugging Face tokenizer.json reader that need no real
// vocabulary: tiny hand-written files. tests/parity/test_tokenizer_vocab.py
// checks real vocabularies against `tokenizers` itself.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdn/text/output_text.h"
#include "kdn/text/tokenizer.h"

namespace kdn::text {
namespace {

using nlohmann::json;
using Ids = std::vector<int32_t>;

// Writes `tok` (and `cfg` unless null) into a fresh folder and loads it.
Result<std::unique_ptr<Tokenizer>> LoadJson(const json& tok, const json& cfg = nullptr) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const auto dir =
      std::filesystem::temp_directory_path() /
      ("kdn_hf_tokenizer_test_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << tok.dump();
  if (!cfg.is_null()) std::ofstream(dir / "tokenizer_config.json") << cfg.dump();
  auto t = Tokenizer::Load(dir);
  std::filesystem::remove_all(dir);
  return t;
}

json Added(int id, const std::string& content, bool special = true) {
  return {{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", false}, {"special", special}};
}

// A character-level BPE over a, b, c and a space, no pre-tokenizer.
json CharBpe(json merges) {
  return {{"normalizer", nullptr},
          {"pre_tokenizer", nullptr},
          {"decoder", {{"type", "Fuse"}}},
          {"model",
           {{"type", "BPE"},
            {"vocab", {{"a", 0}, {"b", 1}, {"c", 2}, {" ", 3}, {"ab", 4}, {"bc", 5}, {"abc", 6}}},
            {"merges", merges}}}};
}

// A sentencepiece-style BPE (the Llama 2 form): Prepend "▁" and Replace
// " " -> "▁" normalizers, byte fallback, a fused <unk>, the Llama decoders
// and a BOS template. Its byte tokens: <0xC3> <0xA9> <0xE4> <0xB8> <0x96>.
json SpmBpe() {
  json vocab = {{"<unk>", 0},  {"<s>", 1},      {"</s>", 2},     {"<0xC3>", 3}, {"<0xA9>", 4},
                {"<0xE4>", 5}, {"<0xB8>", 6},   {"<0x96>", 7},   {"\u2581", 8}, {"h", 9},
                {"i", 10},     {"\u2581h", 11}, {"\u2581hi", 12}};
  return {{"added_tokens", {Added(0, "<unk>"), Added(1, "<s>"), Added(2, "</s>")}},
          {"normalizer",
           {{"type", "Sequence"},
            {"normalizers",
             {{{"type", "Prepend"}, {"prepend", "\u2581"}},
              {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}}},
          {"pre_tokenizer", nullptr},
          {"post_processor",
           {{"type", "TemplateProcessing"},
            {"single",
             {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
          {"decoder",
           {{"type", "Sequence"},
            {"decoders",
             {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
              {{"type", "ByteFallback"}},
              {{"type", "Fuse"}},
              {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
          {"model",
           {{"type", "BPE"},
            {"unk_token", "<unk>"},
            {"fuse_unk", true},
            {"byte_fallback", true},
            {"vocab", vocab},
            {"merges", {"\u2581 h", "\u2581h i"}}}}};
}

// Every piece a DecodeStream gives for `ids`, Finish's last.
std::vector<std::string> Pieces(const Tokenizer& t, const Ids& ids) {
  auto s = t.NewDecodeStream();
  std::vector<std::string> out;
  for (int32_t id : ids) out.push_back(s->Next(id));
  out.push_back(s->Finish());
  return out;
}

TEST(HfTokenizer, MergesTheLowestRankedPairFirst) {
  auto t = LoadJson(CharBpe({"b c", "a b", "a bc"}));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->Encode("abc", false), (Ids{6}));  // b c, then a bc
  EXPECT_EQ((*t)->Encode("abab", false), (Ids{4, 4}));
  EXPECT_EQ((*t)->Encode("cab", false), (Ids{2, 4}));
  // With "a b" ranked first, "abc" becomes ab c: there is no "ab c" merge.
  auto u = LoadJson(CharBpe({"a b", "b c", "a bc"}));
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ((*u)->Encode("abc", false), (Ids{4, 2}));
  EXPECT_EQ((*u)->Decode(Ids{4, 2, 3, 6}), "abc abc");
  // Merges in the [a, b] form of newer files.
  auto v = LoadJson(CharBpe(json::array({json::array({"b", "c"}), json::array({"a", "bc"})})));
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ((*v)->Encode("abc", false), (Ids{6}));
}

TEST(HfTokenizer, SentencepieceBpeFallsBackToBytesAndFusesUnknowns) {
  auto t = LoadJson(SpmBpe(), {{"bos_token", "<s>"}, {"eos_token", "</s>"}});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->bos_id(), 1);
  EXPECT_EQ((*t)->eos_id(), 2);
  // "▁hi▁é": é has no token of its own, its two bytes do.
  EXPECT_EQ((*t)->Encode("hi \xc3\xa9", false), (Ids{12, 8, 3, 4}));
  // The template puts the BOS first.
  EXPECT_EQ((*t)->Encode("hi", true), (Ids{1, 12}));
  // ß (C3 9F) lacks a byte token: it is unknown, and a run of unknown
  // characters is one <unk> (fuse_unk).
  EXPECT_EQ((*t)->Encode("h\xc3\x9f\xc3\x9fi", false), (Ids{11, 0, 10}));
  // Added tokens are cut out of the text first; the normalizer's "▁" goes
  // in front of each piece between them, as in tokenizers.
  EXPECT_EQ((*t)->Encode("hi</s>hi", false), (Ids{12, 2, 12}));
}

TEST(HfTokenizer, DecodesSentencepieceStrippingOnlyTheFirstSpace) {
  auto t = LoadJson(SpmBpe());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->Decode(Ids{1, 12, 12, 2}), "hi hi");  // specials left out
  EXPECT_EQ(Pieces(**t, {12, 12}), (std::vector<std::string>{"hi", " hi", ""}));
  // Byte-fallback runs: valid UTF-8 as a whole, or one U+FFFD per byte.
  EXPECT_EQ((*t)->Decode(Ids{12, 3, 4}), "hi\xc3\xa9");
  EXPECT_EQ((*t)->Decode(Ids{12, 3, 12}), "hi\xef\xbf\xbd hi");
}

TEST(HfTokenizer, StreamingHoldsASplitByteFallbackRunUntilItEnds) {
  auto t = LoadJson(SpmBpe());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  // "hi 世 hi": 世 is E4 B8 96, three byte-fallback tokens.
  const Ids ids = {12, 8, 5, 6, 7, 12};
  const auto pieces = Pieces(**t, ids);
  EXPECT_EQ(pieces, (std::vector<std::string>{"hi", " ", "", "", "", "\xe4\xb8\x96 hi", ""}));
  // The run ends with the sequence: Finish shows it.
  EXPECT_EQ(Pieces(**t, {12, 5, 6, 7}),
            (std::vector<std::string>{"hi", "", "", "", "\xe4\xb8\x96"}));
  // Cut short, it is what Decode shows: a U+FFFD per byte, never sooner.
  EXPECT_EQ(Pieces(**t, {12, 5, 6}),
            (std::vector<std::string>{"hi", "", "", "\xef\xbf\xbd\xef\xbf\xbd"}));
  EXPECT_EQ((*t)->Decode(Ids{12, 5, 6}), "hi\xef\xbf\xbd\xef\xbf\xbd");
}

TEST(HfTokenizer, StreamingHoldsASplitUtf8CharacterOfByteLevelTokens) {
  auto t = LoadJson(json::parse(ByteTokenizerJson()));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const Ids ids = (*t)->Encode("a\xe4\xb8\x96", false);  // a 世
  ASSERT_EQ(ids.size(), 4u);
  EXPECT_EQ(Pieces(**t, ids), (std::vector<std::string>{"a", "", "", "\xe4\xb8\x96", ""}));
  EXPECT_EQ(Pieces(**t, {ids[0], ids[1], ids[2]}),
            (std::vector<std::string>{"a", "", "", "\xef\xbf\xbd"}));
}

TEST(HfTokenizer, OutputTextShowsASplitCharacterOnceWholeAndEndsAsDecodeDoes) {
  auto t = LoadJson(SpmBpe());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const Ids ids = {12, 8, 5, 6, 7, 12};
  OutputText out(**t, {.max_tokens = static_cast<int>(ids.size())});
  std::string shown;
  for (size_t i = 0; i < ids.size(); ++i) {
    const TextDelta d = out.Add(ids[i], 10 + static_cast<int64_t>(i), 100);
    EXPECT_EQ(d.text.find("\xef\xbf\xbd"), std::string::npos) << i;
    shown += d.text;
    EXPECT_EQ(d.finished, i + 1 == ids.size());
  }
  EXPECT_EQ(shown, (*t)->Decode(ids));
  EXPECT_EQ(shown, "hi \xe4\xb8\x96 hi");
}

TEST(HfTokenizer, AddedTokensHonourLstripRstripAndSingleWord) {
  json tok = CharBpe(json::array());
  json l = Added(10, "<l>"), r = Added(11, "<r>"), w = Added(12, "ab", false);
  l["lstrip"] = true;
  r["rstrip"] = true;
  w["single_word"] = true;
  tok["added_tokens"] = {l, r, w, Added(13, "c<"), Added(14, "c<l")};
  auto t = LoadJson(tok);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  // lstrip takes the spaces before, rstrip those after.
  EXPECT_EQ((*t)->Encode("a  <l> b", false), (Ids{0, 10, 3, 1}));
  EXPECT_EQ((*t)->Encode("a <r>  b", false), (Ids{0, 3, 11, 1}));
  // single_word: only where no word character touches it.
  EXPECT_EQ((*t)->Encode("ab cab", false), (Ids{12, 3, 2, 0, 1}));
  // Leftmost-longest: "c<l" wins over "c<", and over "<l>" that starts
  // later (">", with no token and no unk, is dropped).
  EXPECT_EQ((*t)->Encode("ac<l>", false), (Ids{0, 14}));
  // Special tokens are left out of the text, the others are shown.
  EXPECT_EQ((*t)->Decode(Ids{0, 10, 12, 11}), "aab");
}

TEST(HfTokenizer, MetaspacePreTokenizerAndDecoder) {
  json tok = {
      {"pre_tokenizer",
       {{"type", "Metaspace"},
        {"replacement", "\u2581"},
        {"prepend_scheme", "first"},
        {"split", true}}},
      {"decoder", {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}}},
      {"added_tokens", {Added(5, "<s>")}},
      {"model",
       {{"type", "BPE"},
        {"vocab", {{"\u2581", 0}, {"a", 1}, {"b", 2}, {"\u2581a", 3}, {"\u2581b", 4}, {"<s>", 5}}},
        {"merges", {"\u2581 a", "\u2581 b"}}}}};
  auto t = LoadJson(tok);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->Encode("a b", false), (Ids{3, 4}));      // ▁a ▁b
  EXPECT_EQ((*t)->Encode("a  b", false), (Ids{3, 0, 4}));  // ▁a ▁ ▁b
  // "first": only the text at the very start gets the "▁".
  EXPECT_EQ((*t)->Encode("<s>a b", false), (Ids{5, 1, 4}));
  EXPECT_EQ((*t)->Decode(Ids{3, 4}), "a b");
  EXPECT_EQ(Pieces(**t, {3, 0, 4}), (std::vector<std::string>{"a", " ", " b", ""}));
}

TEST(HfTokenizer, SplitPreTokenizerBehaviours) {
  // Digits cut apart three ways; the model knows single characters only.
  auto with = [](const std::string& behavior, bool invert) {
    return json{{"pre_tokenizer",
                 {{"type", "Split"},
                  {"pattern", {{"Regex", "\\p{N}"}}},
                  {"behavior", behavior},
                  {"invert", invert}}},
                {"decoder", {{"type", "Fuse"}}},
                {"model",
                 {{"type", "BPE"},
                  {"vocab", {{"a", 0}, {"1", 1}, {"a1", 2}, {"1a", 3}, {"11", 4}}},
                  {"merges", {"a 1", "1 a", "1 1"}}}}};
  };
  auto iso = LoadJson(with("Isolated", false));
  ASSERT_TRUE(iso.ok()) << iso.status().ToString();
  EXPECT_EQ((*iso)->Encode("a11a", false), (Ids{0, 1, 1, 0}));
  auto prev = LoadJson(with("MergedWithPrevious", false));
  ASSERT_TRUE(prev.ok());
  EXPECT_EQ((*prev)->Encode("a11a", false), (Ids{2, 1, 0}));  // "a1" "1" "a"
  auto next = LoadJson(with("MergedWithNext", false));
  ASSERT_TRUE(next.ok());
  EXPECT_EQ((*next)->Encode("a11a", false), (Ids{0, 1, 3}));  // "a" "1" "1a"
  auto removed = LoadJson(with("Removed", false));
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ((*removed)->Encode("a11a", false), (Ids{0, 0}));
  auto contiguous = LoadJson(with("Contiguous", false));
  ASSERT_TRUE(contiguous.ok());
  EXPECT_EQ((*contiguous)->Encode("a11a", false), (Ids{0, 4, 0}));  // "a" "11" "a"
  auto inverted = LoadJson(with("Removed", true));                  // the letters are removed
  ASSERT_TRUE(inverted.ok());
  EXPECT_EQ((*inverted)->Encode("a11a", false), (Ids{1, 1}));
}

// A character-level BPE over `vocab` with `merges`, cut by `pre_tokenizer`.
json CharBpeWith(json pre_tokenizer, json vocab, json merges) {
  return {{"pre_tokenizer", pre_tokenizer},
          {"decoder", {{"type", "Fuse"}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
}

TEST(HfTokenizer, DigitsSplitsEachDigitWhenIndividual) {
  // "½" is a number too (char::is_numeric: Nd, Nl, No).
  const json vocab = {{"a", 0}, {"1", 1}, {"2", 2}, {"12", 3}, {"a1", 4}, {"\xc2\xbd", 5}};
  const json merges = {"a 1", "1 2"};
  auto each =
      LoadJson(CharBpeWith({{"type", "Digits"}, {"individual_digits", true}}, vocab, merges));
  ASSERT_TRUE(each.ok()) << each.status().ToString();
  EXPECT_EQ((*each)->Encode("a12\xc2\xbd"
                            "a",
                            false),
            (Ids{0, 1, 2, 5, 0}));
  auto runs =
      LoadJson(CharBpeWith({{"type", "Digits"}, {"individual_digits", false}}, vocab, merges));
  ASSERT_TRUE(runs.ok()) << runs.status().ToString();
  EXPECT_EQ((*runs)->Encode("a12\xc2\xbd"
                            "a",
                            false),
            (Ids{0, 3, 5, 0}));  // "a" "12½" "a"
  auto none = LoadJson(CharBpeWith(nullptr, vocab, merges));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ((*none)->Encode("a12", false), (Ids{4, 2}));  // the split is what kept "a" apart
}

TEST(HfTokenizer, PunctuationSplitsByEachBehaviorAndTakesAsciiSymbols) {
  const json vocab = {{"a", 0}, {"!", 1}, {"?", 2}, {"a!", 3}, {"!?", 4}, {"?a", 5}, {"$", 6}};
  const json merges = {"a !", "! ?", "? a"};
  auto with = [&](const char* behavior) {
    json p = {{"type", "Punctuation"}};
    if (behavior != nullptr) p["behavior"] = behavior;
    return LoadJson(CharBpeWith(p, vocab, merges));
  };
  const std::pair<const char*, Ids> cases[] = {
      {nullptr, {0, 1, 2, 0}},  // Isolated by default
      {"Isolated", {0, 1, 2, 0}},        {"Removed", {0, 0}},
      {"MergedWithPrevious", {3, 2, 0}},  // "a!" "?" "a"
      {"MergedWithNext", {0, 1, 5}},      // "a" "!" "?a"
      {"Contiguous", {0, 4, 0}},          // "a" "!?" "a"
  };
  for (const auto& [behavior, want] : cases) {
    auto t = with(behavior);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ((*t)->Encode("a!?a", false), want) << (behavior ? behavior : "default");
  }
  // '$' is a Unicode symbol (Sc), but ASCII punctuation to Rust.
  auto removed = with("Removed");
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ((*removed)->Encode("a$a", false), (Ids{0, 0}));
}

TEST(HfTokenizer, WhitespaceKeepsWordsAndSymbolRunsAndDropsTheSpaces) {
  const json vocab = {{"a", 0}, {"b", 1},  {"!", 2},  {"?", 3},
                      {" ", 4}, {"ab", 5}, {"!?", 6}, {"b!", 7}};
  const json merges = {"b !", "a b", "! ?"};
  auto ws = LoadJson(CharBpeWith({{"type", "Whitespace"}}, vocab, merges));
  ASSERT_TRUE(ws.ok()) << ws.status().ToString();
  // "ab" "!?" "a" "b": word characters and the rest are cut apart.
  EXPECT_EQ((*ws)->Encode(" ab!?\t\n a\xe2\x80\x83"
                          "b",
                          false),
            (Ids{5, 6, 0, 1}));
  auto split = LoadJson(CharBpeWith({{"type", "WhitespaceSplit"}}, vocab, merges));
  ASSERT_TRUE(split.ok()) << split.status().ToString();
  // Only the white space cuts: "ab!?" is one word (b ! merges first).
  EXPECT_EQ((*split)->Encode(" ab!?\t\n a\xe2\x80\x83"
                             "b",
                             false),
            (Ids{0, 7, 3, 0, 1}));
}

TEST(HfTokenizer, CharacterClassPreTokenizersRunInASequenceWithMetaspace) {
  json tok = CharBpeWith(
      {{"type", "Sequence"},
       {"pretokenizers",
        {{{"type", "WhitespaceSplit"}},
         {{"type", "Digits"}, {"individual_digits", true}},
         {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "always"}}}}},
      {{"\u2581", 0},
       {"a", 1},
       {"1", 2},
       {"\u2581a", 3},
       {"\u2581"
        "1",
        4},
       {"a1", 5}},
      {"\u2581 a", "\u2581 1", "a 1"});
  auto t = LoadJson(tok);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  // "a" "1" "1" after the spaces go; each word gets its "▁".
  EXPECT_EQ((*t)->Encode("  a11 ", false), (Ids{3, 4, 4}));
}

TEST(HfTokenizer, SplitRegexWhiteSpaceIsUnicodeWhiteSpace) {
  // U+180E (Mongolian vowel separator) left White_Space in Unicode 6.3;
  // Oniguruma's \s does not take it, so "a" and it stay one word.
  const json vocab = {{"a", 0}, {"\xe1\xa0\x8e", 1}, {"a\xe1\xa0\x8e", 2}, {" ", 3}};
  auto t = LoadJson(CharBpeWith(
      {{"type", "Split"}, {"pattern", {{"Regex", "\\S+|\\s+"}}}, {"behavior", "Isolated"}}, vocab,
      {"a \xe1\xa0\x8e"}));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->Encode("a\xe1\xa0\x8e a", false), (Ids{2, 3, 0}));
}

// SpmBpe() with `decoders` as its decoder Sequence.
json SpmWithDecoders(json decoders) {
  json tok = SpmBpe();
  tok["decoder"] = {{"type", "Sequence"}, {"decoders", decoders}};
  return tok;
}

TEST(HfTokenizer, DecoderStepsRunAfterTheFusePointOnTheWholeText) {
  const json replace = {{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}};
  const json strip = {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}};
  // The Llama 2 decoder with its Replace moved after Fuse decodes alike.
  auto t =
      LoadJson(SpmWithDecoders({{{"type", "ByteFallback"}}, {{"type", "Fuse"}}, replace, strip}));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->Decode(Ids{12, 12, 3, 4}), "hi hi\xc3\xa9");
  EXPECT_EQ(Pieces(**t, {12, 12}), (std::vector<std::string>{"hi", " hi", ""}));
  // After Fuse, Metaspace sees one token, the first: it drops every "▁".
  auto m = LoadJson(SpmWithDecoders(
      {{{"type", "Fuse"}},
       {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}}}));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ((*m)->Decode(Ids{12, 8, 12}), "hihi");
}

TEST(HfTokenizer, StreamingHoldsWhatMayBeginAStringReplaceAfterFuse) {
  const json two = {
      {"type", "Replace"}, {"pattern", {{"String", "\u2581\u2581"}}}, {"content", "="}};
  const json one = {{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}};
  auto t = LoadJson(SpmWithDecoders({{{"type", "Fuse"}}, two, one}));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  // "h" "▁" "▁h" "i": the lone "▁" waits to see whether "▁▁" follows.
  EXPECT_EQ(Pieces(**t, {9, 8, 11, 10}), (std::vector<std::string>{"h", "", "=h", "i", ""}));
  EXPECT_EQ(Pieces(**t, {9, 8, 10}), (std::vector<std::string>{"h", "", " i", ""}));
  EXPECT_EQ(Pieces(**t, {9, 8}), (std::vector<std::string>{"h", "", " "}));
}

TEST(HfTokenizer, ByteLevelAfterFuseTakesBytesOnlyWhenEveryCharacterIsInItsAlphabet) {
  auto t = LoadJson(
      SpmWithDecoders({{{"type", "ByteFallback"}}, {{"type", "Fuse"}}, {{"type", "ByteLevel"}}}));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  // "h" "i" are their own bytes, but only the end can tell: held till then.
  EXPECT_EQ(Pieces(**t, {9, 10}), (std::vector<std::string>{"", "", "hi"}));
  // "▁" is outside the alphabet: the whole text is taken as it is.
  EXPECT_EQ(Pieces(**t, {9, 12, 10}), (std::vector<std::string>{"", "h\u2581hi", "i", ""}));
  // é (the fallback bytes C3 A9) is the alphabet's byte E9: invalid alone.
  EXPECT_EQ((*t)->Decode(Ids{3, 4}), "\xef\xbf\xbd");
}

TEST(HfTokenizer, ByteFallbackAfterFuseTakesOnlyATextThatIsOneByteToken) {
  auto t = LoadJson(SpmWithDecoders({{{"type", "Fuse"}}, {{"type", "ByteFallback"}}}));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->Decode(Ids{3}), "\xef\xbf\xbd");  // byte C3 alone is not UTF-8
  EXPECT_EQ(Pieces(**t, {3, 4}), (std::vector<std::string>{"", "<0xC3><0xA9>", ""}));
  EXPECT_EQ(Pieces(**t, {9, 3}), (std::vector<std::string>{"h", "<0xC3>", ""}));  // "h" settles it
}

TEST(HfTokenizer, NfcNormalizerComposes) {
  json tok = {
      {"normalizer", {{"type", "NFC"}}},
      {"decoder", {{"type", "Fuse"}}},
      {"model",
       {{"type", "BPE"}, {"vocab", {{"\xc3\xa9", 0}, {"e", 1}}}, {"merges", json::array()}}}};
  auto t = LoadJson(tok);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ((*t)->Encode("e\xcc\x81", false), (Ids{0}));  // e + U+0301 -> é
  // Invalid UTF-8 is left as it is around the normalized runs (and, with no
  // token nor unk, dropped by BPE).
  EXPECT_EQ((*t)->Encode("e\xcc\x81\xff"
                         "e",
                         false),
            (Ids{0, 1}));
}

TEST(HfTokenizer, RefusesWhatItCannotRunNamingTheField) {
  struct Case {
    json tok;
    StatusCode code;
    std::string names;
  };
  json unigram = CharBpe(json::array());
  unigram["model"]["type"] = "Unigram";
  json lowercase = CharBpe(json::array());
  lowercase["normalizer"] = {{"type", "Lowercase"}};
  json bert = CharBpe(json::array());
  bert["pre_tokenizer"] = {{"type", "BertPreTokenizer"}};
  json wordpiece = CharBpe(json::array());
  wordpiece["decoder"] = {{"type", "WordPiece"}};
  json roberta = CharBpe(json::array());
  roberta["post_processor"] = {{"type", "RobertaProcessing"}};
  json bad_regex = CharBpe(json::array());
  bad_regex["pre_tokenizer"] = {{"type", "Split"},
                                {"pattern", {{"Regex", "(unclosed"}}},
                                {"behavior", "Isolated"},
                                {"invert", false}};
  json bad_behavior = bad_regex;
  bad_behavior["pre_tokenizer"]["pattern"]["Regex"] = "a";
  bad_behavior["pre_tokenizer"]["behavior"] = "Sideways";
  json scripts = CharBpe(json::array());
  scripts["pre_tokenizer"] = {{"type", "Sequence"},
                              {"pretokenizers", {{{"type", "UnicodeScripts"}}}}};
  json digits = CharBpe(json::array());
  digits["pre_tokenizer"] = {{"type", "Digits"}};  // individual_digits is required
  json punctuation = CharBpe(json::array());
  punctuation["pre_tokenizer"] = {{"type", "Punctuation"}, {"behavior", "Apart"}};
  json ctc = CharBpe(json::array());
  ctc["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "Fuse"}}, {{"type", "CTC"}}}}};
  json clash = CharBpe(json::array());
  clash["added_tokens"] = json::array({Added(2, "<x>")});  // 2 is "c"
  const Case cases[] = {
      {unigram, StatusCode::kUnimplemented, "model"},
      {lowercase, StatusCode::kUnimplemented, "Lowercase"},
      {bert, StatusCode::kUnimplemented, "BertPreTokenizer"},
      {wordpiece, StatusCode::kUnimplemented, "WordPiece"},
      {roberta, StatusCode::kUnimplemented, "RobertaProcessing"},
      {CharBpe({"a x"}), StatusCode::kInvalidArgument, "merges[0]"},
      {CharBpe({"a b c"}), StatusCode::kInvalidArgument, "merges[0]"},
      {bad_regex, StatusCode::kInvalidArgument, "pre_tokenizer"},
      {bad_behavior, StatusCode::kInvalidArgument, "behavior"},
      {clash, StatusCode::kInvalidArgument, "added_tokens[0]"},
      {scripts, StatusCode::kUnimplemented, "UnicodeScripts"},
      {digits, StatusCode::kInvalidArgument, "individual_digits"},
      {punctuation, StatusCode::kInvalidArgument, "behavior"},
      {ctc, StatusCode::kUnimplemented, "CTC"},
  };
  for (const Case& c : cases) {
    auto t = LoadJson(c.tok);
    ASSERT_FALSE(t.ok()) << c.tok.dump();
    EXPECT_EQ(t.status().code(), c.code) << t.status().ToString();
    EXPECT_NE(t.status().message().find(c.names), std::string::npos) << t.status().ToString();
  }
}

}  // namespace
}  // namespace kdn::text
