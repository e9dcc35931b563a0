#include "kdn/text/output_text.h"

#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <vector>

namespace kdn::text {
namespace {

ByteTokenizer Bytes() {
  std::vector<int32_t> ids(256);
  std::iota(ids.begin(), ids.end(), 0);
  return ByteTokenizer(ids, 258, 256, 257);
}

constexpr int64_t kPrompt = 10, kContext = 100;

// Adds the bytes of `text` one token each until the request finishes;
// returns the text shown, and the last delta in `last`.
std::string Feed(OutputText& out, const std::string& text, TextDelta* last = nullptr) {
  std::string shown;
  int64_t kv = kPrompt;
  for (unsigned char c : text) {
    TextDelta d = out.Add(c, kv++, kContext);
    shown += d.text;
    if (last != nullptr) *last = d;
    if (d.finished) break;
  }
  return shown;
}

TEST(ShowableLength, HoldsBackPartialCharactersAndStopPrefixes) {
  EXPECT_EQ(ShowableLength("hello", {}), 5u);
  EXPECT_EQ(ShowableLength("caf\xc3", {}), 3u);          // é cut after its lead byte
  EXPECT_EQ(ShowableLength("caf\xc3\xa9", {}), 5u);      // complete
  EXPECT_EQ(ShowableLength("x\xe4\xb8", {}), 1u);        // 3-byte character, 2 arrived
  EXPECT_EQ(ShowableLength("the end", {"ending"}), 4u);  // "end" may become "ending"
  EXPECT_EQ(ShowableLength("the en", {"end", "xyz"}), 4u);
  EXPECT_EQ(ShowableLength("the e", {"done"}), 5u);
}

TEST(OutputText, AStopStringAcrossTokensEndsTheTextBeforeIt) {
  const ByteTokenizer tok = Bytes();
  OutputText out(tok, {.max_tokens = 50, .stop_strings = {"END"}});
  TextDelta last;
  EXPECT_EQ(Feed(out, "abc ENxEND!", &last), "abc ENx");
  EXPECT_TRUE(last.finished);
  EXPECT_EQ(last.finish_reason, "stop");
  EXPECT_EQ(out.tokens().size(), 10u);  // up to the stop string's last token
}

TEST(OutputText, ShowsHeldBackTextOnceTheRequestEnds) {
  const ByteTokenizer tok = Bytes();
  OutputText out(tok, {.max_tokens = 3, .stop_strings = {"xyz"}});
  TextDelta last;
  // The x may begin the stop string, so it waits until the request ends.
  EXPECT_EQ(Feed(out, "axy", &last), "axy");
  EXPECT_EQ(last.text, "xy");
  EXPECT_EQ(last.finish_reason, "length");
}

TEST(OutputText, StopIdsAndTheContextEndTheRequest) {
  const ByteTokenizer tok = Bytes();
  OutputText stop(tok, {.max_tokens = 50, .stop_ids = {'q'}});
  TextDelta d = stop.Add('q', kPrompt, kContext);
  EXPECT_TRUE(d.finished);
  EXPECT_EQ(d.finish_reason, "stop");

  OutputText full(tok, {.max_tokens = 50});
  d = full.Add('a', kContext - 1, kContext);  // room for its KV, the last
  EXPECT_FALSE(d.finished);
  EXPECT_EQ(d.text, "a");
  d = full.Add('b', kContext, kContext);  // no room for its KV
  EXPECT_TRUE(d.finished);
  EXPECT_EQ(d.finish_reason, "context");
}

}  // namespace
}  // namespace kdn::text

namespace kdn::text {
namespace {

TEST(ModelStopIds, TheTokenizersEosAndEveryConfigEosOnceEach) {
  const ByteTokenizer tok = Bytes();
  model::ModelConfig c;
  c.vocab_size = 300;
  c.eos_token_id = 257;
  c.eos_token_ids = {257, 280, 299, 300};  // 300 is outside the vocabulary
  EXPECT_EQ(ModelStopIds(tok, c), (std::vector<int32_t>{257, 280, 299}));
  c.eos_token_ids.clear();
  c.eos_token_id = -1;
  EXPECT_EQ(ModelStopIds(tok, c), (std::vector<int32_t>{257}));
}

}  // namespace
}  // namespace kdn::text
