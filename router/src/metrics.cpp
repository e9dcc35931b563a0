#include "kdn/router/metrics.h"

#include <chrono>

#include <algorithm>
#include <cstdio>
#include <type_traits>

#include <fmt/format.h>

#include "kdn/router/status.h"

namespace kdn::router {

namespace {

std::string Num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

// Label values escape backslash, quote and newline.
std::string Label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

void Head(std::string* out, const char* name, const char* type, const char* help) {
  *out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

// A metric of one unlabelled sample.
template <typename T>
void Single(std::string* out, const char* name, const char* type, const char* help, T value) {
  Head(out, name, type, help);
  *out += std::string(name) + " " + std::to_string(value) + "\n";
}

// One sample of a family with one label: name{label="value"} count.
void Labelled(std::string* out, const char* name, const char* label, const char* value,
              uint64_t count) {
  *out += std::string(name) + "{" + label + "=\"" + value + "\"} " + std::to_string(count) + "\n";
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::Render(const std::string& name, std::string* out) const {
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    *out += name + "_bucket{le=\"" + Num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  *out += name + "_bucket{le=\"+Inf\"} " + std::to_string(count_) + "\n";
  *out += name + "_sum " + Num(sum_) + "\n";
  *out += name + "_count " + std::to_string(count_) + "\n";
}

RouterFigures::RouterFigures()
    : ttft({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      inter_token({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}),
      queue_wait({0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      blend_ratio({0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1}) {}

int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Metrics::Metrics(int64_t (*now_unix)()) : now_unix_(now_unix ? now_unix : UnixNow) {}

void Metrics::Advance(std::vector<Interval>* history, int64_t now) {
  constexpr int64_t kStep = RouterFigures::kIntervalSeconds;
  constexpr int64_t kSpan = kStep * static_cast<int64_t>(RouterFigures::kIntervals);
  const int64_t start = now - now % kStep;
  if (!history->empty() && history->back().start_unix >= start) return;
  // Empty intervals since the last one, then this one; after a gap longer
  // than the history, only empty ones before it.
  int64_t t = history->empty() ? start : history->back().start_unix + kStep;
  if (start - t >= kSpan) {
    history->clear();
    t = start - kSpan + kStep;
  }
  for (; t <= start; t += kStep) history->push_back(Interval{.start_unix = t});
  if (history->size() > RouterFigures::kIntervals) {
    history->erase(history->begin(), history->end() - RouterFigures::kIntervals);
  }
}

Interval& Metrics::Current() {
  Advance(&f_.history, now_unix_());
  return f_.history.back();
}

RouterFigures Metrics::Figures() const {
  MutexLock lock(mu_);
  RouterFigures f = f_;
  Advance(&f.history, now_unix_());
  return f;
}

std::string Metrics::Render(const std::vector<WorkerView>& workers) const {
  StatusSnapshot s;
  s.workers = workers;
  s.router = Figures();
  return RenderMetrics(s);
}

void Metrics::Error(const std::string& route, int code, const std::string& message) {
  MutexLock lock(mu_);
  f_.errors.push_back({now_unix_(), route, code, message});
  if (f_.errors.size() > RouterFigures::kRecentErrors) f_.errors.erase(f_.errors.begin());
}

void Metrics::QueueDepth(int n) {
  MutexLock lock(mu_);
  f_.queue_depth = n;
}

void Metrics::QueueWait(double seconds) {
  MutexLock lock(mu_);
  f_.queue_wait.Observe(seconds);
}

void Metrics::Resumed(int tokens) {
  MutexLock lock(mu_);
  ++f_.resumed;
  f_.resumed_tokens += static_cast<uint64_t>(tokens);
}

void Metrics::Routed(bool local) {
  MutexLock lock(mu_);
  ++(local ? f_.routed_local : f_.routed_disaggregated);
}

void Metrics::Lookups(int asked, int from_events) {
  MutexLock lock(mu_);
  f_.lookups_asked += static_cast<uint64_t>(asked);
  f_.lookups_from_events += static_cast<uint64_t>(from_events);
}

void Metrics::RequestFinished(const std::string& route, int code) {
  MutexLock lock(mu_);
  ++f_.requests[{route, code}];
  if (!route.starts_with("/v1/")) return;  // /health, /metrics, the status page
  Interval& i = Current();
  ++i.requests;
  if (code >= 400 && code != 499) ++i.errors;
}

void Metrics::InFlight(int delta) {
  MutexLock lock(mu_);
  f_.in_flight += delta;
}

void Metrics::Ttft(double seconds) {
  MutexLock lock(mu_);
  f_.ttft.Observe(seconds);
  Interval& i = Current();
  ++i.ttft_count;
  i.ttft_sum += seconds;
}

void Metrics::InterToken(double seconds) {
  MutexLock lock(mu_);
  f_.inter_token.Observe(seconds);
  Interval& i = Current();
  ++i.token_gap_count;
  i.token_gap_sum += seconds;
}

void Metrics::PromptTokens(int cached, int blended, int recomputed, int computed, int tail,
                           int pruned) {
  MutexLock lock(mu_);
  f_.pruned_tokens += static_cast<uint64_t>(pruned);
  f_.cached_tokens += static_cast<uint64_t>(cached);
  f_.tail_tokens += static_cast<uint64_t>(tail);
  f_.blended_tokens += static_cast<uint64_t>(blended);
  f_.recomputed_tokens += static_cast<uint64_t>(recomputed);
  f_.computed_tokens += static_cast<uint64_t>(computed);
}

void Metrics::BlendRatio(double ratio) {
  MutexLock lock(mu_);
  f_.blend_ratio.Observe(ratio);
}

void Metrics::Injected(const std::string& result, size_t tokens, int64_t stored_tokens) {
  MutexLock lock(mu_);
  ++f_.injected[result];
  f_.injected_tokens += tokens;
  f_.injected_stored_tokens += static_cast<uint64_t>(stored_tokens);
}

void Metrics::GeneratedTokens(int n) {
  MutexLock lock(mu_);
  f_.generated += static_cast<uint64_t>(n);
  Current().generated_tokens += static_cast<uint64_t>(n);
}

void Metrics::KvMoved(uint64_t bytes, uint64_t slices_skipped, uint64_t slices_sourced) {
  MutexLock lock(mu_);
  f_.kv_bytes += bytes;
  f_.slices_skipped += slices_skipped;
  f_.slices_sourced += slices_sourced;
}

void Metrics::AcceptFailed() {
  MutexLock lock(mu_);
  ++f_.accept_errors;
}

std::string RenderMetrics(const StatusSnapshot& s) {
  const RouterFigures& f = s.router;
  const std::vector<WorkerView>& workers = s.workers;
  std::string out;
  Head(&out, "kdn_requests_total", "counter", "Finished HTTP requests by route and status code.");
  for (const auto& [k, v] : f.requests) {
    out += "kdn_requests_total{route=\"" + Label(k.first) + "\",code=\"" +
           std::to_string(k.second) + "\"} " + std::to_string(v) + "\n";
  }
  Single(&out, "kdn_requests_in_flight", "gauge", "Requests being served.", f.in_flight);
  Single(&out, "kdn_http_accept_errors_total", "counter",
         "HTTP connections the router failed to accept (out of file descriptors, say); it "
         "backs off up to 1 s between tries while they fail.",
         f.accept_errors);
  Single(&out, "kdn_queue_depth", "gauge",
         "Requests waiting for a decode worker with room (KV for prompt + max_tokens, a place "
         "in its batch), before any prefill is spent on them.",
         f.queue_depth);
  Head(&out, "kdn_queue_wait_seconds", "histogram",
       "How long requests that waited for a decode worker waited.");
  f.queue_wait.Render("kdn_queue_wait_seconds", &out);
  Single(&out, "kdn_requests_resumed_total", "counter",
         "Requests moved to another decode worker after theirs was lost; their streams went "
         "on.",
         f.resumed);
  Single(&out, "kdn_resumed_tokens_total", "counter",
         "Tokens generated before a request was resumed, which its new prompt carried.",
         f.resumed_tokens);
  Head(&out, "kdn_requests_routed_total", "counter",
       "Requests routed (one sent back to the queue, or resumed, counts again), by where "
       "their prompt was computed: "
       "path=disaggregated on a prefill worker, its KV moved; path=local on the decode worker.");
  Labelled(&out, "kdn_requests_routed_total", "path", "disaggregated", f.routed_disaggregated);
  Labelled(&out, "kdn_requests_routed_total", "path", "local", f.routed_local);
  Head(&out, "kdn_ttft_seconds", "histogram", "Time to first token from the request's arrival.");
  f.ttft.Render("kdn_ttft_seconds", &out);
  Head(&out, "kdn_inter_token_seconds", "histogram", "Time between tokens of a request.");
  f.inter_token.Render("kdn_inter_token_seconds", &out);
  Head(&out, "kdn_blend_recompute_ratio", "histogram",
       "The recompute ratio of each blend request: its own, or the one its quality target "
       "(blend_max_kl) chose.");
  f.blend_ratio.Render("kdn_blend_recompute_ratio", &out);
  Head(&out, "kdn_prompt_tokens_total", "counter",
       "Prompt tokens by the source of their KV: prefix chunks and tail pieces loaded from the "
       "KDN (cached), "
       "documents' KV fused in unchanged (blended), documents' tokens recomputed by blend "
       "(recomputed), or computed in full.");
  Labelled(&out, "kdn_prompt_tokens_total", "source", "cached", f.cached_tokens);
  Labelled(&out, "kdn_prompt_tokens_total", "source", "blended", f.blended_tokens);
  Labelled(&out, "kdn_prompt_tokens_total", "source", "recomputed", f.recomputed_tokens);
  Labelled(&out, "kdn_prompt_tokens_total", "source", "computed", f.computed_tokens);
  Single(&out, "kdn_prompt_pruned_tokens_total", "counter",
         "Of the blended prompt tokens, those with no KV: pruned away when their document was "
         "stored.",
         f.pruned_tokens);
  Single(&out, "kdn_prompt_tail_tokens_total", "counter",
         "Of the cached prompt tokens, those loaded from tail pieces: the tokens past a "
         "conversation's last full chunk.",
         f.tail_tokens);
  Head(&out, "kdn_injected_documents_total", "counter",
       "Documents sent to /v1/kdn/inject, by result.");
  for (const char* result : {"stored", "already_held", "failed"}) {
    auto it = f.injected.find(result);
    Labelled(&out, "kdn_injected_documents_total", "result", result,
             it == f.injected.end() ? 0 : it->second);
  }
  Single(&out, "kdn_injected_tokens_total", "counter", "Tokens of the documents injected.",
         f.injected_tokens);
  Single(&out, "kdn_injected_stored_tokens_total", "counter",
         "Tokens whose KV the injected documents stored: their tokens, or the kept ones when "
         "pruned.",
         f.injected_stored_tokens);
  Head(&out, "kdn_lookups_total", "counter",
       "Workers consulted about a prompt's cached prefix, by who answered: the worker asked, "
       "or its KV events followed by the router (docs/serving.md, \"Lookups from the event "
       "stream\").");
  Labelled(&out, "kdn_lookups_total", "answered", "worker", f.lookups_asked);
  Labelled(&out, "kdn_lookups_total", "answered", "events", f.lookups_from_events);
  Single(&out, "kdn_pins", "gauge",
         "Prompt prefixes pinned with cache_control and not yet expired (docs/serving.md, "
         "\"Pinning a prefix\").",
         f.pins);
  Single(&out, "kdn_pinned_bytes", "gauge",
         "KV bytes the live pins count against their tenants' bounds.", f.pinned_bytes);
  Single(&out, "kdn_pin_hits_total", "counter",
         "Requests whose prompt reached a live pin (each refreshed it).", f.pin_hits);
  Single(&out, "kdn_pins_refused_total", "counter",
         "Pins refused (429) because they would take their tenant past its bound.", f.pins_refused);
  Single(&out, "kdn_generated_tokens_total", "counter", "Tokens generated.", f.generated);
  Single(&out, "kdn_kv_bytes_moved_total", "counter",
         "KV bytes sent from prefill to decode workers.", f.kv_bytes);
  Single(&out, "kdn_kv_chunks_skipped_total", "counter",
         "KV layer slices not sent because the decode worker held them.", f.slices_skipped);
  Single(&out, "kdn_kv_slices_sourced_total", "counter",
         "KV layer slices prefill workers pushed from where they lie in their KV pool, with no "
         "chunk built in host memory.",
         f.slices_sourced);
  Head(&out, "kdn_worker_up", "gauge", "1 while a worker answers.");
  auto labels = [](const WorkerView& w) {
    return "{worker=\"" + Label(w.name) + "\",role=\"" + RoleName(w.role) + "\"} ";
  };
  for (const WorkerView& w : workers)
    out += "kdn_worker_up" + labels(w) + (w.up && w.compatible ? "1" : "0") + "\n";
  // A metric of one sample per worker.
  const auto per_worker = [&](const char* name, const char* type, const char* help, auto value) {
    Head(&out, name, type, help);
    for (const WorkerView& w : workers) {
      const auto v = value(w);
      if constexpr (std::is_floating_point_v<decltype(v)>) {
        out += name + labels(w) + fmt::format("{:.6g}", v) + "\n";
      } else {
        out += name + labels(w) + std::to_string(v) + "\n";
      }
    }
  };
  per_worker("kdn_worker_queue_depth", "gauge", "Requests queued or running at a worker.",
             [](const WorkerView& w) { return w.queue_depth; });
  per_worker("kdn_worker_free_kv_blocks", "gauge", "Free blocks of a worker's paged KV cache.",
             [](const WorkerView& w) { return w.free_kv_blocks; });
  // The router's own, apart from what workers report: what it routed to a
  // worker since the worker last reported.
  per_worker("kdn_worker_router_reserved_requests", "gauge",
             "Requests the router routed to a worker since its last report (the router's count).",
             [](const WorkerView& w) { return w.reserved.requests; });
  per_worker(
      "kdn_worker_router_reserved_kv_blocks", "gauge",
      "KV blocks the router reserved at a worker since its last report (the router's count).",
      [](const WorkerView& w) { return w.reserved.kv_blocks; });
  // What a worker holds under leases: a request's or a sender's that stops
  // answering lets it go once the lease runs out, so after a run has
  // drained these are 0 (kdn-bench serve-load checks).
  per_worker("kdn_worker_leased_kv_blocks", "gauge",
             "KV blocks a decode worker reserved for requests prepared and not yet started, each "
             "under its router's lease.",
             [](const WorkerView& w) { return w.leased_kv_blocks; });
  per_worker("kdn_worker_kvbus_leased_bytes", "gauge",
             "Bytes of a decode worker's kvbus receiver slots granted to senders and not yet "
             "filled, each under a lease.",
             [](const WorkerView& w) { return w.kvbus_leased_bytes; });
  // Each worker's --kv-transport, as an info metric (its value is 1).
  Head(&out, "kdn_worker_kv_transport_info", "gauge",
       "A worker's --kv-transport (the label; the value is 1).");
  for (const WorkerView& w : workers) {
    if (w.kv_transport.empty()) continue;
    out += "kdn_worker_kv_transport_info{worker=\"" + Label(w.name) + "\",role=\"" +
           RoleName(w.role) + "\",transport=\"" + Label(w.kv_transport) + "\"} 1\n";
  }
  // Per kvbus data plane: what each prefill worker sent and each decode
  // worker received (docs/kvbus.md, "Transports").
  const auto per_transport = [&](const char* name, const char* help, auto value) {
    Head(&out, name, "counter", help);
    for (const WorkerView& w : workers) {
      for (const proto::TransportCounters& t : w.kv_transports) {
        out += std::string(name) + "{worker=\"" + Label(w.name) + "\",role=\"" + RoleName(w.role) +
               "\",transport=\"" + Label(t.transport()) + "\"} " + value(t) + "\n";
      }
    }
  };
  per_transport("kdn_worker_kv_transport_chunks_total",
                "KV chunks (layer slices) moved by kvbus, per data plane.",
                [](const proto::TransportCounters& t) { return std::to_string(t.chunks()); });
  per_transport("kdn_worker_kv_transport_bytes_total", "KV bytes moved by kvbus, per data plane.",
                [](const proto::TransportCounters& t) { return std::to_string(t.bytes()); });
  per_transport("kdn_worker_kv_transport_seconds_total",
                "Seconds a prefill worker's kvbus batches were in flight, per data plane.",
                [](const proto::TransportCounters& t) { return Num(t.seconds()); });
  // The KV codec at each worker's kdn-store tier (docs/kvbus.md, "KV codec").
  Head(&out, "kdn_worker_kv_codec_chunks_total", "counter",
       "KV chunks a worker coded for kdn-store (op=encode) or decoded from it (op=decode).");
  for (const WorkerView& w : workers) {
    const std::string l =
        "{worker=\"" + Label(w.name) + "\",role=\"" + RoleName(w.role) + "\",op=\"";
    out += "kdn_worker_kv_codec_chunks_total" + l + "encode\"} " +
           std::to_string(w.kv_codec.encoded_chunks()) + "\n";
    out += "kdn_worker_kv_codec_chunks_total" + l + "decode\"} " +
           std::to_string(w.kv_codec.decoded_chunks()) + "\n";
  }
  Head(&out, "kdn_worker_kv_codec_bytes_total", "counter",
       "Payload bytes of the chunks a worker coded for kdn-store, before (form=raw) and after "
       "(form=encoded).");
  for (const WorkerView& w : workers) {
    const std::string l =
        "{worker=\"" + Label(w.name) + "\",role=\"" + RoleName(w.role) + "\",form=\"";
    out += "kdn_worker_kv_codec_bytes_total" + l + "raw\"} " +
           std::to_string(w.kv_codec.raw_bytes()) + "\n";
    out += "kdn_worker_kv_codec_bytes_total" + l + "encoded\"} " +
           std::to_string(w.kv_codec.encoded_bytes()) + "\n";
  }
  per_worker("kdn_worker_kv_codec_decode_errors_total", "counter",
             "Coded chunks from kdn-store that did not decode: each a miss, recomputed, never "
             "served.",
             [](const WorkerView& w) { return w.kv_codec.decode_errors(); });
  // Its KV pool as the KDN's first tier (docs/engine.md, "Resident KV").
  per_worker("kdn_worker_resident_kv_blocks", "gauge",
             "KV blocks a worker's pool keeps resident under content keys (some also in use).",
             [](const WorkerView& w) { return w.resident.cached_blocks(); });
  per_worker("kdn_worker_resident_evictable_kv_blocks", "gauge",
             "Of the resident KV blocks, those no request holds: counted as free.",
             [](const WorkerView& w) { return w.resident.evictable_blocks(); });
  per_worker("kdn_worker_resident_pinned_kv_blocks", "gauge",
             "Of the resident KV blocks, those pins keep: never evicted, not counted free.",
             [](const WorkerView& w) { return w.resident.kept_blocks(); });
  per_worker("kdn_worker_resident_evictions_total", "counter",
             "Resident KV entries a worker's pool dropped to make room.",
             [](const WorkerView& w) { return w.resident.evictions(); });
  per_worker("kdn_worker_resident_hit_tokens_total", "counter",
             "Prompt tokens whose KV a worker attached from its pool, moving no KV.",
             [](const WorkerView& w) { return w.resident.hit_tokens(); });
  per_worker("kdn_worker_resident_copied_blocks_total", "counter",
             "Shared KV blocks a worker copied before a request wrote into them.",
             [](const WorkerView& w) { return w.resident.copied_blocks(); });
  per_worker("kdn_worker_kv_loaded_bytes_total", "counter",
             "KV bytes a worker copied into its pool from its lower KDN tiers (host, disk, "
             "kdn-store); a resident hit adds nothing.",
             [](const WorkerView& w) { return w.resident.kv_bytes_loaded(); });
  // Pushed KV on decode workers (docs/kvbus.md, "Landing in place").
  per_worker("kdn_worker_kv_landed_slices_total", "counter",
             "Layer slices a decode worker's kvbus receiver landed in place, in their KV blocks.",
             [](const WorkerView& w) { return w.pushed_kv.slices_landed(); });
  per_worker("kdn_worker_kv_landed_bytes_total", "counter", "Bytes of those slices.",
             [](const WorkerView& w) { return w.pushed_kv.landed_bytes(); });
  per_worker("kdn_worker_kv_start_copy_bytes_total", "counter",
             "KV bytes a decode worker copied into blocks at Start from its staging tier (0 "
             "when every pushed slice landed in place).",
             [](const WorkerView& w) { return w.pushed_kv.start_copy_bytes(); });
  per_worker("kdn_worker_kv_quarantined_blocks", "gauge",
             "KV blocks a decode worker holds back after a request left while a push into them "
             "may still be under way.",
             [](const WorkerView& w) { return w.pushed_kv.quarantined_blocks(); });
  // Preemption on decode workers (docs/serving.md, "Admission and preemption").
  per_worker("kdn_worker_preempted_requests", "gauge",
             "Requests a decode worker preempted for want of KV blocks, waiting to resume.",
             [](const WorkerView& w) { return w.preemption.waiting(); });
  per_worker("kdn_worker_preemptions_total", "counter",
             "Requests a decode worker preempted: their KV to the pool and the KDN, their "
             "blocks freed.",
             [](const WorkerView& w) { return w.preemption.preemptions(); });
  per_worker("kdn_worker_resumes_by_load_total", "counter",
             "Preempted requests resumed with all their KV from the pool or the KDN.",
             [](const WorkerView& w) { return w.preemption.resumed_by_load(); });
  per_worker("kdn_worker_resumes_by_recompute_total", "counter",
             "Preempted requests resumed by recomputing KV evicted meanwhile.",
             [](const WorkerView& w) { return w.preemption.resumed_by_recompute(); });
  per_worker("kdn_worker_resume_recomputed_tokens_total", "counter",
             "Tokens whose KV resumed requests recomputed.",
             [](const WorkerView& w) { return w.preemption.recomputed_tokens(); });
  // Local prefill on decode workers (docs/serving.md, "Two paths").
  per_worker("kdn_worker_local_prefills_total", "counter",
             "Prompts a decode worker computed itself (local prefill).",
             [](const WorkerView& w) { return w.local_prefill.requests(); });
  per_worker("kdn_worker_local_prefill_tokens_total", "counter",
             "Prompt tokens a decode worker's local prefills computed.",
             [](const WorkerView& w) { return w.local_prefill.tokens(); });
  per_worker("kdn_worker_local_prefill_backlog_tokens", "gauge",
             "Prompt tokens of local prefills a decode worker has still to compute.",
             [](const WorkerView& w) { return w.local_prefill.backlog_tokens(); });
  per_worker("kdn_worker_decode_step_seconds", "gauge",
             "A decode worker's decode steps, recent average (0 before its first).",
             [](const WorkerView& w) { return w.local_prefill.step_ms() / 1e3; });
  per_worker("kdn_worker_local_prefill_seconds_per_token", "gauge",
             "A decode worker's local prefill pieces per prompt token, recent average (0 "
             "before its first).",
             [](const WorkerView& w) { return w.local_prefill.prefill_ms_per_token() / 1e3; });
  per_worker("kdn_worker_store_unreachable_total", "counter",
             "A worker's kdn-store requests that failed for want of an answer (timed out, or "
             "refused at once while the store is held to be down): each a cache miss.",
             [](const WorkerView& w) { return w.store_unreachable; });
  return out;
}

}  // namespace kdn::router
