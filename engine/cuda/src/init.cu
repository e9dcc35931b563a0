#include "kdn/engine/cuda/init.cuh"

#include <algorithm>
#include <string>

#include "element.cuh"
#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {
namespace {

// SplitMix64 finalizer: a bijective 64-bit mix.
__host__ __device__ __forceinline__ uint64_t Mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__host__ __device__ __forceinline__ float Uniform(uint64_t seed, uint64_t stream_id, uint64_t index,
                                                  float scale) {
  const uint64_t h = Mix64(Mix64(seed ^ Mix64(stream_id + 0x9e3779b97f4a7c15ull)) + index);
  // 24 random bits -> [0, 1) exactly representable, then [-scale, scale).
  const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
  return (2.0f * u - 1.0f) * scale;
}

template <typename T>
__global__ void FillUniformKernel(T* __restrict__ out, int64_t n, uint64_t seed, uint64_t stream_id,
                                  float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = FromFloat<T>(Uniform(seed, stream_id, static_cast<uint64_t>(i), scale));
  }
}

}  // namespace

template <typename T>
Status FillUniformCuda(T* out, int64_t n, uint64_t seed, uint64_t stream_id, float scale,
                       cudaStream_t stream) {
  if (n < 0) return InvalidArgument("FillUniformCuda: negative size");
  if (n == 0) return Status::Ok();
  if (out == nullptr) return InvalidArgument("FillUniformCuda: null pointer");
  FillUniformKernel<T>
      <<<GridStrideBlocks(n), kGridStrideThreads, 0, stream>>>(out, n, seed, stream_id, scale);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

float UniformAt(uint64_t seed, uint64_t stream_id, uint64_t index, float scale) {
  return Uniform(seed, stream_id, index, scale);
}

template Status FillUniformCuda<float>(float*, int64_t, uint64_t, uint64_t, float, cudaStream_t);
template Status FillUniformCuda<__nv_bfloat16>(__nv_bfloat16*, int64_t, uint64_t, uint64_t, float,
                                               cudaStream_t);

}  // namespace kdn::engine::cuda
