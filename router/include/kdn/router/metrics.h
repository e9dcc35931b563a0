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

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Per-worker figures, taken from the backend when /metrics is read.
// A worker's KV codec at its kdn-store tier (proto::KvCodecCounters).
struct KvCodecCounters {
  uint64_t encoded_chunks = 0, raw_bytes = 0, encoded_bytes = 0, decoded_chunks = 0,
           decode_errors = 0;
};

// A worker's KV pool as the KDN's first tier (proto::ResidentCounters).
struct ResidentCounters {
  int cached_blocks = 0, evictable_blocks = 0;
  uint64_t evictions = 0, hit_tokens = 0, copied_blocks = 0, kv_bytes_loaded = 0;
};

// A decode worker's local prefill (proto::LocalPrefill).
struct LocalPrefillView {
  int running = 0;                  // requests in its decode batch
  int64_t backlog_tokens = 0;       // local prefill tokens still to compute
  double step_ms = 0;               // its decode steps, recent average (0: none yet)
  double prefill_ms_per_token = 0;  // its local prefill pieces (0: none yet)
  int step_tokens = 0;              // its --local-prefill-step-tokens (0: not said)
  uint64_t requests = 0;            // local prefills finished
  uint64_t tokens = 0;              // prompt tokens they computed
};

// A decode worker's pushed KV (proto PushedKv).
struct PushedKvView {
  uint64_t slices_landed = 0;
  uint64_t landed_bytes = 0;
  uint64_t start_copy_bytes = 0;
  int quarantined_blocks = 0;
};

struct WorkerGauge {
  std::string name;
  std::string role;
  bool up = false;
  // As the worker reported them.
  int queue_depth = 0;
  int free_kv_blocks = 0;
  // The router's reservations since that report (WorkerView::reserved).
  int reserved_requests = 0;
  int64_t reserved_kv_blocks = 0;
  struct Transport {
    std::string name;
    uint64_t chunks = 0, bytes = 0;
    double seconds = 0;
  };
  std::vector<Transport> kv_transports;
  KvCodecCounters kv_codec;
  uint64_t store_unreachable = 0;
  int leased_kv_blocks = 0;
  uint64_t kvbus_leased_bytes = 0;
  ResidentCounters resident;
  LocalPrefillView local_prefill;  // decode
  PushedKvView pushed_kv;          // decode
};

class Metrics {
 public:
  Metrics();
  void RequestFinished(const std::string& route, int code);
  void InFlight(int delta);
  void Ttft(double seconds);
  void InterToken(double seconds);
  // A request's prompt tokens by where their KV came from: prefix chunks
  // loaded, documents' KV fused in unchanged, documents' tokens recomputed by
  // blend, and computed in full. They add up to the prompt.
  // `tail` is the part of `cached` that came from tail pieces.
  void PromptTokens(int cached, int blended, int recomputed, int computed, int tail = 0);
  // The recompute ratio a blend request used (its own, or its quality
  // target's).
  void BlendRatio(double ratio);
  // One injected document: result "stored", "already_held" or "failed".
  void Injected(const std::string& result, size_t tokens);
  void GeneratedTokens(int n);
  void KvMoved(uint64_t bytes, uint64_t slices_skipped);
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

  std::string Render(const std::vector<WorkerGauge>& workers) const;

 private:
  mutable Mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_ KDN_GUARDED_BY(mu_);
  int64_t in_flight_ KDN_GUARDED_BY(mu_) = 0;
  Histogram ttft_ KDN_GUARDED_BY(mu_);
  Histogram inter_token_ KDN_GUARDED_BY(mu_);
  uint64_t cached_tokens_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t blended_tokens_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t recomputed_tokens_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t tail_tokens_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t computed_tokens_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t generated_ KDN_GUARDED_BY(mu_) = 0;
  std::map<std::string, uint64_t> injected_ KDN_GUARDED_BY(mu_);  // by result
  uint64_t injected_tokens_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t kv_bytes_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t slices_skipped_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t accept_errors_ KDN_GUARDED_BY(mu_) = 0;
  int queue_depth_ KDN_GUARDED_BY(mu_) = 0;
  Histogram queue_wait_ KDN_GUARDED_BY(mu_);
  Histogram blend_ratio_ KDN_GUARDED_BY(mu_);
  uint64_t resumed_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t resumed_tokens_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t routed_disaggregated_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t routed_local_ KDN_GUARDED_BY(mu_) = 0;
};

}  // namespace kdn::router
