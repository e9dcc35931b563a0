// kdn-bench prefill and decode with --device cuda: CudaEngine in bf16 on one
// GPU, against two ceilings measured in the same run: the bf16 matrix
// product (cuBLAS, 8192^3, the kind of product the model runs) and a
// device-to-device copy (bytes read plus written); and, with --peer, against
// transformers on the same GPU (bench/hf_peer.py's JSON).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "bench_util.h"
#include "kdn/common/cuda_status.h"
#include "kdn/engine/cuda/cuda_engine.h"
#include "kdn/engine/cuda/init.cuh"
#include "kdn/engine/presets.h"

namespace kdn::bench {

using namespace kdn::engine;
using namespace kdn::engine::cuda;

namespace {

// Milliseconds of `work()` on the default stream, best of `reps` after one
// warm-up.
template <typename Work>
Result<double> BestMs(Work&& work, int reps) {
  cudaEvent_t a = nullptr, b = nullptr;
  KDN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&a));
  KDN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&b));
  double best = 1e30;
  Status st;
  for (int r = 0; r < reps + 1 && st.ok(); ++r) {
    cudaEventRecord(a, nullptr);
    st = work();
    cudaEventRecord(b, nullptr);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (r > 0) best = std::min<double>(best, ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  KDN_RETURN_IF_ERROR(st);
  return best;
}

// TFLOP/s of a bf16 product with fp32 accumulation, n x n x n.
Result<double> Bf16GemmPeakTflops(int n, int reps) {
  const int64_t elems = int64_t{n} * n;
  __nv_bfloat16 *a = nullptr, *b = nullptr, *c = nullptr;
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&a), elems * sizeof(__nv_bfloat16)));
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&b), elems * sizeof(__nv_bfloat16)));
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&c), elems * sizeof(__nv_bfloat16)));
  KDN_RETURN_IF_ERROR(FillUniformCuda(a, elems, 1, 1, 1.0f, nullptr));
  KDN_RETURN_IF_ERROR(FillUniformCuda(b, elems, 1, 2, 1.0f, nullptr));
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return Internal("cublasCreate failed");
  const float alpha = 1, beta = 0;
  auto ms = BestMs(
      [&]() -> Status {
        for (int i = 0; i < 10; ++i) {
          if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b,
                           CUDA_R_16BF, n, &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            return Internal("cublasGemmEx failed");
          }
        }
        return Status::Ok();
      },
      reps);
  cublasDestroy(h);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  KDN_ASSIGN_OR_RETURN(double best, ms);
  return 10 * 2.0 * n * double(n) * n / (best / 1e3) / 1e12;
}

// GB/s of a device-to-device copy of `bytes`, counting bytes read and written.
Result<double> DeviceCopyGBps(size_t bytes, int reps) {
  void *src = nullptr, *dst = nullptr;
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(&src, bytes));
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(&dst, bytes));
  auto ms = BestMs(
      [&]() -> Status {
        KDN_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, nullptr));
        return Status::Ok();
      },
      reps);
  cudaFree(src);
  cudaFree(dst);
  KDN_ASSIGN_OR_RETURN(double best, ms);
  return 2.0 * bytes / (best / 1e3) / 1e9;
}

Result<std::unique_ptr<CudaEngine>> MakeCudaModel(const Common& c, const CudaEngineOptions& o,
                                                  std::string* what) {
  if (!c.model_dir.empty()) {
    *what = c.model_dir;
    KDN_ASSIGN_OR_RETURN(model::ModelConfig cfg, model::LoadModelConfig(c.model_dir));
    KDN_ASSIGN_OR_RETURN(ModelWeights w, LoadWeights(c.model_dir, cfg));
    return CudaEngine::Create(cfg, w, o);
  }
  KDN_ASSIGN_OR_RETURN(Preset p, FindPreset(c.preset));
  *what = "preset " + p.name + " materialised on the device (seed " + std::to_string(c.seed) + ")";
  return CudaEngine::Materialize(p.config, c.seed, o);
}

std::string DeviceName() {
  cudaDeviceProp prop{};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    return "unknown GPU";
  }
  return prop.name;
}

