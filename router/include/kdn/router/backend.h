#pragma once
// Backend: the router's side of the control plane (docs/serving.md). Holds
// one connection per worker, pings them, and drives each request through
//   lookup   ask every live worker how much of the prompt's prefix it reaches;
//   prepare  the chosen decode worker reserves KV and loads what it holds;
//   prefill  the chosen prefill worker computes the rest, pushes the KV and
//            answers with the first token, which goes to the client at once
//            (shown by the decode worker's rules, text::OutputText);
//   decode   the decode worker streams tokens from the second on until the
//            request finishes. A first token that ends the request (max_tokens
//            1, a stop token or string) ends it there, and the decode worker
//            is told to let go of what it reserved.
// A request with documents (Job::blend) also asks, at lookup, which workers
// hold the documents' KV; its KV is blended, so it travels under the
// request's transfer key and the decode worker never stores it. Inject sends
// documents one by one to the prefill workers to store in the KDN.
// A worker silent for `worker_timeout`, or whose connection closes, is down,
// and new requests go elsewhere until it answers again. Its requests go on
// where they can: a prefill worker's, before their first token, at another
// prefill worker; a decode worker's (BackendOptions::resume) at another
// decode worker, which takes the prompt and the tokens streamed so far as a
// new prompt (their KV loaded from the KDN where held, computed by a prefill
// worker where not) and goes on from there, the client's stream unbroken.
// The others fail with UNAVAILABLE.
//
// Its parts (docs/design.md, "The router's parts"): the worker pool
// (router/src/worker_pool.h) keeps the connections and what workers
// reported; placement (placement.h) decides where; the request flow
// (request_flow.h) drives each request; the injector (injector.h) stores
// documents. Backend owns them and runs their loop.
//
// Thread-safe: Submit, Cancel and Workers from any thread. One background
// thread owns the sockets and calls the job callbacks.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/net/curve.h"
#include "kdn/model/sampling.h"
#include "kdn/router/metrics.h"
#include "kdn/router/openai.h"
#include "kdn/router/pins.h"
#include "kdn/router/request_spec.h"
#include "kdn/router/worker_view.h"
#include "kdn/text/tokenizer.h"

