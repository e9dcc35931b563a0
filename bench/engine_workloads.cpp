// kdn-bench's engine workloads: prefill and decode (see kdn_bench.cpp).
#include <omp.h>

#include <algorithm>
#include <cstdio>

#include "bench_util.h"
#include "kdn/engine/cpu_runtime.h"

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

int RunPrefill(const Common& c, const std::vector<int>& lengths) {
  std::string what;
  const int max_len = *std::max_element(lengths.begin(), lengths.end());
  auto model = MakeModel(c, max_len + 16, &what);
  if (!model.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", model.status().ToString().c_str());
    return 1;
  }
  const model::ModelConfig& cfg = (*model)->config();
  const double peak = SgemmPeakGflops(2048, std::max(c.reps, 8));
  std::printf("prefill on %s, %d threads, OpenBLAS %s; sgemm peak %.1f GFLOP/s\n", what.c_str(),
              omp_get_max_threads(), BlasCoreName().c_str(), peak);
  std::printf("%8s %10s %12s %10s %8s\n", "tokens", "seconds", "tokens/s", "GFLOP/s", "of peak");
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
    std::printf("%8d %10.3f %12.1f %10.1f %7.1f%%\n", n, best, n / best, gflops,
                100.0 * gflops / peak);
    rows.push_back({{"tokens", n},
                    {"seconds", best},
                    {"tokens_per_s", n / best},
                    {"gflops", gflops},
                    {"fraction_of_sgemm_peak", gflops / peak}});
  }
  Emit(c, {{"workload", "prefill"},
           {"model", what},
           {"machine", Machine(c)},
           {"sgemm_peak_gflops", peak},
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
  const double bw = MemcpyGBps(size_t{512} << 20, std::max(c.reps, 4));
  const double peak = SgemmPeakGflops(2048, std::max(c.reps, 8));
  // Bytes one step must read whatever the batch: every weight once (fp32).
  const double weight_bytes = 4.0 * cfg.ParameterCount();
  std::printf(
      "decode on %s, %d threads, OpenBLAS %s, context %d, %d steps; memcpy %.1f GB/s, sgemm peak "
      "%.1f GFLOP/s\n",
      what.c_str(), omp_get_max_threads(), BlasCoreName().c_str(), context, steps, bw, peak);
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
  Emit(c, {{"workload", "decode"},
           {"model", what},
           {"machine", Machine(c)},
           {"context", context},
           {"steps", steps},
           {"memcpy_gbytes_per_s", bw},
           {"sgemm_peak_gflops", peak},
           {"results", rows}});
  return 0;
}

}  // namespace kdn::bench