// hf_peer.py's JSON (--peer), read once; null without --peer.
Result<json> LoadPeer(const Common& c) {
  if (c.peer_path.empty()) return json();
  std::ifstream in(c.peer_path);
  json peer = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (peer.is_discarded() || !peer.is_object()) {
    return InvalidArgument("--peer " + c.peer_path + ": not bench/hf_peer.py's JSON");
  }
  return peer;
}

// Adds the peer's tokens/s for the row whose `key` is `value` in `section`,
// and kdn's ratio to it, to `row`; returns the ratio for the table ("-"
// where the peer has no such row).
std::string AddPeerRatio(const json& peer, const char* section, const char* key, int value,
                         double tokens_per_s, json* row) {
  if (!peer.contains(section)) return "-";
  for (const json& p : peer[section]) {
    if (p.value(key, -1) == value && p.contains("tokens_per_s")) {
      const double theirs = p["tokens_per_s"].get<double>();
      (*row)["peer_tokens_per_s"] = theirs;
      (*row)["vs_peer"] = tokens_per_s / theirs;
      return std::to_string(tokens_per_s / theirs).substr(0, 5) + "x";
    }
  }
  return "-";
}

std::string Paths(const CudaEngine& m) {
  return std::string(m.uses_flash_attention() ? "FlashInfer attention" : "reference attention") +
         (m.uses_cuda_graphs() ? ", decode graphs" : ", eager decode");
}

int Fail(const Status& st) {
  std::fprintf(stderr, "kdn-bench: %s\n", st.ToString().c_str());
  return 1;
}

}  // namespace

int RunCudaPrefill(const Common& c, const std::vector<int>& lengths) {
  const int max_len = *std::max_element(lengths.begin(), lengths.end());
  CudaEngineOptions o;
  o.kv_tokens = max_len + 16;
  o.max_prefill_tokens = max_len;
  o.max_batch = 1;
  std::string what;
  auto peer = LoadPeer(c);
  if (!peer.ok()) return Fail(peer.status());
  auto model = MakeCudaModel(c, o, &what);
  if (!model.ok()) return Fail(model.status());
  const model::ModelConfig& cfg = (*model)->config();
  auto peak = Bf16GemmPeakTflops(8192, std::max(c.reps, 3));
  if (!peak.ok()) return Fail(peak.status());
  std::printf("prefill on %s, %s, bf16 (%s); cuBLAS bf16 GEMM peak %.1f TFLOP/s\n", what.c_str(),
              DeviceName().c_str(), Paths(**model).c_str(), *peak);
  std::printf("%8s %10s %12s %10s %8s %9s\n", "tokens", "seconds", "tokens/s", "TFLOP/s", "of peak",
              "vs peer");
  json rows = json::array();
  for (int n : lengths) {
    std::vector<int32_t> tokens(n);
    for (int i = 0; i < n; ++i) tokens[i] = (i * 131 + 7) % std::min(cfg.vocab_size, 32000);
    double best = 1e30;
    for (int r = 0; r < c.reps + 1; ++r) {
      KvSequence seq = (*model)->kv_cache().NewSequence();
      std::vector<float> logits;
      const auto t0 = Clock::now();
      Status st =
          (*model)->Prefill(seq, tokens, {}, &logits);  // returns with the logits on the host
      const double s = Seconds(t0, Clock::now());
      seq.Reset();
      if (!st.ok()) return Fail(st);
      if (r > 0 || c.reps == 0) best = std::min(best, s);
    }
    const double tflops = ForwardFlops(cfg, n, 0, 1) / best / 1e12;
    json row = {{"tokens", n},
                {"seconds", best},
                {"tokens_per_s", n / best},
                {"tflops", tflops},
                {"fraction_of_bf16_gemm_peak", tflops / *peak}};
    const std::string vs = AddPeerRatio(*peer, "prefill", "tokens", n, n / best, &row);
    std::printf("%8d %10.4f %12.0f %10.1f %7.1f%% %9s\n", n, best, n / best, tflops,
                100.0 * tflops / *peak, vs.c_str());
    rows.push_back(row);
  }
  Emit(c, {{"workload", "prefill"},
           {"device", DeviceName()},
           {"model", what},
           {"paths", Paths(**model)},
           {"bf16_gemm_peak_tflops", *peak},
           {"results", rows}});
  return 0;
}

