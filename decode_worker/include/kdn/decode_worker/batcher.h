#pragma once
// Batcher: the decode worker's continuous batching. Requests join with their
// prompt's KV already in a sequence and their first token already sampled (by
// a prefill worker), leave when they finish, and every Step advances all of
// them by one token in one batched model call.
//
// Per request it honours max_tokens, stop token ids and stop strings by the
// rules of text::OutputText (which the router applies to the first token), and
// seeded sampling that continues the prefill worker's random stream, so that a
// request's tokens do not depend on which other requests share its batches.
//
// Not thread-safe: the decode worker's loop owns it (and the Engine).

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/engine.h"
#include "kdn/engine/sampler.h"
#include "kdn/model/sampling.h"
#include "kdn/text/tokenizer.h"

namespace kdn::decode_worker {

struct RequestSpec {
  uint64_t id = 0;
  model::SamplingParams sampling;
  int max_tokens = 16;  // tokens generated in all, the first one included
  std::vector<int32_t> stop_ids;
  std::vector<std::string> stop_strings;
  // The router has already sent the first token to the client (it does as
  // soon as the prefill worker has it, by text::OutputText's rules): Admit
  // emits no event for it.
  bool first_token_sent = false;
  // A resumed request (docs/serving.md, "A decode worker lost"): the tokens
  // it generated before this worker took it over, whose KV is the tail of
  // its sequence. Admit replays them, so that they count toward max_tokens
  // and stop strings and their text is not shown again, and moves the
  // sampler's stream past them; the request then goes on as if it had never
  // moved.
  std::vector<int32_t> generated;
};

// What one Step (or Admit) produced for one request.
struct TokenEvent {
  uint64_t id = 0;
  int32_t token = -1;  // -1 when the event only finishes the request
  std::string text;    // new text safe to show (may be empty)
  bool finished = false;
  std::string finish_reason;  // "length", "stop", "context", "cancelled"
  // Not OK when the request failed (finished is then set, finish_reason
  // empty). The Batcher never fails a request itself; its owner does.
  Status error;
};

class Batcher {
 public:
  // Called for a request that finishes (or is cancelled), before its KV
  // blocks are given back: `seq` holds the KV of the prompt and of every
  // generated token but the last, `generated` all generated tokens. The
  // decode worker stores the conversation's chunks from here.
  using FinishHook = std::function<void(uint64_t id, const engine::KvSequence& seq,
                                        const std::vector<int32_t>& generated)>;

  // `tokenizer` turns tokens into text for stop strings and events; the
  // model and tokenizer must outlive the Batcher.
  Batcher(engine::Engine& model, const text::Tokenizer& tokenizer, int max_batch);
  ~Batcher();

  // Adds a request whose prompt KV is in `seq` and whose first token
  // `first_token` was sampled from the prompt's last logits (it is emitted as
  // an event now, unless spec.first_token_sent; should it then end the
  // request, as the router's text::OutputText will have said, only the end
  // is emitted, as token -1). INVALID_ARGUMENT for bad sampling parameters, a
  // duplicate id, an empty sequence, or spec.generated not shorter than
  // max_tokens or not within the sequence; RESOURCE_EXHAUSTED when max_batch
  // requests run.
  Status Admit(const RequestSpec& spec, engine::KvSequence seq, int32_t first_token,
               std::vector<TokenEvent>* events);

  // One decode step for every running request; finished requests leave and
  // give their KV blocks back. A model error fails the step and leaves every
  // request as it was. `pieces`: prefill pieces of requests not in the
  // batch, computed in the same pass (Engine::DecodeSampleWith).
  Status Step(std::vector<TokenEvent>* events, std::span<const engine::Engine::Piece> pieces = {});

  // Finishes a request now ("cancelled"); NOT_FOUND if it is not running.
  Status Cancel(uint64_t id, std::vector<TokenEvent>* events);

  size_t running() const { return requests_.size(); }

  // The KV blocks the next Step takes: one for each running request whose
  // next token's KV passes the blocks its sequence holds.
  int BlocksForStep() const;

  // A request taken out of the batch unfinished (preempted): no event, no
  // finish hook. `seq` holds the KV of its prompt and of every generated
  // token but the last; `generated` holds them all (of a resumed request,
  // those generated before it came here too).
  struct Taken {
    RequestSpec spec;
    engine::KvSequence seq;
    std::vector<int32_t> generated;
  };
  // NOT_FOUND if `id` is not running.
  Result<Taken> Take(uint64_t id);

  void SetFinishHook(FinishHook hook) { on_finish_ = std::move(hook); }

  // Tokens generated so far by a running request (nullptr if not running).
  const std::vector<int32_t>* Generated(uint64_t id) const;

 private:
  struct Request;
  // Records `token` for `r` and emits its event; true when `r` is finished.
  bool Accept(Request& r, int32_t token, std::vector<TokenEvent>* events);

  engine::Engine& model_;
  const text::Tokenizer& tokenizer_;
  const int max_batch_;
  std::map<uint64_t, std::unique_ptr<Request>> requests_;  // by id: a stable batch order
  FinishHook on_finish_;
};

}  // namespace kdn::decode_worker
