#include "kdn/engine/cuda/activation.cuh"

#include <algorithm>
#include <string>
#include <type_traits>

#include "element.cuh"
#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {
namespace {

template <typename T>
__global__ void SiluMulKernel(const T* __restrict__ gate_up, int64_t rows, int inter,
                              T* __restrict__ out) {
  const int64_t total = rows * inter;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / inter;
    const int64_t c = i - r * inter;
    const float g = ToFloat(gate_up[r * 2 * inter + c]);
    const float u = ToFloat(gate_up[r * 2 * inter + inter + c]);
    out[i] = FromFloat<T>(g / (1.0f + expf(-g)) * u);
  }
}

// The same arithmetic for bf16 rows whose width is a multiple of 8, eight
// elements per thread with 16-byte loads and stores: blockIdx.y is the row,
// so no thread divides by the width.
__global__ void SiluMulBf16x8Kernel(const __nv_bfloat16* __restrict__ gate_up, int inter,
                                    __nv_bfloat16* __restrict__ out) {
  const int64_t r = blockIdx.y;
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (c >= inter) return;
  const __nv_bfloat16* row = gate_up + r * 2 * inter;
  const uint4 gv = *reinterpret_cast<const uint4*>(row + c);
  const uint4 uv = *reinterpret_cast<const uint4*>(row + inter + c);
  const __nv_bfloat16* g = reinterpret_cast<const __nv_bfloat16*>(&gv);
  const __nv_bfloat16* u = reinterpret_cast<const __nv_bfloat16*>(&uv);
  uint4 ov;
  __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&ov);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float gf = __bfloat162float(g[k]);
    o[k] = __float2bfloat16_rn(gf / (1.0f + expf(-gf)) * __bfloat162float(u[k]));
  }
  *reinterpret_cast<uint4*>(out + r * inter + c) = ov;
}

template <typename T>
__global__ void AddBiasKernel(T* __restrict__ x, const T* __restrict__ bias, int64_t total,
                              int dim) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = FromFloat<T>(ToFloat(x[i]) + ToFloat(bias[i % dim]));
  }
}

}  // namespace

template <typename T>
Status AddBiasCuda(T* x, const T* bias, int64_t rows, int dim, cudaStream_t stream) {
  if (rows < 0 || dim <= 0) return InvalidArgument("AddBiasCuda: bad shape");
  if (rows == 0) return Status::Ok();
  if (x == nullptr || bias == nullptr) return InvalidArgument("AddBiasCuda: null pointer");
  AddBiasKernel<T>
      <<<GridStrideBlocks(rows * dim), kGridStrideThreads, 0, stream>>>(x, bias, rows * dim, dim);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status SiluMulCuda(const T* gate_up, int64_t rows, int inter, T* out, cudaStream_t stream) {
  if (rows < 0 || inter <= 0) {
    return InvalidArgument("SiluMulCuda: bad shape rows=" + std::to_string(rows) +
                           " inter=" + std::to_string(inter));
  }
  if (rows == 0) return Status::Ok();
  if (gate_up == nullptr || out == nullptr) return InvalidArgument("SiluMulCuda: null pointer");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    if (inter % 8 == 0 && rows <= 65535 && IsAligned(gate_up, 16) && IsAligned(out, 16)) {
      const int vectors = inter / 8;
      const dim3 grid((vectors + kGridStrideThreads - 1) / kGridStrideThreads,
                      static_cast<unsigned>(rows));
      SiluMulBf16x8Kernel<<<grid, kGridStrideThreads, 0, stream>>>(gate_up, inter, out);
      KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
      return Status::Ok();
    }
  }
  SiluMulKernel<T><<<GridStrideBlocks(rows * inter), kGridStrideThreads, 0, stream>>>(gate_up, rows,
                                                                                      inter, out);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template Status AddBiasCuda<float>(float*, const float*, int64_t, int, cudaStream_t);
template Status AddBiasCuda<__nv_bfloat16>(__nv_bfloat16*, const __nv_bfloat16*, int64_t, int,
                                           cudaStream_t);
template Status SiluMulCuda<float>(const float*, int64_t, int, float*, cudaStream_t);
template Status SiluMulCuda<__nv_bfloat16>(const __nv_bfloat16*, int64_t, int, __nv_bfloat16*,
                                           cudaStream_t);

}  // namespace kdn::engine::cuda
