#include "kdn/text/tokenizer.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "kdn/testing/temp_dir.h"

namespace kdn::text {
namespace {

using kdn::testing::TempDir;

TEST(ByteTokenizer, LoadsWhatKdnMkmodelWritesAndRoundTripsUtf8) {
  TempDir dir;
  std::ofstream(dir.path() / "tokenizer.json") << ByteTokenizerJson();
  std::ofstream(dir.path() / "tokenizer_config.json") << ByteTokenizerConfigJson();
  auto tok = Tokenizer::Load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  EXPECT_EQ((*tok)->bos_id(), 256);
  EXPECT_EQ((*tok)->eos_id(), 257);
  EXPECT_EQ((*tok)->vocab_size(), 258);
  const std::string text = "Grüße, 世界! \n\t\x01";
  const auto ids = (*tok)->Encode(text, true);
  ASSERT_EQ(ids.size(), text.size() + 1);
  EXPECT_EQ(ids[0], 256);
  EXPECT_EQ(ids[1], 'G');
  EXPECT_EQ((*tok)->Decode(ids), text);  // the BOS is left out
}

// The tokens that hold a phrase (what a document's `emphasize` names): a
// character split across byte tokens is held whole, from its first byte.
TEST(ByteTokenizer, TokensHoldingAPhraseCoverItsBytesFromTheFirstOfASplitCharacter) {
  std::vector<int32_t> byte_ids(256);
  for (int b = 0; b < 256; ++b) byte_ids[b] = b;
  const ByteTokenizer tok(byte_ids, 258, 256, 257);
  const std::string text =
      "Gr\xc3\xbc\xc3\x9f"
      "e, Gilpe is a baker.";  // "Grüße, ..."
  const std::vector<int32_t> ids = tok.Encode(text, false);
  ASSERT_EQ(ids.size(), text.size());
  using Span = std::optional<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(TokensHolding(tok, ids, "Gilpe"), Span({9, 14}));
  EXPECT_EQ(TokensHolding(tok, ids, "baker."), Span({20, 26}));  // to the last token
  EXPECT_EQ(TokensHolding(tok, ids, "\xc3\xbc"), Span({2, 4}));  // ü: both of its bytes
  EXPECT_EQ(TokensHolding(tok, ids, "\xc3\xbc\xc3\x9f"), Span({2, 6}));
  EXPECT_EQ(TokensHolding(tok, ids, "a"), Span({18, 19}));  // the first occurrence
  EXPECT_EQ(TokensHolding(tok, ids, "cook"), std::nullopt);
  EXPECT_EQ(TokensHolding(tok, ids, ""), std::nullopt);
  EXPECT_EQ(TokensHolding(tok, {}, "G"), std::nullopt);
}

TEST(ByteTokenizer, ByteToUnicodeIsTheGpt2Table) {
  EXPECT_EQ(ByteToUnicode('A'), U'A');
  EXPECT_EQ(ByteToUnicode(' '), U'\u0120');   // "Ġ"
  EXPECT_EQ(ByteToUnicode('\n'), U'\u010a');  // "Ċ"
  EXPECT_EQ(ByteToUnicode(0), U'\u0100');
  EXPECT_EQ(ByteToUnicode(0xAD), U'\u0143');
}

TEST(ByteTokenizer, TheLoadedFileAndTheBuiltOneAgreeOnIdsAndText) {
  TempDir dir;
  std::ofstream(dir.path() / "tokenizer.json") << ByteTokenizerJson();
  std::ofstream(dir.path() / "tokenizer_config.json") << ByteTokenizerConfigJson();
  auto tok = Tokenizer::Load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status().ToString();
  std::vector<int32_t> byte_ids(256);
  for (int b = 0; b < 256; ++b) byte_ids[b] = b;
  const ByteTokenizer built(byte_ids, 258, 256, 257);
  std::string every_byte(256, '\0');
  for (int b = 0; b < 256; ++b) every_byte[b] = static_cast<char>(b);
  for (const std::string& text : {every_byte, std::string("a<b>c \xe4\xb8"), std::string()}) {
    EXPECT_EQ((*tok)->Encode(text, true), built.Encode(text, true));
    EXPECT_EQ((*tok)->Encode(text, false), built.Encode(text, false));
    const auto ids = built.Encode(text, false);
    EXPECT_EQ((*tok)->Decode(ids), built.Decode(ids));
  }
  // As in tokenizers, the text of an added token is that token.
  EXPECT_EQ((*tok)->Encode("a<s>", false), (std::vector<int32_t>{'a', 256}));
  // Invalid UTF-8 decodes as tokenizers' ByteLevel decoder shows it: one
  // U+FFFD per maximal invalid sequence.
  const auto ids = built.Encode(
      "a\xff\xe4\xb8"
      "b",
      false);
  EXPECT_EQ(built.Decode(ids),
            "a\xef\xbf\xbd\xef\xbf\xbd"
            "b");
}

// ByteTokenizerJson() with `from` replaced by `to` (each must occur).
std::string Edited(const std::string& from, const std::string& to) {
  std::string json = ByteTokenizerJson();
  const size_t at = json.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return at == std::string::npos ? json : json.replace(at, from.size(), to);
}

// Found by tests/fuzz/tokenizer_fuzz.cpp: ids that are no token ids (a
// negative one wrote before the id table, a huge one sized it, a float one
// was cast), two bytes with one id (Decode could not tell them apart), a
// BOS or EOS with a byte's id (Decode showed it) and a missing field (read
// with const operator[]) were taken.
TEST(ByteTokenizer, RefusesIdsThatAreNotTokenIdsAndBytesSharingAnId) {
  const std::string cases[] = {
      Edited("\"A\": 65", "\"A\": -1"),
      Edited("\"A\": 65", "\"A\": 2000000000"),
      Edited("\"A\": 65", "\"A\": 65.5"),
      Edited("\"A\": 65", "\"A\": \"65\""),
      Edited("\"A\": 65", "\"A\": 66"),
      Edited("\"id\": 257", "\"id\": -7"),
      Edited("\"id\": 257", "\"id\": 1e300"),
      Edited("\"id\": 256", "\"id\": 255"),  // BOS with a byte's id
      Edited("\"id\": 257", "\"id\": 10"),   // EOS with a byte's id
      Edited("\"merges\": [],", ""),
      "[1, 2]",
  };
  for (const std::string& json : cases) {
    TempDir dir;
    std::ofstream(dir.path() / "tokenizer.json") << json;
    std::ofstream(dir.path() / "tokenizer_config.json") << ByteTokenizerConfigJson();
    auto tok = Tokenizer::Load(dir.path());
    EXPECT_EQ(tok.status().code(), StatusCode::kInvalidArgument) << json;
  }
}

}  // namespace
}  // namespace kdn::text
