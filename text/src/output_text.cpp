#include "kdn/text/output_text.h"

#include <algorithm>
#include <utility>

namespace kdn::text {

size_t ShowableLength(const std::string& text, const std::vector<std::string>& stop_strings) {
  size_t n = text.size();
  // A trailing partial UTF-8 character: a lead byte whose continuation bytes
  // have not all arrived.
  for (size_t back = 1; back <= std::min<size_t>(3, n); ++back) {
    const auto c = static_cast<unsigned char>(text[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (need > back) n -= back;
    break;
  }
  // A tail that a stop string could still complete is held back.
  size_t hold = 0;
  for (const std::string& stop : stop_strings) {
    if (stop.empty()) continue;
    for (size_t k = std::min(stop.size() - 1, n); k > hold; --k) {
      if (text.compare(n - k, k, stop, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  return n - hold;
}

std::vector<int32_t> ModelStopIds(const Tokenizer& tokenizer, const model::ModelConfig& config) {
  std::vector<int32_t> ids;
  auto add = [&](int32_t id) {
    if (id >= 0 && id < config.vocab_size && std::find(ids.begin(), ids.end(), id) == ids.end()) {
      ids.push_back(id);
    }
  };
  add(tokenizer.eos_id());
  for (int id : config.eos_token_ids) add(id);
  add(config.eos_token_id);
  return ids;
}

OutputText::OutputText(const Tokenizer& tokenizer, StopRules rules)
    : rules_(std::move(rules)), stream_(tokenizer.NewDecodeStream()) {}

TextDelta OutputText::Add(int32_t token, int64_t kv_tokens, int64_t max_context) {
  tokens_.push_back(token);
  text_ += stream_->Next(token);
  // A request that ends for a reason other than a stop string shows what the
  // decoder still holds (an incomplete character becomes U+FFFD, as Decode
  // of the whole shows it); the stop strings are looked for in that too.
  const bool stop_id =
      std::find(rules_.stop_ids.begin(), rules_.stop_ids.end(), token) != rules_.stop_ids.end();
  const bool length = static_cast<int>(tokens_.size()) >= rules_.max_tokens;
  const bool context = kv_tokens + 1 > max_context;
  if (stop_id || length || context) text_ += stream_->Finish();
  TextDelta d;
  // A stop string ends the text where it begins; the client never sees it.
  size_t cut = std::string::npos;
  for (const std::string& stop : rules_.stop_strings) {
    if (stop.empty()) continue;
    // Only the new tail can complete a stop string not found before.
    const size_t from = shown_ > stop.size() ? shown_ - stop.size() : 0;
    const size_t at = text_.find(stop, from);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut != std::string::npos) {
    text_.resize(cut);
    d.finished = true;
    d.finish_reason = "stop";
  } else if (stop_id) {
    d.finished = true;
    d.finish_reason = "stop";
  } else if (length) {
    d.finished = true;
    d.finish_reason = "length";
  } else if (context) {
    d.finished = true;
    d.finish_reason = "context";
  }
  const size_t show = d.finished ? text_.size() : ShowableLength(text_, rules_.stop_strings);
  if (show > shown_) {
    d.text = text_.substr(shown_, show - shown_);
    shown_ = show;
  }
  return d;
}

bool OutputText::Replay(std::span<const int32_t> generated, int64_t prompt_tokens,
                        int64_t max_context) {
  for (size_t i = 0; i < generated.size(); ++i) {
    if (Add(generated[i], prompt_tokens + static_cast<int64_t>(i), max_context).finished) {
      return false;
    }
  }
  return true;
}

}  // namespace kdn::text
