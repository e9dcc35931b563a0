#pragma once
// RequestFlow: each request from its arrival to its end (docs/serving.md,
// docs/design.md "One request, step by step"), phase by phase:
//   lookup   every usable worker is asked how much of the prompt it reaches
//            (where the router follows its KV events, they answer instead);
//   queued   no decode worker has room: it waits, in arrival order, for at
//            most queue_timeout (the admission queue; past max_queued a new
//            request is refused, RESOURCE_EXHAUSTED);
//   prepare  the chosen decode worker reserves KV and loads what it holds;
//   prefill  the chosen prefill worker computes the rest and answers with
//            the first token, which goes to the client at once (its text by
//            the decode worker's rules, text::OutputText);
//   decode   the decode worker streams the rest.
// Enter is the one place a phase changes (and its deadline is set), by a
// table of allowed moves; every end goes through End, whose Release tells
// the workers still holding the request to let it go. A prefill worker lost
// before the first token: the prefill is sent again (placement's
// PlaceRetry). A decode worker lost: the request resumes at another
// (options.resume), the tokens streamed so far carried into its prompt.
// Placement decides where (placement.h); this class only carries it out,
// reserving in the Ledger what it routes.
//
// Workers are reached through WorkerLink (the Backend's sockets; a test's
// fake) and read through `workers` (what they reported, kept by the
// Backend's worker pool). Reports reach the ledger before OnMessage/OnReport.
//
// Not thread-safe: one thread calls everything, and job callbacks are called
// on it (they must return quickly).

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "kdn/kvbus/key.h"
#include "kdn/router/backend.h"
#include "kdn/router/kv_follower.h"
#include "kdn/router/pins.h"
#include "kdn/router/placement.h"

namespace kdn::proto {
class WorkerMessage;
}  // namespace kdn::proto

namespace kdn::router {

// How the router reaches worker `worker` (an index into the worker views).
class WorkerLink {
 public:
  virtual ~WorkerLink() = default;
  // Sends `m` about `request_id` (stamped into it); never blocks, and a
  // failure is the link's to log: a worker that did not get it is found out
  // by its silence.
  virtual void Send(size_t worker, uint64_t request_id, proto::WorkerMessage& m) = 0;
};

class RequestFlow {
 public:
  using Clock = std::chrono::steady_clock;
  enum class Phase { kLookup, kQueued, kPrepare, kPrefill, kDecode };

  // Borrowed, all outliving the flow: `workers` and `identity` as the pool
  // keeps them, `ledger`, `link`, `tokenizer`; `metrics` may be null.
  // `nonce` makes transfer ids unique across routers.
  RequestFlow(const BackendOptions& options, const WorkerViews& workers,
              const ModelIdentity& identity, Ledger& ledger, WorkerLink& link,
              const text::Tokenizer& tokenizer, Metrics* metrics, uint64_t nonce);

  // Pins (docs/serving.md, "Pinning a prefix"): requests' cache_control
  // pins into `pins` (borrowed, outliving the flow; null: refused), each
  // pinned token counted as `kv_bytes_per_token`, and every request
  // refreshes the pins it reaches. Call before the first Submit.
  void SetPins(PinBook* pins, uint64_t kv_bytes_per_token) {
    pins_ = pins;
    kv_bytes_per_token_ = kv_bytes_per_token;
  }
  // Lookups from the event stream (docs/serving.md, "Lookups from the event
  // stream"): a worker whose KV events `follower` (borrowed; null: none)
  // follows in sync, and that has no shared tier, is not asked about a
  // request without documents; its prefix is what its host tier holds.
  void SetFollower(const KvFollower* follower) { follower_ = follower; }
  // Tells every worker that is up to keep (or let go of) `order`'s keys.
  void SendKeep(const KeepOrder& order);

  // A new request, arrived at `arrival`; `callback` gets its events.
  void Submit(uint64_t id, Job job, JobCallback callback, Clock::time_point arrival);
  // Its client went away: its workers let it go, no further events. False:
  // no such request.
  bool Cancel(uint64_t id);
  // A worker's reply about a request (lookup, prepare, prefill, tokens).
  void OnMessage(size_t worker, const proto::WorkerMessage& m);
  // A worker reported (its view and the ledger are up to date): waiting
  // requests may fit now.
  void OnReport() { DrainQueue(); }
  // Worker `worker` is down (`why`): its requests go on elsewhere where they
  // can, and fail with UNAVAILABLE where not; its lookups count as misses.
  void OnWorkerDown(size_t worker, const std::string& why);
  // Deadlines: a lookup goes ahead with the answers it has, a prepare or a
  // wait in the queue past its time fails.
  void Tick(Clock::time_point now);

