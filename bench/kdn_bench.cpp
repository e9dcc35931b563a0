// kdn-bench: named workloads, each reported as a table for people and, with
// --json, one JSON object for machines. Every figure comes with the ratio it
// exists for, taken in the same run.
//
// Workloads (more arrive with the subsystems they measure):
//   prefill   one long prompt, no cache: tokens/s, and achieved GFLOP/s
//             against the sgemm peak of this machine measured in the same run.
//   decode    a batch of sequences generating: tokens/s; achieved GFLOP/s
//             against the same sgemm peak; and the bytes a step must read
//             (weights + KV) per second against memcpy bandwidth, the limit
//             that matters at small batches, measured in the same run.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "kdn/engine/cpu_runtime.h"
#include "kdn/engine/model.h"
#include "kdn/engine/presets.h"

namespace {

using namespace kdn::engine;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Best-of-N GFLOP/s of a square single-precision product: the ceiling the
// engine's matrix products can reach on this machine with these threads.
double SgemmPeakGflops(int n, int reps) {
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  double best = 0.0;
  for (int r = 0; r < reps + 1; ++r) {
    auto t0 = Clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    const double s = Seconds(t0, Clock::now());
    if (r > 0) best = std::max(best, 2.0 * n * n * n / s / 1e9);  // first run warms up
  }
  return best;
}

// Best-of-N GB/s of memcpy over a buffer far larger than the caches, counting
// bytes read plus bytes written, with the same threads as the engine.
double MemcpyGBps(size_t bytes, int reps) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 0.0;
  for (int r = 0; r < reps + 1; ++r) {
    auto t0 = Clock::now();
#pragma omp parallel
    {
      const size_t nt = omp_get_num_threads(), t = omp_get_thread_num();
      const size_t per = bytes / nt, lo = t * per, hi = t + 1 == nt ? bytes : lo + per;
      std::memcpy(dst.data() + lo, src.data() + lo, hi - lo);
    }
    const double s = Seconds(t0, Clock::now());
    if (r > 0) best = std::max(best, 2.0 * bytes / s / 1e9);
  }
  return best;
}

struct Common {
  std::string preset = "small";
  uint64_t seed = 0;
  std::string model_dir;
  int threads = 0;
  int reps = 3;
  std::string json_path;
};

kdn::Result<std::unique_ptr<Model>> MakeModel(const Common& c, int64_t kv_tokens, std::string* what) {
  EngineOptions opts;
  opts.threads = c.threads;
  opts.kv_tokens = kv_tokens;
  if (!c.model_dir.empty()) {
    *what = c.model_dir;
    return Model::Load(c.model_dir, opts);
  }
  KDN_ASSIGN_OR_RETURN(Preset p, FindPreset(c.preset));
  *what = "preset " + p.name + " (seed " + std::to_string(c.seed) + ")";
  return Model::Create(p.config, GenerateWeights(p.config, c.seed, p.dtype), opts);
}

json Machine(const Common& c) {
  return {{"backend", "cpu"},
          {"threads", c.threads > 0 ? c.threads : omp_get_max_threads()},
          {"hardware_threads", std::thread::hardware_concurrency()},
          {"blas", openblas_get_config()},
          {"blas_core", BlasCoreName()}};
}

void Emit(const Common& c, const json& j) {
  if (c.json_path.empty()) return;
  std::ofstream out(c.json_path);
  out << j.dump(2) << "\n";
  std::printf("wrote %s\n", c.json_path.c_str());
}

// FLOPs of a forward pass over n new tokens after `past` cached ones, with
// logits for `logit_rows` of them: matrix products plus causal attention.
double ForwardFlops(const ModelConfig& m, int64_t n, int64_t past, int64_t logit_rows) {
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
  const ModelConfig& cfg = (*model)->config();
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
    rows.push_back({{"tokens", n}, {"seconds", best}, {"tokens_per_s", n / best},
                    {"gflops", gflops}, {"fraction_of_sgemm_peak", gflops / peak}});
  }
  Emit(c, {{"workload", "prefill"}, {"model", what}, {"machine", Machine(c)},
           {"sgemm_peak_gflops", peak}, {"results", rows}});
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
  const ModelConfig& cfg = (*model)->config();
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
    rows.push_back({{"batch", b}, {"tokens_per_s", b * steps / secs},
                    {"ms_per_step", 1e3 * secs / steps}, {"gbytes_per_s", gbps},
                    {"fraction_of_memcpy", gbps / bw}, {"gflops", gflops},
                    {"fraction_of_sgemm_peak", gflops / peak}});
  }
  Emit(c, {{"workload", "decode"}, {"model", what}, {"machine", Machine(c)}, {"context", context},
           {"steps", steps}, {"memcpy_gbytes_per_s", bw}, {"sgemm_peak_gflops", peak}, {"results", rows}});
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  kdn::engine::PrepareCpuRuntime(argv);
  CLI::App app{"kdn benchmarks: named workloads, reported as ratios taken in one run."};
  app.require_subcommand(1);
  Common c;
  auto common = [&](CLI::App* sub) {
    sub->add_option("--preset", c.preset, "Generated model preset (ignored with --model)")
        ->capture_default_str();
    sub->add_option("--seed", c.seed, "Seed of the generated weights")->capture_default_str();
    sub->add_option("--model", c.model_dir, "Model folder instead of a preset");
    sub->add_option("--threads", c.threads, "CPU threads (0 = all cores)")->capture_default_str();
    sub->add_option("--reps", c.reps, "Timed repetitions (best is reported)")->capture_default_str();
    sub->add_option("--json", c.json_path, "Also write the results as one JSON object");
  };
  std::vector<int> lengths = {512, 2048};
  auto* prefill = app.add_subcommand("prefill", "One long prompt, no cache: tokens/s and GFLOP/s vs sgemm peak");
  common(prefill);
  prefill->add_option("--tokens", lengths, "Prompt lengths")->capture_default_str()->delimiter(',');

  std::vector<int> batches = {1, 8, 32};
  int context = 512, steps = 16;
  auto* decode = app.add_subcommand("decode", "A batch generating: tokens/s and GB/s vs memcpy");
  common(decode);
  decode->add_option("--batch", batches, "Batch sizes")->capture_default_str()->delimiter(',');
  decode->add_option("--context", context, "Tokens of KV each sequence holds")->capture_default_str();
  decode->add_option("--steps", steps, "Decode steps timed per batch size")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  if (c.threads > 0) {
    omp_set_num_threads(c.threads);
    openblas_set_num_threads(c.threads);
  }
  if (prefill->parsed()) return RunPrefill(c, lengths);
  return RunDecode(c, batches, context, steps);
}
