#include "kdn/engine/cuda/rope.cuh"

#include <algorithm>
#include <climits>
#include <string>

#include "element.cuh"
#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHeadDim = 8192;  // cos + sin of a row: 32 KiB of shared memory

// The block's row's cosines (cs) and sines (sn) of its `half` angles, into
// shared memory; every thread of the block calls it. The angle is the same
// correctly rounded double product the CPU reference forms (exact for
// positions below 2^29), and double sincos (2 ulp) rounded to float agrees
// with its std::cos/std::sin to within one float ulp.
__device__ __forceinline__ void RowCosSin(int32_t position, const float* __restrict__ inv_freq,
                                          int half, const RopeParams& rope, float* cs, float* sn) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  for (int i = tid; i < half; i += blockDim.x * blockDim.y) {
    double s, c;
    sincos(RopeAngle(rope, inv_freq, i, position), &s, &c);
    cs[i] = static_cast<float>(c) * rope.attention_scaling;
    sn[i] = static_cast<float>(s) * rope.attention_scaling;
  }
  __syncthreads();
}

// One block per row. threadIdx.x walks the frequencies i < head_dim/2 and
// threadIdx.y the heads, so each thread reuses its cos/sin across heads.
template <typename T>
__global__ void RopeKernel(T* __restrict__ x, int heads, int head_dim,
                           const int32_t* __restrict__ positions,
                           const float* __restrict__ inv_freq, RopeParams rope) {
  extern __shared__ float cos_sin[];  // [half] cosines, then [half] sines
  const int half = head_dim / 2;
  float* cs = cos_sin;
  float* sn = cos_sin + half;
  const int64_t row = blockIdx.x;
  RowCosSin(positions[row], inv_freq, half, rope, cs, sn);

  T* xr = x + row * heads * static_cast<int64_t>(head_dim);
  for (int h = threadIdx.y; h < heads; h += blockDim.y) {
    T* v = xr + static_cast<int64_t>(h) * head_dim;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
      const float a = ToFloat(v[i]);
      const float b = ToFloat(v[i + half]);
      v[i] = FromFloat<T>(a * cs[i] - b * sn[i]);
      v[i + half] = FromFloat<T>(b * cs[i] + a * sn[i]);
    }
  }
}

// One block per row, as RopeKernel: the cosines and sines of the row once in
// shared memory, then threadIdx.y walks the heads (query, key, value) and
// threadIdx.x the frequencies.
template <typename T>
__global__ void RopeQkvKernel(T* __restrict__ qkv, int heads, int kv_heads, int head_dim,
                              const int32_t* __restrict__ positions,
                              const float* __restrict__ inv_freq, const int64_t* __restrict__ slots,
                              T* __restrict__ k_cache, T* __restrict__ v_cache, RopeParams rope) {
  extern __shared__ float cos_sin[];
  const int half = head_dim / 2;
  float* cs = cos_sin;
  float* sn = cos_sin + half;
  const int64_t row = blockIdx.x;
  RowCosSin(positions[row], inv_freq, half, rope, cs, sn);

  const int64_t kv_row = static_cast<int64_t>(kv_heads) * head_dim;
  T* xr = qkv + row * (heads + 2 * static_cast<int64_t>(kv_heads)) * head_dim;
  const int64_t slot = slots[row];
  T* kc = k_cache + slot * kv_row;
  T* vc = v_cache + slot * kv_row;
  for (int h = threadIdx.y; h < heads + 2 * kv_heads; h += blockDim.y) {
    T* v = xr + static_cast<int64_t>(h) * head_dim;
    if (h < heads + kv_heads) {
      // A query head rotates in place; a key head goes rotated to the cache.
      T* dst = h < heads ? v : kc + static_cast<int64_t>(h - heads) * head_dim;
      for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float a = ToFloat(v[i]);
        const float b = ToFloat(v[i + half]);
        dst[i] = FromFloat<T>(a * cs[i] - b * sn[i]);
        dst[i + half] = FromFloat<T>(b * cs[i] + a * sn[i]);
      }
    } else {
      T* dst = vc + static_cast<int64_t>(h - heads - kv_heads) * head_dim;
      for (int i = threadIdx.x; i < head_dim; i += blockDim.x) dst[i] = v[i];
    }
  }
}

}  // namespace