  // The requests whose decode worker `worker` holds a reservation for them
  // that they still need: prepared there (or being prepared), not started,
  // not prefilled there. The pings renew them (proto::InfoRequest).
  std::vector<uint64_t> HeldOn(size_t worker) const;

  // Requests waiting in the admission queue; requests in all.
  int Waiting() const;
  size_t size() const { return requests_.size(); }
  // The phase of request `id` (false: no such request), for tests and logs.
  bool PhaseOf(uint64_t id, Phase* phase) const;

 private:
  struct Request {
    uint64_t id = 0;
    Job job;
    JobCallback cb;
    Phase phase = Phase::kLookup;
    std::vector<kvbus::ChunkKey> keys;
    // worker -> leading prompt tokens whose KV it reaches (-1: no answer)
    std::map<size_t, int64_t> prefix;
    std::vector<kvbus::ChunkKey> segment_keys;      // a blend request's documents
    std::map<size_t, int64_t> segment_tokens_held;  // worker -> document tokens it holds
    std::map<size_t, int64_t> resident;  // worker -> of its prefix, tokens resident in its pool
    int lookups_pending = 0;
    Clock::time_point arrival, deadline, last_token;
    Clock::time_point queued_at;  // when it last began to wait (kQueued)
    size_t p = 0, d = 0;
    bool first_token_seen = false;
    int64_t decode_held_tokens = 0;  // from the decode worker's PrepareReply
    // Its decode worker computes the prompt (p == d; docs/serving.md, "Two
    // paths"): no prefill worker, no KV moved, no Start.
    bool local = false;
    int prefill_retries = 0;  // prefill workers lost before the first token
    std::string transfer_id;
    Usage usage;
    // Every token streamed to the client so far, the first included.
    std::vector<int32_t> streamed;
    // Decode workers lost (docs/serving.md, "A decode worker lost"), each
    // once: never chosen again for it, as what they may still send is about
    // a request that has moved on.
    std::set<size_t> lost_decode;
    // Of job.tokens, the last generated_tokens were generated before its
    // last resume and carried into its prompt: the proto's generated_tokens,
    // one name and one meaning on every edge.
    int64_t generated_tokens = 0;

    // Times it was resumed: once per decode worker lost.
    int Resumes() const { return static_cast<int>(lost_decode.size()); }
    int64_t PromptTokens() const {
      return static_cast<int64_t>(job.tokens.size()) - generated_tokens;
    }
  };
  using Iter = std::map<uint64_t, Request>::iterator;

  void Enter(Request& r, Phase next);
  void Release(const Request& r);
  void End(Iter it, JobEvent ev);
  void Fail(uint64_t id, const Status& st);
  void Finish(Iter it, JobEvent ev);
  void TokenOut(Request& r);

  // Asks every usable worker how much of `r`'s prompt it reaches, but those
  // its KV events answer for (PrefixFromEvents); Place once none is left to
  // answer (the caller's, when none was asked).
  Status StartLookup(Request& r);
  // The prompt tokens worker `w` holds by its KV events; nullopt when they
  // do not answer for it.
  std::optional<int64_t> PrefixFromEvents(const Request& r, size_t w) const;
  // Its pin (cache_control) made, the pins it reaches refreshed, both in
  // its usage. RESOURCE_EXHAUSTED past its tenant's bound.
  Status PinPrefix(Request& r);
  PlacementInput InputOf(const Request& r) const;
  void Place(Request& r);
  void Park(Request& r, bool front);
  void DrainQueue();
  void SendPrefill(Request& r);
  bool RetryPrefill(Request& r);
  bool Resume(Request& r, const std::string& why);

  void OnLookupReply(size_t w, Request& r, const proto::WorkerMessage& m);
  void OnPrepareReply(size_t w, Request& r, const proto::WorkerMessage& m);
  void OnPrefillReply(size_t w, Iter it, const proto::WorkerMessage& m);
  void OnTokens(size_t w, Iter it, const proto::WorkerMessage& m);

  // Constant after construction.
  const BackendOptions options_;
  const WorkerViews& workers_;
  const ModelIdentity& identity_;
  Ledger& ledger_;
  WorkerLink& link_;
  const text::Tokenizer& tokenizer_;
  Metrics* const metrics_;
  const uint64_t nonce_;

  const KvFollower* follower_ = nullptr;
  PinBook* pins_ = nullptr;
  uint64_t kv_bytes_per_token_ = 0;

  std::map<uint64_t, Request> requests_;
  // Requests in kQueued, oldest first (ids of requests gone meanwhile are
  // skipped when met).
  std::deque<uint64_t> queued_;
};

}  // namespace kdn::router
