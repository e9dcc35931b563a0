#include "kdn/text/tokenizer.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace kdn::text {
namespace {

// A fresh temporary folder, removed with the object.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("kdn_text_test_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

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

TEST(ByteTokenizer, ByteToUnicodeIsTheGpt2Table) {
  EXPECT_EQ(ByteToUnicode('A'), U'A');
  EXPECT_EQ(ByteToUnicode(' '), U'\u0120');  // "Ġ"
  EXPECT_EQ(ByteToUnicode('\n'), U'\u010a');  // "Ċ"
  EXPECT_EQ(ByteToUnicode(0), U'\u0100');
  EXPECT_EQ(ByteToUnicode(0xAD), U'\u0143');
}

TEST(ByteTokenizer, RefusesTokenizersWithMerges) {
  TempDir dir;
  std::string json = ByteTokenizerJson();
  json.replace(json.find("\"merges\": []"), 12, "\"merges\": [\"a b\"]");
  std::ofstream(dir.path() / "tokenizer.json") << json;
  auto tok = Tokenizer::Load(dir.path());
  EXPECT_EQ(tok.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(tok.status().message().find("tokenizer.json"), std::string::npos);
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