template <typename T>
Status RopeQkvToCacheCuda(T* qkv, int64_t rows, int heads, int kv_heads, int head_dim,
                          const int32_t* positions, const float* inv_freq, const int64_t* slots,
                          PagedKvLayer<T> layer, cudaStream_t stream, const RopeParams& rope) {
  const int64_t all_heads = static_cast<int64_t>(heads) + 2 * static_cast<int64_t>(kv_heads);
  if (rows < 0 || rows > kMaxGridX || heads <= 0 || kv_heads <= 0 || head_dim <= 0 ||
      head_dim % 2 != 0 || head_dim > kMaxHeadDim || all_heads * head_dim > INT_MAX ||
      layer.kv_heads != kv_heads || layer.head_dim != head_dim) {
    return InvalidArgument("RopeQkvToCacheCuda: bad shape rows=" + std::to_string(rows) +
                           " heads=" + std::to_string(heads) + " kv_heads=" +
                           std::to_string(kv_heads) + " head_dim=" + std::to_string(head_dim));
  }
  if (rows == 0) return Status::Ok();
  if (qkv == nullptr || positions == nullptr || inv_freq == nullptr || slots == nullptr ||
      layer.k == nullptr || layer.v == nullptr) {
    return InvalidArgument("RopeQkvToCacheCuda: null device pointer");
  }
  const int half = head_dim / 2;
  const int tx = std::min(kThreads, RoundUpToWarp(half));
  const int ty =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(all_heads, kThreads / tx)));
  const size_t shared_bytes = sizeof(float) * head_dim;
  RopeQkvKernel<T><<<static_cast<unsigned>(rows), dim3(tx, ty), shared_bytes, stream>>>(
      qkv, heads, kv_heads, head_dim, positions, inv_freq, slots, layer.k, layer.v, rope);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status ApplyRopeCuda(T* x, int64_t rows, int heads, int head_dim, const int32_t* positions,
                     const float* inv_freq, cudaStream_t stream, const RopeParams& rope) {
  if (rows < 0 || rows > kMaxGridX || heads <= 0 || head_dim <= 0 || head_dim % 2 != 0 ||
      head_dim > kMaxHeadDim || static_cast<int64_t>(heads) * head_dim > INT_MAX) {
    return InvalidArgument("ApplyRopeCuda: bad shape rows=" + std::to_string(rows) + " heads=" +
                           std::to_string(heads) + " head_dim=" + std::to_string(head_dim));
  }
  if (rows == 0) return Status::Ok();
  if (x == nullptr || positions == nullptr || inv_freq == nullptr) {
    return InvalidArgument("ApplyRopeCuda: null device pointer");
  }
  const int half = head_dim / 2;
  const int tx = std::min(kThreads, RoundUpToWarp(half));
  const int ty = std::max(1, std::min(heads, kThreads / tx));
  const size_t shared_bytes = sizeof(float) * head_dim;
  RopeKernel<T><<<static_cast<unsigned>(rows), dim3(tx, ty), shared_bytes, stream>>>(
      x, heads, head_dim, positions, inv_freq, rope);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template Status ApplyRopeCuda<float>(float*, int64_t, int, int, const int32_t*, const float*,
                                     cudaStream_t, const RopeParams&);
template Status ApplyRopeCuda<__nv_bfloat16>(__nv_bfloat16*, int64_t, int, int, const int32_t*,
                                             const float*, cudaStream_t, const RopeParams&);

template Status RopeQkvToCacheCuda<float>(float*, int64_t, int, int, int, const int32_t*,
                                          const float*, const int64_t*, PagedKvLayer<float>,
                                          cudaStream_t, const RopeParams&);
template Status RopeQkvToCacheCuda<__nv_bfloat16>(__nv_bfloat16*, int64_t, int, int, int,
                                                  const int32_t*, const float*, const int64_t*,
                                                  PagedKvLayer<__nv_bfloat16>, cudaStream_t,
                                                  const RopeParams&);

}  // namespace kdn::engine::cuda
