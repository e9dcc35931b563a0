#pragma once
// Private to kdn_engine_cuda: float <-> element conversions, grid limits and
// small launch helpers shared by the kernels. Device code; .cu files only.

#include <cuda_bf16.h>

#include <cstdint>

namespace kdn::engine::cuda {

// The largest gridDim.x of every architecture the project builds for.
inline constexpr int64_t kMaxGridX = 2147483647;

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

inline int RoundUpToWarp(int n) { return (n + 31) / 32 * 32; }

// Threads per block and blocks of a grid-stride loop over n elements.
inline constexpr int kGridStrideThreads = 256;
inline unsigned GridStrideBlocks(int64_t n) {
  const int64_t blocks = (n + kGridStrideThreads - 1) / kGridStrideThreads;
  return static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8);
}

inline bool IsAligned(const void* p, uintptr_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

}  // namespace kdn::engine::cuda
