#pragma once
// Helpers of the CUDA kernel tests: device buffers, copies both ways, bf16
// conversions, a tolerance check that names the worst element, and a launch
// timer. Every test that needs a device starts with
// KDN_SKIP_WITHOUT_CUDA_DEVICE().

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <type_traits>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/common/cuda_status.h"
#include "kdn/engine/engine.h"

namespace kdn::engine::cuda::cudatest {

#define KDN_SKIP_WITHOUT_CUDA_DEVICE()                                            \
  do {                                                                            \
    if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device on this machine"; \
  } while (0)

#define KDN_ASSERT_OK(expr)                                                                   \
  do {                                                                                        \
    const ::kdn::Status kdn_assert_status_ = (expr);                                          \
    ASSERT_TRUE(kdn_assert_status_.ok()) << #expr << " -> " << kdn_assert_status_.ToString(); \
  } while (0)

#define KDN_CUDA_ASSERT_OK(expr)                                        \
  do {                                                                  \
    const cudaError_t kdn_cuda_assert_err_ = (expr);                    \
    ASSERT_EQ(kdn_cuda_assert_err_, cudaSuccess)                        \
        << #expr << " -> " << cudaGetErrorString(kdn_cuda_assert_err_); \
  } while (0)

using bf16 = __nv_bfloat16;

struct CudaFree {
  void operator()(void* p) const { (void)cudaFree(p); }
};
template <typename T>
using DevicePtr = std::unique_ptr<T[], CudaFree>;

struct CudaEventDestroy {
  void operator()(cudaEvent_t e) const { (void)cudaEventDestroy(e); }
};
using CudaEvent = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, CudaEventDestroy>;

template <typename T>
Result<DevicePtr<T>> ToDevice(const std::vector<T>& host) {
  void* p = nullptr;
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<size_t>(1, host.size()) * sizeof(T)));
  DevicePtr<T> device(static_cast<T*>(p));
  KDN_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

// Waits for the work queued so far (surfacing its errors) and copies n
// elements back.
template <typename T>
Status ToHost(const T* device, size_t n, std::vector<T>* host) {
  KDN_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  host->resize(n);
  KDN_CUDA_RETURN_IF_ERROR(cudaMemcpy(host->data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  return Status::Ok();
}

template <typename T>
std::vector<T> FromFloats(const std::vector<float>& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    std::vector<T> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16_rn(v[i]);
    return out;
  }
}

template <typename T>
std::vector<float> ToFloats(const std::vector<T>& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    std::vector<float> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
    return out;
  }
}

struct Tolerance {
  double rtol;
  double atol;
};

template <typename T>
Tolerance ToleranceFor() {
  if constexpr (std::is_same_v<T, float>) {
    return {1e-5, 1e-6};
  } else {
    return {1.0 / 128, 1e-6};
  }
}

// Passes when |got[i] - want[i]| <= atol + rtol * |want[i]| for every i; else
// says how many elements failed, the first and the worst.
inline ::testing::AssertionResult AllClose(const std::vector<float>& got,
                                           const std::vector<float>& want, Tolerance tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " != expected " << want.size();
  }
  size_t bad = 0, first = 0, worst = 0;
  double worst_excess = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double allowed = tol.atol + tol.rtol * std::fabs(static_cast<double>(want[i]));
    if (!(err <= allowed)) {  // also catches NaN
      if (bad++ == 0) first = i;
      const double excess = std::isnan(err) ? INFINITY : err / allowed;
      if (excess > worst_excess) worst_excess = excess, worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements off (rtol " << tol.rtol << ", atol "
         << tol.atol << "); first [" << first << "] got " << got[first] << " want " << want[first]
         << "; worst [" << worst << "] got " << got[worst] << " want " << want[worst];
}

// GPU logits against the CPU engine's: they agree to 3% of the CPU's largest
// magnitude (bf16 weights and activations against fp32 ones over every
// layer). Element-wise tolerances do not fit logits near zero.
inline ::testing::AssertionResult LogitsClose(const std::vector<float>& gpu,
                                              const std::vector<float>& cpu) {
  if (gpu.size() != cpu.size()) return ::testing::AssertionFailure() << "sizes differ";
  double scale = 0, worst = 0;
  for (size_t i = 0; i < cpu.size(); ++i) scale = std::max(scale, std::fabs(double(cpu[i])));
  for (size_t i = 0; i < cpu.size(); ++i) {
    worst = std::max(worst, std::fabs(double(gpu[i]) - cpu[i]));
  }
  if (worst <= 0.03 * scale) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "largest difference " << worst << " of scale " << scale;
}

// The mean time of one `launch()` over `iters` back-to-back launches after a
// warm-up, in microseconds.
template <typename Launch>
Result<double> MeanLaunchMicros(Launch&& launch, int iters) {
  cudaEvent_t raw_start = nullptr, raw_stop = nullptr;
  KDN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&raw_start));
  CudaEvent start(raw_start);
  KDN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&raw_stop));
  CudaEvent stop(raw_stop);
  KDN_RETURN_IF_ERROR(launch());
  KDN_CUDA_RETURN_IF_ERROR(cudaEventRecord(start.get(), nullptr));
  for (int i = 0; i < iters; ++i) KDN_RETURN_IF_ERROR(launch());
  KDN_CUDA_RETURN_IF_ERROR(cudaEventRecord(stop.get(), nullptr));
  KDN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop.get()));
  float ms = 0.0f;
  KDN_CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start.get(), stop.get()));
  return 1000.0 * ms / iters;
}

// n token ids below 256 (every preset's vocabulary), from `seed`.
inline std::vector<int32_t> Tokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % 256);
  return t;
}

// n new, empty sequences of `engine`'s cache.
inline std::vector<KvSequence> NewSequences(Engine& engine, int n) {
  std::vector<KvSequence> seqs;
  for (int i = 0; i < n; ++i) seqs.push_back(engine.kv_cache().NewSequence());
  return seqs;
}

// One layer's KV of positions [first, first + count), as floats: count rows
// of K, then count rows of V.
inline Status ReadKv(Engine& engine, const KvSequence& seq, int layer, int64_t first, int64_t count,
                     std::vector<float>* out) {
  out->resize(engine.kv_cache().LayerBytes(count, DType::kF32) / sizeof(float));
  return engine.kv_cache().Read(seq, layer, first, count, DType::kF32,
                                {reinterpret_cast<uint8_t*>(out->data()), out->size() * 4});
}

}  // namespace kdn::engine::cuda::cudatest
