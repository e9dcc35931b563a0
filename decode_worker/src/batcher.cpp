#include "kdn/decode_worker/batcher.h"

#include <utility>

#include "kdn/text/output_text.h"

namespace kdn::decode_worker {

struct Batcher::Request {
  RequestSpec spec;
  engine::KvSequence seq;
  engine::Sampler sampler;
  text::OutputText output;  // the generated tokens and the text shown of them
  int32_t pending = -1;     // the last token, whose KV the next step writes

  Request(const RequestSpec& s, engine::KvSequence q, const text::Tokenizer& tokenizer)
      : spec(s),
        seq(std::move(q)),
        sampler(s.sampling),
        output(tokenizer, {s.max_tokens, s.stop_ids, s.stop_strings}) {}
};

Batcher::Batcher(engine::Engine& model, const text::Tokenizer& tokenizer, int max_batch)
    : model_(model), tokenizer_(tokenizer), max_batch_(max_batch) {}

Batcher::~Batcher() = default;

const std::vector<int32_t>* Batcher::Generated(uint64_t id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : &it->second->output.tokens();
}

bool Batcher::Accept(Request& r, int32_t token, std::vector<TokenEvent>* events) {
  // Positions, not KV slots: a prompt over pruned documents holds fewer.
  text::TextDelta d = r.output.Add(token, r.seq.next_position(), model_.config().max_context);
  r.pending = token;
  events->push_back(
      TokenEvent{r.spec.id, token, std::move(d.text), d.finished, std::move(d.finish_reason)});
  return events->back().finished;
}

Status Batcher::Admit(const RequestSpec& spec, engine::KvSequence seq, int32_t first_token,
                      std::vector<TokenEvent>* events) {
  KDN_RETURN_IF_ERROR(model::ValidateSamplingParams(spec.sampling));
  if (spec.max_tokens < 1) return InvalidArgument("max_tokens must be at least 1");
  if (seq.length() == 0)
    return InvalidArgument("request " + std::to_string(spec.id) + " has no prompt KV");
  if (requests_.count(spec.id) != 0) {
    return InvalidArgument("request " + std::to_string(spec.id) + " is already running");
  }
  if (static_cast<int>(requests_.size()) >= max_batch_) {
    return ResourceExhausted("decode batch is full (" + std::to_string(max_batch_) + " requests)");
  }
  const auto g = static_cast<int64_t>(spec.generated.size());
  if (g >= spec.max_tokens || g >= seq.length()) {
    return InvalidArgument("request " + std::to_string(spec.id) + " resumes after " +
                           std::to_string(g) + " generated tokens, but max_tokens is " +
                           std::to_string(spec.max_tokens) + " and its sequence holds " +
                           std::to_string(seq.length()));
  }
  auto r = std::make_unique<Request>(spec, std::move(seq), tokenizer_);
  // The tokens a resumed request generated before; their text was shown.
  if (!r->output.Replay(spec.generated, r->seq.next_position() - g, model_.config().max_context)) {
    return InvalidArgument("request " + std::to_string(spec.id) +
                           " resumes past its end: the tokens it generated before end it");
  }
  // The prefill worker drew the first token from this stream, after the
  // draws of the tokens generated before.
  r->sampler.Advance(static_cast<int>(g) + 1);
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
    on_finish_(spec.id, r->seq, r->output.tokens());
  }
  return Status::Ok();
}

Status Batcher::Step(std::vector<TokenEvent>* events,
                     std::span<const engine::Engine::Piece> pieces) {
  if (requests_.empty()) return Status::Ok();
  std::vector<engine::KvSequence*> seqs;
  std::vector<int32_t> tokens;
  std::vector<engine::Sampler*> samplers;
  for (auto& [id, r] : requests_) {
    seqs.push_back(&r->seq);
    tokens.push_back(r->pending);
    samplers.push_back(&r->sampler);
  }
  // Drawn where the logits live: on a GPU only the ids come back.
  std::vector<int32_t> next_tokens;
  KDN_RETURN_IF_ERROR(model_.DecodeSampleWith(seqs, tokens, samplers, &next_tokens, pieces));
  size_t row = 0;
  for (auto it = requests_.begin(); it != requests_.end(); ++row) {
    Request& r = *it->second;
    const int32_t next = next_tokens[row];
    if (Accept(r, next, events)) {
      if (on_finish_) on_finish_(it->first, r.seq, r.output.tokens());
      it = requests_.erase(it);  // its KV blocks go back with the sequence
    } else {
      ++it;
    }
  }
  return Status::Ok();
}

int Batcher::BlocksForStep() const {
  int blocks = 0;
  for (const auto& [id, r] : requests_) blocks += r->seq.length() + 1 > r->seq.reserved();
  return blocks;
}

Result<Batcher::Taken> Batcher::Take(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return NotFound("request " + std::to_string(id) + " is not running");
  Request& r = *it->second;
  Taken t{r.spec, std::move(r.seq), r.output.tokens()};
  requests_.erase(it);
  return t;
}

Status Batcher::Cancel(uint64_t id, std::vector<TokenEvent>* events) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return NotFound("request " + std::to_string(id) + " is not running");
  events->push_back(TokenEvent{id, -1, {}, true, "cancelled"});
  if (on_finish_) on_finish_(id, it->second->seq, it->second->output.tokens());
  requests_.erase(it);
  return Status::Ok();
}

}  // namespace kdn::decode_worker
