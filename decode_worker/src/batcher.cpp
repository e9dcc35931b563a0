#include "kdn/decode_worker/batcher.h"

#include <algorithm>

namespace kdn::decode_worker {

struct Batcher::Request {
  RequestSpec spec;
  engine::KvSequence seq;
  engine::Sampler sampler;
  std::vector<int32_t> tokens;  // generated
  std::string text;             // decoded generated text
  size_t shown = 0;             // bytes of `text` already emitted
  int32_t pending = -1;         // the last token, whose KV the next step writes

  Request(const RequestSpec& s, engine::KvSequence q)
      : spec(s), seq(std::move(q)), sampler(s.sampling) {}
};

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

Batcher::Batcher(engine::CpuEngine& model, const text::Tokenizer& tokenizer, int max_batch)
    : model_(model), tokenizer_(tokenizer), max_batch_(max_batch) {}

Batcher::~Batcher() = default;

const std::vector<int32_t>* Batcher::Generated(uint64_t id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : &it->second->tokens;
}

bool Batcher::Accept(Request& r, int32_t token, std::vector<TokenEvent>* events) {
  return Accept(tokenizer_, model_.config().max_context, r.seq.length(), r, token, events);
}

bool Batcher::Accept(const text::Tokenizer& tokenizer, int64_t max_context, int64_t kv_tokens,
                     Request& r, int32_t token, std::vector<TokenEvent>* events) {
  r.tokens.push_back(token);
  r.text += tokenizer.Decode(std::span<const int32_t>(&token, 1));
  TokenEvent ev{r.spec.id, token, {}, false, {}};
  // A stop string ends the text where it begins; the client never sees it.
  size_t cut = std::string::npos;
  for (const std::string& stop : r.spec.stop_strings) {
    if (stop.empty()) continue;
    // Only the new tail can complete a stop string not found before.
    const size_t from = r.shown > stop.size() ? r.shown - stop.size() : 0;
    const size_t at = r.text.find(stop, from);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut != std::string::npos) {
    r.text.resize(cut);
    ev.finished = true;
    ev.finish_reason = "stop";
  } else if (std::find(r.spec.stop_ids.begin(), r.spec.stop_ids.end(), token) !=
             r.spec.stop_ids.end()) {
    ev.finished = true;
    ev.finish_reason = "stop";
  } else if (static_cast<int>(r.tokens.size()) >= r.spec.max_tokens) {
    ev.finished = true;
    ev.finish_reason = "length";
  } else if (kv_tokens + 1 > max_context) {
    ev.finished = true;
    ev.finish_reason = "context";
  }
  const size_t show = ev.finished ? r.text.size() : ShowableLength(r.text, r.spec.stop_strings);
  if (show > r.shown) {
    ev.text = r.text.substr(r.shown, show - r.shown);
    r.shown = show;
  }
  r.pending = token;
  events->push_back(std::move(ev));
  return events->back().finished;
}

Status Batcher::Admit(const RequestSpec& spec, engine::KvSequence seq, int32_t first_token,
                      std::vector<TokenEvent>* events) {
  KDN_RETURN_IF_ERROR(model::ValidateSamplingParams(spec.sampling));
  if (spec.max_tokens < 1) return InvalidArgument("max_tokens must be at least 1");
  if (seq.length() == 0) return InvalidArgument("request " + std::to_string(spec.id) + " has no prompt KV");
  if (requests_.count(spec.id) != 0) {
    return InvalidArgument("request " + std::to_string(spec.id) + " is already running");
  }
  if (static_cast<int>(requests_.size()) >= max_batch_) {
    return ResourceExhausted("decode batch is full (" + std::to_string(max_batch_) + " requests)");
  }
  auto r = std::make_unique<Request>(spec, std::move(seq));
  r->sampler.Advance(1);  // the prefill worker drew the first token from this stream
  std::vector<TokenEvent> first;
  const bool finished = Accept(*r, first_token, &first);
  if (spec.first_token_sent) {
    // The client has it: what Accept recorded stays, for the text that follows.
    if (finished) events->push_back(TokenEvent{spec.id, -1, {}, true, first[0].finish_reason});
  } else {
    events->push_back(std::move(first[0]));
  }
  if (!finished) {
    requests_.emplace(spec.id, std::move(r));
  } else if (on_finish_) {
    on_finish_(spec.id, r->seq, r->tokens);
  }
  return Status::Ok();
}

TokenEvent Batcher::FirstTokenEvent(const text::Tokenizer& tokenizer, const RequestSpec& spec,
                                    int64_t prompt_tokens, int64_t max_context,
                                    int32_t first_token) {
  Request r(spec, engine::KvSequence());
  std::vector<TokenEvent> events;
  Accept(tokenizer, max_context, prompt_tokens, r, first_token, &events);
  return std::move(events[0]);
}

Status Batcher::Step(std::vector<TokenEvent>* events) {
  if (requests_.empty()) return Status::Ok();
  std::vector<engine::KvSequence*> seqs;
  std::vector<int32_t> tokens;
  for (auto& [id, r] : requests_) {
    seqs.push_back(&r->seq);
    tokens.push_back(r->pending);
  }
  std::vector<float> logits;
  KDN_RETURN_IF_ERROR(model_.DecodeStep(seqs, tokens, &logits));
  const size_t vocab = static_cast<size_t>(model_.config().vocab_size);
  size_t row = 0;
  for (auto it = requests_.begin(); it != requests_.end(); ++row) {
    Request& r = *it->second;
    const int32_t next = r.sampler.Sample(std::span<const float>(&logits[row * vocab], vocab));
    if (Accept(r, next, events)) {
      if (on_finish_) on_finish_(it->first, r.seq, r.tokens);
      it = requests_.erase(it);  // its KV blocks go back with the sequence
    } else {
      ++it;
    }
  }
  return Status::Ok();
}

Status Batcher::Cancel(uint64_t id, std::vector<TokenEvent>* events) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return NotFound("request " + std::to_string(id) + " is not running");
  events->push_back(TokenEvent{id, -1, {}, true, "cancelled"});
  if (on_finish_) on_finish_(id, it->second->seq, it->second->tokens);
  requests_.erase(it);
  return Status::Ok();
}

}  // namespace kdn::decode_worker
