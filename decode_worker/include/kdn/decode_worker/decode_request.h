#pragma once
// What goes into the decode worker's Decoder and what comes out of it: the
// request a router prepares, and the outputs of its calls (docs/serving.md,
// "The decode worker: scheduler and executor").

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kdn/decode_worker/batcher.h"

namespace kdn::decode_worker {

// Lanes of the store I/O thread (JobThread lanes, most urgent first):
// lookups a router waits on (about a second; DecodeService runs them on a
// thread of their own), then loads a Prepare reply waits on, then stores
// nobody waits on.
inline constexpr int kLookupLane = 0;
inline constexpr int kLoadLane = 1;
inline constexpr int kStoreLane = 2;
inline constexpr int kStoreLanes = 3;

// A request as the decode worker takes it (from a router's prepare).
struct DecodeRequest {
  std::vector<int32_t> tokens;  // the prompt
  std::string ns;               // the tenant's cache namespace
  // Unique per request; names the slices of the prompt's partial tail (of
  // the whole prompt when blended).
  std::string transfer_id;
  // The prompt's KV was fused by blend: nothing loaded or stored by prefix key.
  bool blended = false;
  // Prefill it here; neither blended nor resumed.
  bool local_prefill = false;
  // The leading tokens its lookup reached (pool and lower tiers): a local
  // prefill loads nothing when the pool holds as many.
  int64_t lookup_tokens = 0;
  // A blended request's emphasis (blend::Emphasis, docs/serving.md,
  // "Emphasis"): the attention bias its sequence carries from its Prepare
  // on, in every decode step (a blended request is never preempted).
  std::optional<engine::KvSequence::AttentionBias> emphasis;
  // The router's request id, shown in the Decoder's log lines (ReqId) only.
  uint64_t request_id = 0;
  // Sampling, max_tokens, stops; spec.id is set by Prepare. A resumed
  // request's spec.generated are the last tokens of `tokens`.
  RequestSpec spec;

  // The prompt's tokens, less those a resumed request generated before.
  int64_t PromptTokens() const {
    return static_cast<int64_t>(tokens.size() - spec.generated.size());
  }
};

// The KV a request's Prepare reserves, in tokens: kdn::KvTokensAdmitted
// (common/kv_block.h) of the tokens it is sent, within the model's context.
int64_t KvTokensAdmitted(const DecodeRequest& r, int64_t max_context);

// A Prepare's load is in: the leading `held_tokens` tokens of the prompt
// (full chunks, then tail pieces) are in the request's blocks and need not
// travel.
struct PrepareDone {
  uint64_t id = 0;
  int64_t held_tokens = 0;
  int64_t resident_tokens = 0;  // of held_tokens, attached from the pool
};

// A local prefill is done: its first token is drawn and it runs. Its
// events start at the second token (the router sends the first).
struct LocalPrefillDone {
  uint64_t id = 0;
  int32_t first_token = -1;
  int64_t held_tokens = 0;      // leading prompt tokens it did not compute (pool and KDN)
  int64_t resident_tokens = 0;  // of held_tokens, attached from the pool
  int64_t computed_tokens = 0;
  uint64_t kv_bytes_loaded = 0;  // KV copied into the pool from its lower tiers
};

// What Decoder calls produce, appended in order.
struct DecoderOutput {
  std::vector<PrepareDone> prepared;
  std::vector<LocalPrefillDone> prefilled;  // before `events`, which may follow them
  std::vector<TokenEvent> events;
  bool empty() const { return prepared.empty() && prefilled.empty() && events.empty(); }
};

}  // namespace kdn::decode_worker
