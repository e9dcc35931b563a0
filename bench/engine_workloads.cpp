// kdn-bench's engine workloads: prefill and decode (see kdn_bench.cpp).
#include <omp.h>

#include <algorithm>
#include <cstdio>

#include "bench_util.h"
#include "kdn/engine/cpu_engine.h"
#include "kdn/engine/cpu_runtime.h"
#include "llama_cpp_peer.h"

namespace kdn::bench {

using namespace kdn::engine;

double ForwardFlops(const model::ModelConfig& m, int64_t n, int64_t past, int64_t logit_rows) {
  const double d = m.hidden_size, q = m.q_dim(), kv = m.kv_dim(), ff = m.intermediate_size;
  const double per_token = 2.0 * (d * (q + 2 * kv) + q * d + 3 * d * ff);
  // Query i attends to past + i + 1 keys: QK^T and PV, 2 FLOPs per MAC each.
  const double pairs = n * static_cast<double>(past) + n * (n + 1) / 2.0;
  const double attn = 4.0 * q * pairs;
  return m.num_layers * (n * per_token + attn) + 2.0 * logit_rows * d * m.vocab_size;
}

namespace {

// The peer's tokens/s for each of `keys` (llama-bench's rows picked by
// `key_of`), or an error; empty when no peer was asked for.
Result<std::vector<double>> PeerRates(const Common& c, const std::vector<std::string>& args,
                                      const std::vector<int>& keys,
                                      int (*key_of)(const LlamaBenchRow&)) {
  std::vector<double> rates(keys.size(), 0.0);
  if (c.llama_bench.empty()) return rates;
  if (c.model_dir.empty()) {
    return InvalidArgument("--llama-cpp needs --model FILE.gguf: llama.cpp runs the same file");
  }
  KDN_ASSIGN_OR_RETURN(auto rows,
                       RunLlamaBench(c.llama_bench, c.model_dir, c.threads, c.reps, args));
  for (size_t i = 0; i < keys.size(); ++i) {
    for (const LlamaBenchRow& r : rows) {
      if (key_of(r) == keys[i]) rates[i] = r.tokens_per_s;
    }
  }
  return rates;
}

// The peer's fields of a JSON row: its rate and kdn's ratio to it (null
// where the peer has no such test).
void AddPeer(json* row, double tokens_per_s, double peer) {
  (*row)["peer_tokens_per_s"] = peer > 0 ? json(peer) : json(nullptr);
  (*row)["ratio_to_peer"] = peer > 0 ? json(tokens_per_s / peer) : json(nullptr);
}

// Weight bytes a decode step reads: the CPU engine's own count, else fp32.
double WeightBytes(const Engine& e) {
  if (const auto* cpu = dynamic_cast<const CpuEngine*>(&e)) return cpu->weight_bytes();
  return 4.0 * e.config().ParameterCount();
}

}  // namespace

int RunPrefill(const Common& c, const std::vector<int>& lengths) {
  std::string what;
  const int max_len = *std::max_element(lengths.begin(), lengths.end());
  auto model = MakeModel(c, max_len + 16, &what);
  if (!model.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", model.status().ToString().c_str());
    return 1;
  }
  const model::ModelConfig& cfg = (*model)->config();
  const double rss = RssMib();
  const double peak = SgemmPeakGflops(2048, std::max(c.reps, 8));
  std::printf("prefill on %s, %d threads, OpenBLAS %s; sgemm peak %.1f GFLOP/s; RSS %.0f MiB\n",
              what.c_str(), omp_get_max_threads(), BlasCoreName().c_str(), peak, rss);
  std::printf("%8s %10s %12s %10s %8s %12s %8s\n", "tokens", "seconds", "tokens/s", "GFLOP/s",
              "of peak", "llama.cpp", "ratio");
  json rows = json::array();
  for (int n : lengths) {
    std::vector<int32_t> tokens(n);
    for (int i = 0; i < n; ++i) tokens[i] = (i * 131 + 7) % std::min(cfg.vocab_size, 256);
    double best = 1e30;
    for (int r = 0; r < c.reps + 1; ++r) {
      KvSequence seq = (*model)->kv_cache().NewSequence();
      std::vector<float> logits;
      auto t0 = Clock::now();
      kdn::Status st = (*model)->Prefill(seq, tokens, {}, &logits);
      const double s = Seconds(t0, Clock::now());
      if (!st.ok()) {
        std::fprintf(stderr, "kdn-bench: %s\n", st.ToString().c_str());
        return 1;
      }
      if (r > 0 || c.reps == 0) best = std::min(best, s);
    }
    const double gflops = ForwardFlops(cfg, n, 0, 1) / best / 1e9;
    rows.push_back({{"tokens", n},
                    {"seconds", best},
                    {"tokens_per_s", n / best},
                    {"gflops", gflops},
                    {"fraction_of_sgemm_peak", gflops / peak}});
  }
  // llama-bench's pp<n>: one prompt of n tokens, after kdn's runs.
  std::string pp;
  for (int n : lengths) pp += (pp.empty() ? "" : ",") + std::to_string(n);
  auto peer = PeerRates(c, {"-p", pp, "-n", "0"}, lengths,
                        [](const LlamaBenchRow& r) { return r.n_gen == 0 ? r.n_prompt : -1; });
  if (!peer.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", peer.status().ToString().c_str());
    return 1;
  }
  for (size_t i = 0; i < lengths.size(); ++i) {
    json& r = rows[i];
    const double tps = r["tokens_per_s"], p = (*peer)[i];
    if (!c.llama_bench.empty()) AddPeer(&r, tps, p);
    std::printf("%8d %10.3f %12.1f %10.1f %7.1f%% %12s %8s\n", lengths[i],
                r["seconds"].get<double>(), tps, r["gflops"].get<double>(),
                100.0 * r["gflops"].get<double>() / peak,
                p > 0 ? std::to_string(static_cast<int>(p)).c_str() : "-",
                p > 0 ? (std::to_string(tps / p).substr(0, 5) + "x").c_str() : "-");
  }
  Emit(c, {{"workload", "prefill"},
           {"model", what},
           {"machine", Machine(c)},
           {"sgemm_peak_gflops", peak},
           {"rss_mib", rss},
           {"peer", c.llama_bench.empty() ? json(nullptr) : json("llama.cpp llama-bench")},
           {"results", rows}});
  return 0;
}

int RunDecode(const Common& c, const std::vector<int>& batches, int context, int steps) {
  std::string what;
  const int max_b = *std::max_element(batches.begin(), batches.end());
  auto model = MakeModel(c, static_cast<int64_t>(max_b) * (context + steps + 16), &what);
  if (!model.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", model.status().ToString().c_str());
    return 1;
  }
  const model::ModelConfig& cfg = (*model)->config();
  const double rss = RssMib();
  const double bw = MemcpyGBps(size_t{512} << 20, std::max(c.reps, 4));
  const double peak = SgemmPeakGflops(2048, std::max(c.reps, 8));
  // Bytes one step must read whatever the batch: every weight once, in the
  // format the engine holds it.
  const double weight_bytes = WeightBytes(**model);
  std::printf(
      "decode on %s, %d threads, OpenBLAS %s, context %d, %d steps; weights %.1f MiB, RSS %.0f "
      "MiB; memcpy %.1f GB/s, sgemm peak %.1f GFLOP/s\n",
      what.c_str(), omp_get_max_threads(), BlasCoreName().c_str(), context, steps,
      weight_bytes / (1 << 20), rss, bw, peak);
  std::printf("%6s %12s %10s %10s %8s %10s %8s\n", "batch", "tokens/s", "ms/step", "GB/s",
              "of memcpy", "GFLOP/s", "of peak");
  json rows = json::array();
  for (int b : batches) {
    std::vector<KvSequence> seqs;
    std::vector<float> logits;
    for (int i = 0; i < b; ++i) {
      seqs.push_back((*model)->kv_cache().NewSequence());
      std::vector<int32_t> prompt(context);
      for (int t = 0; t < context; ++t) prompt[t] = (t * 17 + i * 3) % 256;
      kdn::Status st = (*model)->Prefill(seqs.back(), prompt, {}, &logits);
      if (!st.ok()) {
        std::fprintf(stderr, "kdn-bench: %s\n", st.ToString().c_str());
        return 1;
      }
    }
    std::vector<KvSequence*> ptrs;
    for (auto& s : seqs) ptrs.push_back(&s);
    std::vector<int32_t> next(b, 65);
    double kv_bytes = 0.0, flops = 0.0;
    auto t0 = Clock::now();
    for (int s = 0; s < steps; ++s) {
      for (auto* p : ptrs) {
        kv_bytes += 2.0 * 4.0 * cfg.num_layers * cfg.kv_dim() * (p->length() + 1);
        flops += ForwardFlops(cfg, 1, p->length(), 1);
      }
      kdn::Status st = (*model)->DecodeStep(ptrs, next, &logits);
      if (!st.ok()) {
        std::fprintf(stderr, "kdn-bench: %s\n", st.ToString().c_str());
        return 1;
      }
    }
    const double secs = Seconds(t0, Clock::now());
    const double gbps = (steps * weight_bytes + kv_bytes) / secs / 1e9;
    const double gflops = flops / secs / 1e9;
    std::printf("%6d %12.1f %10.2f %10.1f %7.1f%% %10.1f %7.1f%%\n", b, b * steps / secs,
                1e3 * secs / steps, gbps, 100.0 * gbps / bw, gflops, 100.0 * gflops / peak);
    rows.push_back({{"batch", b},
                    {"tokens_per_s", b * steps / secs},
                    {"ms_per_step", 1e3 * secs / steps},
                    {"gbytes_per_s", gbps},
                    {"fraction_of_memcpy", gbps / bw},
                    {"gflops", gflops},
                    {"fraction_of_sgemm_peak", gflops / peak}});
  }
  // llama-bench's tg<steps> at depth <context>: one sequence, so batch 1's
  // peer alone.
  auto peer =
      PeerRates(c, {"-p", "0", "-n", std::to_string(steps), "-d", std::to_string(context)}, {steps},
                [](const LlamaBenchRow& r) { return r.n_prompt == 0 ? r.n_gen : -1; });
  if (!peer.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", peer.status().ToString().c_str());
    return 1;
  }
  if (!c.llama_bench.empty()) {
    for (json& r : rows) {
      const double tps = r["tokens_per_s"];
      AddPeer(&r, tps, r["batch"] == 1 ? (*peer)[0] : 0.0);
      if (r["batch"] == 1) {
        std::printf("llama.cpp tg%d at depth %d, batch 1: %.1f tokens/s; kdn %.2fx\n", steps,
                    context, (*peer)[0], (*peer)[0] > 0 ? tps / (*peer)[0] : 0.0);
      }
    }
  }
  Emit(c, {{"workload", "decode"},
           {"model", what},
           {"machine", Machine(c)},
           {"context", context},
           {"steps", steps},
           {"weight_bytes", weight_bytes},
           {"rss_mib", rss},
           {"memcpy_gbytes_per_s", bw},
           {"sgemm_peak_gflops", peak},
           {"peer", c.llama_bench.empty() ? json(nullptr) : json("llama.cpp llama-bench")},
           {"results", rows}});
  return 0;
}

}  // namespace kdn::bench
