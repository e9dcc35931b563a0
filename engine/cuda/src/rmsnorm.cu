#include "kdn/engine/cuda/rmsnorm.cuh"

#include <algorithm>
#include <string>

#include "element.cuh"
#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {
namespace {

constexpr int kMaxThreads = 1024;

// kPack consecutive elements moved as one load or store (16 bytes when the
// row and pointers allow it, one element otherwise).
template <typename T, int kPack>
struct alignas(sizeof(T) * kPack) Pack {
  T v[kPack];
};

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of `v` over the block, valid in thread 0 only. blockDim.x must be a
// multiple of 32 and every thread must call it.
__device__ __forceinline__ float BlockSumToThreadZero(float v) {
  __shared__ float warp_sums[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = WarpSum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0.0f;
    v = WarpSum(v);
  }
  return v;
}

// One block per row. x and out are not __restrict__: out may alias x, which
// is safe because each element is read and then written by the same thread.
template <typename T, int kPack>
__global__ void RmsNormKernel(const T* x, const T* weight, float eps, int dim, T* out) {
  using P = Pack<T, kPack>;
  const int64_t row = blockIdx.x;
  const P* xr = reinterpret_cast<const P*>(x + row * dim);
  const P* w = reinterpret_cast<const P*>(weight);
  P* o = reinterpret_cast<P*>(out + row * dim);
  const int packs = dim / kPack;

  float ss = 0.0f;
  for (int p = threadIdx.x; p < packs; p += blockDim.x) {
    const P v = xr[p];
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      const float f = ToFloat(v.v[k]);
      ss = fmaf(f, f, ss);
    }
  }
  ss = BlockSumToThreadZero(ss);

  __shared__ float inv_rms;
  if (threadIdx.x == 0) {
    // Once per row, so double costs nothing and matches the reference's
    // 1 / sqrt(double(ss) / dim + eps).
    inv_rms = static_cast<float>(rsqrt(static_cast<double>(ss) / dim + eps));
  }
  __syncthreads();
  const float inv = inv_rms;

  for (int p = threadIdx.x; p < packs; p += blockDim.x) {
    const P v = xr[p];
    const P wv = w[p];
    P r;
#pragma unroll
    for (int k = 0; k < kPack; ++k) {
      r.v[k] = FromFloat<T>(ToFloat(wv.v[k]) * (ToFloat(v.v[k]) * inv));
    }
    o[p] = r;
  }
}

template <typename T, int kPack>
void Launch(const T* x, const T* weight, float eps, int64_t rows, int dim, T* out,
            cudaStream_t stream) {
  const int threads = std::min(kMaxThreads, RoundUpToWarp(dim / kPack));
  RmsNormKernel<T, kPack>
      <<<static_cast<unsigned>(rows), threads, 0, stream>>>(x, weight, eps, dim, out);
}

}  // namespace

template <typename T>
Status RmsNormCuda(const T* x, const T* weight, float eps, int64_t rows, int dim, T* out,
                   cudaStream_t stream) {
  if (dim <= 0 || rows < 0 || rows > kMaxGridX) {
    return InvalidArgument("RmsNormCuda: bad shape rows=" + std::to_string(rows) +
                           " dim=" + std::to_string(dim));
  }
  if (rows == 0) return Status::Ok();
  if (x == nullptr || weight == nullptr || out == nullptr) {
    return InvalidArgument("RmsNormCuda: null device pointer");
  }
  constexpr int kVec = 16 / sizeof(T);
  if (dim % kVec == 0 && IsAligned(x, 16) && IsAligned(weight, 16) && IsAligned(out, 16)) {
    Launch<T, kVec>(x, weight, eps, rows, dim, out, stream);
  } else {
    Launch<T, 1>(x, weight, eps, rows, dim, out, stream);
  }
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template Status RmsNormCuda<float>(const float*, const float*, float, int64_t, int, float*,
                                   cudaStream_t);
template Status RmsNormCuda<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, float,
                                           int64_t, int, __nv_bfloat16*, cudaStream_t);

}  // namespace kdn::engine::cuda
