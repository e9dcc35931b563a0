#pragma once
// OutputText: the rules by which a request's generated tokens become the text
// its client is shown, and by which the request ends: max_tokens, stop token
// ids, stop strings (the text shown never contains a stop string, nor a prefix
// of one that may still complete it, nor a partial UTF-8 character), and the
// model's context. kdn-decode's Batcher applies them to every token; kdn-router
// applies them to the first token, which it sends itself (docs/design.md, step
// 5), so that what the two show joins up.
//
// Not thread-safe; one per request. The tokenizer must outlive it.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kdn/model/config.h"
#include "kdn/text/tokenizer.h"

namespace kdn::text {

struct StopRules {
  int max_tokens = 16;  // tokens generated in all, the first one included
  std::vector<int32_t> stop_ids;
  std::vector<std::string> stop_strings;
};

// What one generated token adds to the text shown.
struct TextDelta {
  std::string text;  // new text safe to show (may be empty)
  bool finished = false;
  std::string finish_reason;  // when finished: "length", "stop" or "context"
};

class OutputText {
 public:
  OutputText(const Tokenizer& tokenizer, StopRules rules);

  // Records `token`, sampled when the request's sequence holds `kv_tokens`
  // tokens of KV (the token's own KV is written next), on a model of
  // `max_context` tokens. A finished request shows all the text held back.
  TextDelta Add(int32_t token, int64_t kv_tokens, int64_t max_context);

  // Records `generated`, the tokens a request generated before it moved
  // here (a resumed request: docs/serving.md, "A decode worker lost"), as
  // Add did when they were sampled, the i-th with prompt_tokens + i tokens of
  // KV; their text counts as shown. The state is then what it was after
  // them, so that the text of the tokens that follow joins up with what the
  // client has. False when they end the request (it should not have gone
  // on); the state is then unspecified.
  bool Replay(std::span<const int32_t> generated, int64_t prompt_tokens, int64_t max_context);

  const std::vector<int32_t>& tokens() const { return tokens_; }

 private:
  // Constant after construction.
  StopRules rules_;

  // The generated tokens decoded as one sequence, so that the text shown in
  // pieces is Tokenizer::Decode of them all (the leading-space strip of
  // sentencepiece decoders applies to the first generated token only).
  std::unique_ptr<DecodeStream> stream_;
  std::vector<int32_t> tokens_;  // generated
  std::string text_;             // decoded generated text, cut at a stop string
  size_t shown_ = 0;             // bytes of text_ already shown
};

// The ids that end a generation by default (what ignore_eos turns off): the
// tokenizer's EOS and every eos id of config.json and generation_config.json
// (Llama 3.1 Instruct ends its turns with <|eot_id|>, which only those name).
std::vector<int32_t> ModelStopIds(const Tokenizer& tokenizer, const model::ModelConfig& config);

// Of `text`, the length that can be shown now: everything but a trailing
// partial UTF-8 character and a trailing piece that is a proper prefix of a
// stop string.
size_t ShowableLength(const std::string& text, const std::vector<std::string>& stop_strings);

}  // namespace kdn::text