namespace kdn::router {

// How far an injection has come.
struct InjectProgress {
  int total = 0;
  int done = 0;          // stored + held + failed
  int stored = 0;        // computed and stored
  int already_held = 0;  // the KDN had them
  int failed = 0;
  int64_t tokens = 0;  // of the documents done
  // Tokens whose KV was stored: the stored documents' tokens, fewer when
  // pruned.
  int64_t stored_tokens = 0;
  // Of failed: documents of an edit whose original the worker's KDN lacked.
  int missing_base = 0;
  // The first failure's code (kOk: none failed): what an edit or a steering
  // vector answers with.
  StatusCode first_error_code = StatusCode::kOk;
  std::vector<std::pair<int, std::string>> errors;  // (document index, message)
};

// What a job reports, in order: any number of kTokens, then exactly one kDone
// or kError.
struct JobEvent {
  enum class Kind { kTokens, kProgress, kDone, kError };
  Kind kind = Kind::kTokens;
  std::string text;           // kTokens and kDone: new text (may be empty)
  int tokens = 0;             // kTokens and kDone: tokens this event adds
  std::string finish_reason;  // kDone
  Usage usage;                // kDone
  Status error;               // kError
  InjectProgress progress;    // an injection's kProgress and kDone
};
// Called on the backend thread; must return quickly (post work elsewhere).
using JobCallback = std::function<void(JobEvent)>;

struct BackendOptions {
  std::vector<std::string> prefill_endpoints;
  std::vector<std::string> decode_endpoints;
  std::chrono::milliseconds ping_interval{250};
  // Long enough for a loaded machine: a healthy worker on 2 busy cores once
  // went 3 s without its answer reaching the router (deployment_preemption
  // in CI), and was held down with 17 requests in flight. A worker that
  // dies is down at once (its connection closes); this catches a hung one.
  std::chrono::milliseconds worker_timeout{10000};
  std::chrono::milliseconds lookup_timeout{1000};
  std::chrono::milliseconds prepare_timeout{10000};
  // Requests no decode worker has room for (KV for what they need now,
  // KvTokensAdmitted, and a place in its batch) wait, in arrival order and
  // before any prefill is spent on them, while their client stays and for at
  // most queue_timeout; past max_queued waiting, a request is refused at
  // once (RESOURCE_EXHAUSTED: HTTP 429). vLLM, SGLang and Triton's default
  // queue policy let a request wait as long as its client does; ten minutes
  // lets a burst of long generations drain while a deployment that cannot
  // serve at all still answers.
  int max_queued = 1024;
  std::chrono::milliseconds queue_timeout{600000};
  // A request whose decode worker is lost goes on at another (docs/serving.md,
  // "A decode worker lost"), up to max_resumes times; false: it fails.
  bool resume = true;
  int max_resumes = 3;
  // Where prompts are computed (docs/serving.md, "Two paths"); a request's
  // own "disaggregation" field overrides it. A local prefill is chosen
  // (auto) only for at most local_prefill_max_tokens tokens the decode
  // worker lacks.
  Disaggregation disaggregation = Disaggregation::kAuto;
  int64_t local_prefill_max_tokens = 512;
  // Set: the control connections run CURVE as holders of this key, the
  // workers' (kdn/net/curve.h); unset: plaintext.
  std::optional<net::CurveKeys> curve;
  // Pins (docs/serving.md, "Pinning a prefix"): the KV bytes a tenant's
  // live pins may hold (0: no request may pin), each pinned token counted
  // as kv_bytes_per_token (f32 KV: the host tier's most per token).
  uint64_t max_pinned_bytes_per_tenant = uint64_t{512} << 20;
  uint64_t kv_bytes_per_token = 0;
  // Follow the KV events of the workers that publish them and take a
  // prompt's prefix at such a worker from them instead of asking it
  // (docs/serving.md, "Lookups from the event stream").
  bool lookups_from_events = false;
};

class Backend {
 public:
  // `tokenizer` (borrowed, must outlive the Backend) is the model's: it gives
  // the text of each request's first token. `metrics` (borrowed, may be
  // null) receives per-request figures.
  static Result<std::unique_ptr<Backend>> Start(const BackendOptions& options,
                                                const text::Tokenizer& tokenizer, Metrics* metrics);
  ~Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // Starts a job and returns its id: the request id that every message
  // about it carries, and that its log lines show (ReqId) in every process.
  // Ids are unique within a router and, as they start at a random point,
  // almost surely across its restarts too. `callback` gets its events.
  uint64_t Submit(Job job, JobCallback callback);
  // Starts an injection and returns its id; `callback` gets a kProgress per
  // document, then kDone (or kError when no prefill worker is up). A
  // document whose worker stops answering is sent to another one.
  uint64_t Inject(InjectJob job, JobCallback callback);
  // Abandons a job or an injection (its client went away): no further events, and its
  // workers are told to stop.
  void Cancel(uint64_t id);
  // `tenant`'s live pins, longest first.
  std::vector<PinInfo> Pins(const std::string& tenant) const;
  // Drops `tenant`'s pin `id` (every one of its pins when `id` is empty)
  // and has the workers let go of what no other pin holds. NOT_FOUND when
  // it has no such pin.
  Status Unpin(const std::string& tenant, const std::string& id);
  // Pins held and bytes, hits and refusals, for the metrics.
  PinBook::Totals PinTotals() const;
  // The workers as last heard from (at most ~100 ms old), each with the
  // router's reservations on it since its report (WorkerView::reserved).
  std::vector<WorkerView> Workers() const;

 private:
  struct Impl;
  explicit Backend(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kdn::router
