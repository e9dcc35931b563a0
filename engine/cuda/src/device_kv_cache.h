#pragma once
// Private to kdn_engine_cuda: device and pinned buffers, and the device KV
// cache (DeviceKvCache, device_kv_cache.cpp) with the device checks that
// size it. cuda_engine_impl.h builds the engine on them.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "kdn/common/cuda_status.h"
#include "kdn/engine/cuda/cuda_engine.h"
#include "kdn/engine/cuda/paged_kv.cuh"
#include "kdn/engine/kv_cache.h"

namespace kdn::engine::cuda {

namespace internal {

using bf16 = __nv_bfloat16;

// Makes `device` current on the calling thread. A worker calls into its engine
// and its KvCache from threads other than the one that opened it (the compute
// thread, store I/O and lookup threads, blend's loader), whose current device
// is 0 until set: so every entry point that touches the device calls this
// first, or `--device cuda:1` would allocate on device 0 and launch onto a
// stream of another device. Cheap: cudaSetDevice returns at once when the
// device is already current.
inline Status UseDevice(int device) {
  KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  return Status::Ok();
}

// A device allocation of n elements of T.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DeviceArray() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  Status Allocate(int64_t n) {
    void* p = nullptr;
    KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<int64_t>(1, n) * sizeof(T)));
    if (p_ != nullptr) (void)cudaFree(p_);
    p_ = static_cast<T*>(p);
    n_ = n;
    return Status::Ok();
  }
  T* get() const { return p_; }
  int64_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  int64_t n_ = 0;
};

// A pinned host buffer of n elements of T.
template <typename T>
class PinnedArray {
 public:
  PinnedArray() = default;
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
  ~PinnedArray() {
    if (p_ != nullptr) (void)cudaFreeHost(p_);
  }
  Status Allocate(int64_t n) {
    KDN_CUDA_RETURN_IF_ERROR(
        cudaMallocHost(reinterpret_cast<void**>(&p_), std::max<int64_t>(1, n) * sizeof(T)));
    return Status::Ok();
  }
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
};

// The KV cache in device memory (bf16): the engine's pools, and reads and
// writes by layer on a stream of its own (KvCache's contract), guarded by
// mu_ so that the loader thread of a blend and the engine's thread may both
// use it. Each read, write and copy makes `device` current on its thread
// first (UseDevice), so any thread may make them.
class DeviceKvCache final : public KvCache {
 public:
  DeviceKvCache(int device, int num_layers, int num_kv_heads, int head_dim, int num_blocks)
      : KvCache(num_layers, num_kv_heads, head_dim, num_blocks), device_(device) {}
  ~DeviceKvCache() override;
  // The pools and the stream: one region, [layer][K, V][block][slot]
  // [kv_head][head_dim] of bf16, in `memory`'s bytes when given (of
  // StorageBytes, device memory of this device, the caller's), else
  // allocated here.
  Status Allocate(const std::function<Result<uint8_t*>(uint64_t bytes)>& memory = {});
  static uint64_t StorageBytes(int num_layers, int num_kv_heads, int head_dim, int num_blocks) {
    return uint64_t{2} * num_layers * num_blocks * kKvBlockTokens * num_kv_heads * head_dim *
           sizeof(__nv_bfloat16);
  }
  KvPoolMemory Memory() const override;
  PagedKvLayer<__nv_bfloat16> Layer(int l) { return {k_[l], v_[l], num_kv_heads(), head_dim()}; }
  PagedKvLayer<const __nv_bfloat16> ConstLayer(int l) {
    return {k_[l], v_[l], num_kv_heads(), head_dim()};
  }
  // Rotates the K of positions [first, first + count) at `layer` by `delta`
  // positions (RotateCachedKeys), on this cache's stream; waits for it.
  Status RotateKeys(std::span<const int32_t> blocks, int layer, int64_t first, int64_t count,
                    int64_t delta, const float* inv_freq);

 protected:
  // Every layer asked for in one staging buffer: one host copy each way
  // (straight from or into the caller's buffer for bf16, which is a DMA
  // when that memory is pinned) and one wait.
  Status ReadRows(std::span<const int32_t> blocks, int layer0, int layers, int64_t first,
                  int64_t count, DType dtype, uint8_t* out) const override;
  Status WriteRows(std::span<const int32_t> blocks, int layer0, int layers, int64_t first,
                   int64_t count, DType dtype, const uint8_t* in) override;
  // Device to device, every layer's K and V, on this cache's stream; waits.
  Status CopyBlock(int32_t from, int32_t to) override;
  uint64_t BlockOffset(int layer, bool value, int32_t block) const override;

 private:
  // Gathers (or scatters) layers [layer0, layer0 + layers) of the rows
  // between the pools and rows_ (layer after layer, K rows then V rows);
  // the block table from the first position's block on goes up first.
  Status Stage(std::span<const int32_t> blocks, int layer0, int layers, int64_t first,
               int64_t count, bool gather) const;

  const int device_;
  DeviceArray<__nv_bfloat16> own_;     // the region, when allocated here
  __nv_bfloat16* pool_ = nullptr;      // the region
  std::vector<__nv_bfloat16*> k_, v_;  // [layer] -> its pool in the region; constant after Allocate
  cudaStream_t stream_ = nullptr;
  mutable std::mutex mu_;
  // Guarded by mu_: staging on the device and the host.
  mutable DeviceArray<__nv_bfloat16> rows_;
  mutable DeviceArray<int32_t> table_, positions_;
  mutable std::vector<uint16_t> host_;
};

// FAILED_PRECONDITION, saying what the machine has, when options.device
// does not exist or has too little free memory for the engine.
Status CheckDevice(const model::ModelConfig& config, const CudaEngineOptions& options);

}  // namespace internal

}  // namespace kdn::engine::cuda
