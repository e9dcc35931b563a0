#pragma once
// The router's Prometheus metrics (docs/serving.md, "Metrics"): counters,
// gauges and histograms, rendered in the text exposition format.
// Thread-safe: every method locks one mutex (updates are a few per token).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kdn/common/mutex.h"

namespace kdn::router {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  // Appends NAME_bucket{le=...}, NAME_sum and NAME_count lines.
  void Render(const std::string& name, std::string* out) const;
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative
  double sum_ = 0;
  uint64_t count_ = 0;
};

// One interval of the router's recent past, for the status page's charts.
struct Interval {
  int64_t start_unix = 0;  // a multiple of kIntervalSeconds
  uint64_t requests = 0;   // API requests (/v1/...) finished, any status
  uint64_t errors = 0;     // of those, status 400 or more but 499 (the client left)
  uint64_t generated_tokens = 0;
  uint64_t ttft_count = 0;
  double ttft_sum = 0;
  uint64_t token_gap_count = 0;
  double token_gap_sum = 0;
};

// A request that ended in an error status (400 and up), for the status page.
struct RecentError {
  int64_t unix_time = 0;
  std::string route;
  int code = 0;
  std::string message;
};

// Everything Metrics counts, as one value: the router's part of a
// StatusSnapshot (status.h), which /metrics and /status.json render.
struct RouterFigures {
  static constexpr int kIntervalSeconds = 10;
  static constexpr size_t kIntervals = 60;  // the last 10 minutes
  static constexpr size_t kRecentErrors = 20;

  RouterFigures();
  std::map<std::pair<std::string, int>, uint64_t> requests;  // by (route, status)
  int64_t in_flight = 0;
  Histogram ttft;
  Histogram inter_token;
  Histogram queue_wait;
  Histogram blend_ratio;
  uint64_t cached_tokens = 0, blended_tokens = 0, recomputed_tokens = 0, tail_tokens = 0,
           computed_tokens = 0, pruned_tokens = 0;
  uint64_t generated = 0;
  std::map<std::string, uint64_t> injected;  // by result
  uint64_t injected_tokens = 0;
  uint64_t injected_stored_tokens = 0;
  uint64_t kv_bytes = 0;
  uint64_t slices_skipped = 0;
  uint64_t slices_sourced = 0;
  uint64_t accept_errors = 0;
  int queue_depth = 0;
  uint64_t resumed = 0, resumed_tokens = 0;
  uint64_t routed_disaggregated = 0, routed_local = 0;
  // Lookups: workers asked about a prompt, and workers whose KV events
  // answered instead (docs/serving.md, "Lookups from the event stream").
  uint64_t lookups_asked = 0, lookups_from_events = 0;
  // Pins (PinBook::Totals, filled in by the snapshot): held now, their
  // bytes, requests that reached one, pins refused past a tenant's bound.
  uint64_t pins = 0, pinned_bytes = 0, pin_hits = 0, pins_refused = 0;
  std::vector<Interval> history;    // oldest first, no gaps, at most kIntervals
  std::vector<RecentError> errors;  // oldest first, at most kRecentErrors
};

struct StatusSnapshot;
struct WorkerView;

// The wall clock in Unix seconds: the default clock of Metrics, and the
// router's `created` and start times.
int64_t UnixNow();

// The Prometheus text exposition of a snapshot (docs/serving.md, "Metrics").
std::string RenderMetrics(const StatusSnapshot& s);

class Metrics {
 public:
  // `now_unix` gives the wall clock in seconds (a test's own clock, say).
  explicit Metrics(int64_t (*now_unix)() = nullptr);
  void RequestFinished(const std::string& route, int code);
  // A request that ended in status `code` >= 400 with `message` (kept among
  // the last RouterFigures::kRecentErrors; RequestFinished counts it).
  void Error(const std::string& route, int code, const std::string& message);
  void InFlight(int delta);
  void Ttft(double seconds);
  void InterToken(double seconds);
  // A request's prompt tokens by where their KV came from: prefix chunks
  // loaded, documents' KV fused in unchanged, documents' tokens recomputed by
  // blend, and computed in full. They add up to the prompt.
  // `tail` is the part of `cached` that came from tail pieces.
  // `pruned`: of the blended, tokens with no KV (their document pruned).
  void PromptTokens(int cached, int blended, int recomputed, int computed, int tail = 0,
                    int pruned = 0);
  // The recompute ratio a blend request used (its own, or its quality
  // target's).
  void BlendRatio(double ratio);
  // One injected document: result "stored", "already_held" or "failed".
  void Injected(const std::string& result, size_t tokens, int64_t stored_tokens = 0);
  void GeneratedTokens(int n);
  void KvMoved(uint64_t bytes, uint64_t slices_skipped, uint64_t slices_sourced);
  // A failed accept of an HTTP connection (out of file descriptors, say).
  void AcceptFailed();
  // The admission queue (BackendOptions::max_queued): requests waiting now,
  // and how long one waited once it got a decode worker.
  void QueueDepth(int n);
  void QueueWait(double seconds);
  // A request moved to another decode worker after it lost its own
  // (BackendOptions::resume), with `tokens` generated tokens recomputed
  // or loaded as part of its new prompt.
  void Resumed(int tokens);
  // A request routed: its prompt computed by a prefill worker
  // (disaggregated) or by its decode worker (local; docs/serving.md, "Two
  // paths").
  void Routed(bool local);
  // A request's lookup: `asked` workers asked, `from_events` answered by
  // their KV events.
  void Lookups(int asked, int from_events);

  // Everything counted so far; the history runs up to now (intervals with
  // nothing in them included).
  RouterFigures Figures() const;
  // RenderMetrics of these figures and `workers`.
  std::string Render(const std::vector<WorkerView>& workers) const;

 private:
  // The interval `now` falls in, appended (with any empty ones before it)
  // if it is not the last one.
  Interval& Current() KDN_REQUIRES(mu_);
  static void Advance(std::vector<Interval>* history, int64_t now);

  int64_t (*const now_unix_)();
  mutable Mutex mu_;
  RouterFigures f_ KDN_GUARDED_BY(mu_);
};

}  // namespace kdn::router