int RunCudaDecode(const Common& c, const std::vector<int>& batches, int context, int steps) {
  const int max_b = *std::max_element(batches.begin(), batches.end());
  CudaEngineOptions o;
  o.kv_tokens = static_cast<int64_t>(max_b) * (context + steps + 16);
  o.max_prefill_tokens = context;
  o.max_batch = max_b;
  std::string what;
  auto peer = LoadPeer(c);
  if (!peer.ok()) return Fail(peer.status());
  auto model = MakeCudaModel(c, o, &what);
  if (!model.ok()) return Fail(model.status());
  const model::ModelConfig& cfg = (*model)->config();
  auto bw = DeviceCopyGBps(size_t{2} << 30, std::max(c.reps, 5));
  if (!bw.ok()) return Fail(bw.status());
  // Bytes a step must read: every weight but the input embeddings, of which
  // it reads one row per sequence (unless tied, where they are the LM head).
  const double embed_bytes =
      cfg.tie_word_embeddings ? 0.0 : 2.0 * double(cfg.vocab_size) * cfg.hidden_size;
  const double weight_bytes = static_cast<double>((*model)->weight_bytes()) - embed_bytes;
  std::printf(
      "decode on %s, %s, bf16 (%s), greedy on the device, context %d, %d steps; "
      "device copy %.0f GB/s\n",
      what.c_str(), DeviceName().c_str(), Paths(**model).c_str(), context, steps, *bw);
  std::printf("%6s %12s %10s %10s %9s %9s\n", "batch", "tokens/s", "ms/step", "GB/s", "of copy",
              "vs peer");
  json rows = json::array();
  for (int b : batches) {
    std::vector<KvSequence> seqs;
    for (int i = 0; i < b; ++i) seqs.push_back((*model)->kv_cache().NewSequence());
    std::vector<float> logits;
    for (int i = 0; i < b; ++i) {
      std::vector<int32_t> prompt(context);
      for (int t = 0; t < context; ++t) prompt[t] = (t * 17 + i * 3) % 256;
      Status st = (*model)->Prefill(seqs[i], prompt, {}, &logits);
      if (!st.ok()) return Fail(st);
    }
    std::vector<KvSequence*> ptrs;
    for (auto& s : seqs) ptrs.push_back(&s);
    std::vector<int32_t> next(b, 65);
    // One untimed step (it captures the batch's graph), then the timed ones,
    // each feeding its greedy choices to the next as a server would.
    if (Status st = (*model)->DecodeGreedy(ptrs, next, &next); !st.ok()) return Fail(st);
    double kv_bytes = 0.0;
    const auto t0 = Clock::now();
    for (int s = 0; s < steps; ++s) {
      for (auto* p : ptrs)
        kv_bytes += 2.0 * 2.0 * cfg.num_layers * cfg.kv_dim() * (p->length() + 1);
      if (Status st = (*model)->DecodeGreedy(ptrs, next, &next); !st.ok()) return Fail(st);
    }
    const double secs = Seconds(t0, Clock::now());
    const double gbps = (steps * weight_bytes + kv_bytes) / secs / 1e9;
    json row = {{"batch", b},
                {"tokens_per_s", b * steps / secs},
                {"ms_per_step", 1e3 * secs / steps},
                {"gbytes_per_s", gbps},
                {"fraction_of_device_copy", gbps / *bw}};
    const std::string vs = AddPeerRatio(*peer, "decode", "batch", b, b * steps / secs, &row);
    std::printf("%6d %12.1f %10.2f %10.0f %8.1f%% %9s\n", b, b * steps / secs, 1e3 * secs / steps,
                gbps, 100.0 * gbps / *bw, vs.c_str());
    rows.push_back(row);
    for (auto& s : seqs) s.Reset();
  }
  Emit(c, {{"workload", "decode"},
           {"device", DeviceName()},
           {"model", what},
           {"paths", Paths(**model)},
           {"context", context},
           {"steps", steps},
           {"device_copy_gbytes_per_s", *bw},
           {"results", rows}});
  return 0;
}

}  // namespace kdn::bench
