#include "kdn/router/metrics.h"

#include <algorithm>
#include <cstdio>
#include <type_traits>

#include <fmt/format.h>

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

Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      inter_token_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}),
      queue_wait_({0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      blend_ratio_({0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1}) {}

void Metrics::QueueDepth(int n) {
  MutexLock lock(mu_);
  queue_depth_ = n;
}

void Metrics::QueueWait(double seconds) {
  MutexLock lock(mu_);
  queue_wait_.Observe(seconds);
}

void Metrics::Resumed(int tokens) {
  MutexLock lock(mu_);
  ++resumed_;
  resumed_tokens_ += static_cast<uint64_t>(tokens);
}

void Metrics::Routed(bool local) {
  MutexLock lock(mu_);
  ++(local ? routed_local_ : routed_disaggregated_);
}

void Metrics::RequestFinished(const std::string& route, int code) {
  MutexLock lock(mu_);
  ++requests_[{route, code}];
}

void Metrics::InFlight(int delta) {
  MutexLock lock(mu_);
  in_flight_ += delta;
}

void Metrics::Ttft(double seconds) {
  MutexLock lock(mu_);
  ttft_.Observe(seconds);
}

void Metrics::InterToken(double seconds) {
  MutexLock lock(mu_);
  inter_token_.Observe(seconds);
}

void Metrics::PromptTokens(int cached, int blended, int recomputed, int computed, int tail) {
  MutexLock lock(mu_);
  cached_tokens_ += static_cast<uint64_t>(cached);
  tail_tokens_ += static_cast<uint64_t>(tail);
  blended_tokens_ += static_cast<uint64_t>(blended);
  recomputed_tokens_ += static_cast<uint64_t>(recomputed);
  computed_tokens_ += static_cast<uint64_t>(computed);
}

void Metrics::BlendRatio(double ratio) {
  MutexLock lock(mu_);
  blend_ratio_.Observe(ratio);
}

void Metrics::Injected(const std::string& result, size_t tokens) {
  MutexLock lock(mu_);
  ++injected_[result];
  injected_tokens_ += tokens;
}

void Metrics::GeneratedTokens(int n) {
  MutexLock lock(mu_);
  generated_ += static_cast<uint64_t>(n);
}

void Metrics::KvMoved(uint64_t bytes, uint64_t slices_skipped) {
  MutexLock lock(mu_);
  kv_bytes_ += bytes;
  slices_skipped_ += slices_skipped;
}

void Metrics::AcceptFailed() {
  MutexLock lock(mu_);
  ++accept_errors_;
}

std::string Metrics::Render(const std::vector<WorkerGauge>& workers) const {
  MutexLock lock(mu_);
  std::string out;
  Head(&out, "kdn_requests_total", "counter", "Finished HTTP requests by route and status code.");
  for (const auto& [k, v] : requests_) {
    out += "kdn_requests_total{route=\"" + Label(k.first) + "\",code=\"" +
           std::to_string(k.second) + "\"} " + std::to_string(v) + "\n";
  }
  Single(&out, "kdn_requests_in_flight", "gauge", "Requests being served.", in_flight_);
  Single(&out, "kdn_http_accept_errors_total", "counter",
         "HTTP connections the router failed to accept (out of file descriptors, say); it "
         "backs off up to 1 s between tries while they fail.",
         accept_errors_);
  Single(&out, "kdn_queue_depth", "gauge",
         "Requests waiting for a decode worker with room (KV for prompt + max_tokens, a place "
         "in its batch), before any prefill is spent on them.",
         queue_depth_);
  Head(&out, "kdn_queue_wait_seconds", "histogram",
       "How long requests that waited for a decode worker waited.");
  queue_wait_.Render("kdn_queue_wait_seconds", &out);
  Single(&out, "kdn_requests_resumed_total", "counter",
         "Requests moved to another decode worker after theirs was lost; their streams went "
         "on.",
         resumed_);
  Single(&out, "kdn_resumed_tokens_total", "counter",
         "Tokens generated before a request was resumed, which its new prompt carried.",
         resumed_tokens_);
  Head(&out, "kdn_requests_routed_total", "counter",
       "Requests routed (one sent back to the queue, or resumed, counts again), by where "
       "their prompt was computed: "
       "path=disaggregated on a prefill worker, its KV moved; path=local on the decode worker.");
  out += "kdn_requests_routed_total{path=\"disaggregated\"} " +
         std::to_string(routed_disaggregated_) + "\n";
  out += "kdn_requests_routed_total{path=\"local\"} " + std::to_string(routed_local_) + "\n";
  Head(&out, "kdn_ttft_seconds", "histogram", "Time to first token from the request's arrival.");
  ttft_.Render("kdn_ttft_seconds", &out);
  Head(&out, "kdn_inter_token_seconds", "histogram", "Time between tokens of a request.");
  inter_token_.Render("kdn_inter_token_seconds", &out);
  Head(&out, "kdn_blend_recompute_ratio", "histogram",
       "The recompute ratio of each blend request: its own, or the one its quality target "
       "(blend_max_kl) chose.");
  blend_ratio_.Render("kdn_blend_recompute_ratio", &out);
  Head(&out, "kdn_prompt_tokens_total", "counter",
       "Prompt tokens by the source of their KV: prefix chunks and tail pieces loaded from the "
       "KDN (cached), "
       "documents' KV fused in unchanged (blended), documents' tokens recomputed by blend "
       "(recomputed), or computed in full.");
  out += "kdn_prompt_tokens_total{source=\"cached\"} " + std::to_string(cached_tokens_) + "\n";
  out += "kdn_prompt_tokens_total{source=\"blended\"} " + std::to_string(blended_tokens_) + "\n";
  out +=
      "kdn_prompt_tokens_total{source=\"recomputed\"} " + std::to_string(recomputed_tokens_) + "\n";
  out += "kdn_prompt_tokens_total{source=\"computed\"} " + std::to_string(computed_tokens_) + "\n";
  Single(&out, "kdn_prompt_tail_tokens_total", "counter",
         "Of the cached prompt tokens, those loaded from tail pieces: the tokens past a "
         "conversation's last full chunk.",
         tail_tokens_);
  Head(&out, "kdn_injected_documents_total", "counter",
       "Documents sent to /v1/kdn/inject, by result.");
  for (const char* result : {"stored", "already_held", "failed"}) {
    auto it = injected_.find(result);
    out += std::string("kdn_injected_documents_total{result=\"") + result + "\"} " +
           std::to_string(it == injected_.end() ? 0 : it->second) + "\n";
  }
  Single(&out, "kdn_injected_tokens_total", "counter", "Tokens of the documents injected.",
         injected_tokens_);
  Single(&out, "kdn_generated_tokens_total", "counter", "Tokens generated.", generated_);
  Single(&out, "kdn_kv_bytes_moved_total", "counter",
         "KV bytes sent from prefill to decode workers.", kv_bytes_);
  Single(&out, "kdn_kv_chunks_skipped_total", "counter",
         "KV layer slices not sent because the decode worker held them.", slices_skipped_);
  Head(&out, "kdn_worker_up", "gauge", "1 while a worker answers.");
  auto labels = [](const WorkerGauge& w) {
    return "{worker=\"" + Label(w.name) + "\",role=\"" + Label(w.role) + "\"} ";
  };
  for (const WorkerGauge& w : workers)
    out += "kdn_worker_up" + labels(w) + (w.up ? "1" : "0") + "\n";
  // A metric of one sample per worker.
  const auto per_worker = [&](const char* name, const char* type, const char* help, auto value) {
    Head(&out, name, type, help);
    for (const WorkerGauge& w : workers) {
      const auto v = value(w);
      if constexpr (std::is_floating_point_v<decltype(v)>) {
        out += name + labels(w) + fmt::format("{:.6g}", v) + "\n";
      } else {
        out += name + labels(w) + std::to_string(v) + "\n";
      }
    }
  };
  per_worker("kdn_worker_queue_depth", "gauge", "Requests queued or running at a worker.",
             [](const WorkerGauge& w) { return w.queue_depth; });
  per_worker("kdn_worker_free_kv_blocks", "gauge", "Free blocks of a worker's paged KV cache.",
             [](const WorkerGauge& w) { return w.free_kv_blocks; });
  // The router's own, apart from what workers report: what it routed to a
  // worker since the worker last reported.
  per_worker("kdn_worker_router_reserved_requests", "gauge",
             "Requests the router routed to a worker since its last report (the router's count).",
             [](const WorkerGauge& w) { return w.reserved_requests; });
  per_worker(
      "kdn_worker_router_reserved_kv_blocks", "gauge",
      "KV blocks the router reserved at a worker since its last report (the router's count).",
      [](const WorkerGauge& w) { return w.reserved_kv_blocks; });
  // What a worker holds under leases: a request's or a sender's that stops
  // answering lets it go once the lease runs out, so after a run has
  // drained these are 0 (kdn-bench serve-load checks).
  per_worker("kdn_worker_leased_kv_blocks", "gauge",
             "KV blocks a decode worker reserved for requests prepared and not yet started, each "
             "under its router's lease.",
             [](const WorkerGauge& w) { return w.leased_kv_blocks; });
  per_worker("kdn_worker_kvbus_leased_bytes", "gauge",
             "Bytes of a decode worker's kvbus receiver slots granted to senders and not yet "
             "filled, each under a lease.",
             [](const WorkerGauge& w) { return w.kvbus_leased_bytes; });
  // Per kvbus data plane: what each prefill worker sent and each decode
  // worker received (docs/kvbus.md, "Transports").
  const auto per_transport = [&](const char* name, const char* help, auto value) {
    Head(&out, name, "counter", help);
    for (const WorkerGauge& w : workers) {
      for (const WorkerGauge::Transport& t : w.kv_transports) {
        out += std::string(name) + "{worker=\"" + Label(w.name) + "\",role=\"" + Label(w.role) +
               "\",transport=\"" + Label(t.name) + "\"} " + value(t) + "\n";
      }
    }
  };
  per_transport("kdn_worker_kv_transport_chunks_total",
                "KV chunks (layer slices) moved by kvbus, per data plane.",
                [](const WorkerGauge::Transport& t) { return std::to_string(t.chunks); });
  per_transport("kdn_worker_kv_transport_bytes_total", "KV bytes moved by kvbus, per data plane.",
                [](const WorkerGauge::Transport& t) { return std::to_string(t.bytes); });
  per_transport("kdn_worker_kv_transport_seconds_total",
                "Seconds a prefill worker's kvbus batches were in flight, per data plane.",
                [](const WorkerGauge::Transport& t) { return Num(t.seconds); });
  // The KV codec at each worker's kdn-store tier (docs/kvbus.md, "KV codec").
  Head(&out, "kdn_worker_kv_codec_chunks_total", "counter",
       "KV chunks a worker coded for kdn-store (op=encode) or decoded from it (op=decode).");
  for (const WorkerGauge& w : workers) {
    const std::string l = "{worker=\"" + Label(w.name) + "\",role=\"" + Label(w.role) + "\",op=\"";
    out += "kdn_worker_kv_codec_chunks_total" + l + "encode\"} " +
           std::to_string(w.kv_codec.encoded_chunks) + "\n";
    out += "kdn_worker_kv_codec_chunks_total" + l + "decode\"} " +
           std::to_string(w.kv_codec.decoded_chunks) + "\n";
  }
  Head(&out, "kdn_worker_kv_codec_bytes_total", "counter",
       "Payload bytes of the chunks a worker coded for kdn-store, before (form=raw) and after "
       "(form=encoded).");
  for (const WorkerGauge& w : workers) {
    const std::string l =
        "{worker=\"" + Label(w.name) + "\",role=\"" + Label(w.role) + "\",form=\"";
    out += "kdn_worker_kv_codec_bytes_total" + l + "raw\"} " +
           std::to_string(w.kv_codec.raw_bytes) + "\n";
    out += "kdn_worker_kv_codec_bytes_total" + l + "encoded\"} " +
           std::to_string(w.kv_codec.encoded_bytes) + "\n";
  }
  per_worker("kdn_worker_kv_codec_decode_errors_total", "counter",
             "Coded chunks from kdn-store that did not decode: each a miss, recomputed, never "
             "served.",
             [](const WorkerGauge& w) { return w.kv_codec.decode_errors; });
  // Its KV pool as the KDN's first tier (docs/engine.md, "Resident KV").
  per_worker("kdn_worker_resident_kv_blocks", "gauge",
             "KV blocks a worker's pool keeps resident under content keys (some also in use).",
             [](const WorkerGauge& w) { return w.resident.cached_blocks; });
  per_worker("kdn_worker_resident_evictable_kv_blocks", "gauge",
             "Of the resident KV blocks, those no request holds: counted as free.",
             [](const WorkerGauge& w) { return w.resident.evictable_blocks; });
  per_worker("kdn_worker_resident_evictions_total", "counter",
             "Resident KV entries a worker's pool dropped to make room.",
             [](const WorkerGauge& w) { return w.resident.evictions; });
  per_worker("kdn_worker_resident_hit_tokens_total", "counter",
             "Prompt tokens whose KV a worker attached from its pool, moving no KV.",
             [](const WorkerGauge& w) { return w.resident.hit_tokens; });
  per_worker("kdn_worker_resident_copied_blocks_total", "counter",
             "Shared KV blocks a worker copied before a request wrote into them.",
             [](const WorkerGauge& w) { return w.resident.copied_blocks; });
  per_worker("kdn_worker_kv_loaded_bytes_total", "counter",
             "KV bytes a worker copied into its pool from its lower KDN tiers (host, disk, "
             "kdn-store); a resident hit adds nothing.",
             [](const WorkerGauge& w) { return w.resident.kv_bytes_loaded; });
  // Pushed KV on decode workers (docs/kvbus.md, "Landing in place").
  per_worker("kdn_worker_kv_landed_slices_total", "counter",
             "Layer slices a decode worker's kvbus receiver landed in place, in their KV blocks.",
             [](const WorkerGauge& w) { return w.pushed_kv.slices_landed; });
  per_worker("kdn_worker_kv_landed_bytes_total", "counter", "Bytes of those slices.",
             [](const WorkerGauge& w) { return w.pushed_kv.landed_bytes; });
  per_worker("kdn_worker_kv_start_copy_bytes_total", "counter",
             "KV bytes a decode worker copied into blocks at Start from its staging tier (0 "
             "when every pushed slice landed in place).",
             [](const WorkerGauge& w) { return w.pushed_kv.start_copy_bytes; });
  per_worker("kdn_worker_kv_quarantined_blocks", "gauge",
             "KV blocks a decode worker holds back after a request left while a push into them "
             "may still be under way.",
             [](const WorkerGauge& w) { return w.pushed_kv.quarantined_blocks; });
  // Local prefill on decode workers (docs/serving.md, "Two paths").
  per_worker("kdn_worker_local_prefills_total", "counter",
             "Prompts a decode worker computed itself (local prefill).",
             [](const WorkerGauge& w) { return w.local_prefill.requests; });
  per_worker("kdn_worker_local_prefill_tokens_total", "counter",
             "Prompt tokens a decode worker's local prefills computed.",
             [](const WorkerGauge& w) { return w.local_prefill.tokens; });
  per_worker("kdn_worker_local_prefill_backlog_tokens", "gauge",
             "Prompt tokens of local prefills a decode worker has still to compute.",
             [](const WorkerGauge& w) { return w.local_prefill.backlog_tokens; });
  per_worker("kdn_worker_decode_step_seconds", "gauge",
             "A decode worker's decode steps, recent average (0 before its first).",
             [](const WorkerGauge& w) { return w.local_prefill.step_ms / 1e3; });
  per_worker("kdn_worker_local_prefill_seconds_per_token", "gauge",
             "A decode worker's local prefill pieces per prompt token, recent average (0 "
             "before its first).",
             [](const WorkerGauge& w) { return w.local_prefill.prefill_ms_per_token / 1e3; });
  per_worker("kdn_worker_store_unreachable_total", "counter",
             "A worker's kdn-store requests that failed for want of an answer (timed out, or "
             "refused at once while the store is held to be down): each a cache miss.",
             [](const WorkerGauge& w) { return w.store_unreachable; });
  return out;
}

}  // namespace kdn::router
