#include "kdn/engine/cuda/gemv.cuh"

#include <string>
#include <type_traits>

#include "element.cuh"
#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {
namespace {

constexpr int kWarps = 8;   // output rows per block, one per warp
constexpr int kUnroll = 4;  // 16-byte weight loads in flight per lane

__device__ __forceinline__ void Fma8(const uint4& w, const uint4& x, float& acc) {
  const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 a = __bfloat1622float2(wp[k]);
    const float2 b = __bfloat1622float2(xp[k]);
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
}

// acc[r] = the dot product of weight row wr with input row r, summed over
// the warp (every lane gets it): lanes walk the row 8 elements at a time,
// kUnroll loads ahead.
template <int kRows>
__device__ __forceinline__ void RowDot(const uint4* __restrict__ wr,
                                       const __nv_bfloat16* __restrict__ in, int in_dim, int lane,
                                       float (&acc)[kRows]) {
  const int vecs = in_dim / 8;
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
  int v = lane;
  for (; v + 32 * (kUnroll - 1) < vecs; v += 32 * kUnroll) {
    uint4 wv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) wv[u] = __ldcs(wr + v + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const uint4 xv =
            __ldg(reinterpret_cast<const uint4*>(in + int64_t{r} * in_dim) + v + 32 * u);
        Fma8(wv[u], xv, acc[r]);
      }
    }
  }
  for (; v < vecs; v += 32) {
    const uint4 wv = __ldcs(wr + v);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      Fma8(wv, __ldg(reinterpret_cast<const uint4*>(in + int64_t{r} * in_dim) + v), acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], off);
  }
}

// One warp per output row o.
template <int kRows, typename OutT>
__global__ void __launch_bounds__(kWarps * 32)
    GemvKernel(const __nv_bfloat16* __restrict__ in, int in_dim,
               const __nv_bfloat16* __restrict__ w, int out_dim, OutT* __restrict__ out,
               bool accumulate) {
  const int lane = threadIdx.x & 31;
  const int o = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (o >= out_dim) return;
  float acc[kRows];
  RowDot<kRows>(reinterpret_cast<const uint4*>(w + static_cast<int64_t>(o) * in_dim), in, in_dim,
                lane, acc);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      OutT* dst = out + static_cast<int64_t>(r) * out_dim + o;
      const float prev = accumulate ? ToFloat(*dst) : 0.0f;
      *dst = FromFloat<OutT>(prev + acc[r]);
    }
  }
}

// One warp per gate/up pair o: both products, each rounded to bf16 as the
// unfused product writes them, then SiluMulCuda's arithmetic.
template <int kRows>
__global__ void __launch_bounds__(kWarps * 32)
    GemvSwiGluKernel(const __nv_bfloat16* __restrict__ in, int in_dim,
                     const __nv_bfloat16* __restrict__ w, int inter,
                     __nv_bfloat16* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int o = blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (o >= inter) return;
  float gate[kRows], up[kRows];
  RowDot<kRows>(reinterpret_cast<const uint4*>(w + static_cast<int64_t>(o) * in_dim), in, in_dim,
                lane, gate);
  RowDot<kRows>(reinterpret_cast<const uint4*>(w + (static_cast<int64_t>(inter) + o) * in_dim), in,
                in_dim, lane, up);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float g = __bfloat162float(__float2bfloat16_rn(gate[r]));
      const float u = __bfloat162float(__float2bfloat16_rn(up[r]));
      out[static_cast<int64_t>(r) * inter + o] = __float2bfloat16_rn(g / (1.0f + expf(-g)) * u);
    }
  }
}

}  // namespace

bool GemvFits(const void* in, int rows, int in_dim, const void* w) {
  return rows >= 1 && rows <= kGemvMaxRows && in_dim > 0 && in_dim % 8 == 0 && IsAligned(in, 16) &&
         IsAligned(w, 16);
}

template <typename OutT>
Status GemvCuda(const __nv_bfloat16* in, int rows, int in_dim, const __nv_bfloat16* w, int out_dim,
                OutT* out, bool accumulate, cudaStream_t stream) {
  if (out_dim <= 0 || out == nullptr || in == nullptr || w == nullptr ||
      !GemvFits(in, rows, in_dim, w)) {
    return InvalidArgument(
        "GemvCuda: rows=" + std::to_string(rows) + " in_dim=" + std::to_string(in_dim) +
        " out_dim=" + std::to_string(out_dim) + " (rows 1.." + std::to_string(kGemvMaxRows) +
        ", in_dim a multiple of 8, 16-byte aligned operands)");
  }
  const unsigned blocks = static_cast<unsigned>((out_dim + kWarps - 1) / kWarps);
  switch (rows) {
    case 1:
      GemvKernel<1, OutT>
          <<<blocks, kWarps * 32, 0, stream>>>(in, in_dim, w, out_dim, out, accumulate);
      break;
    case 2:
      GemvKernel<2, OutT>
          <<<blocks, kWarps * 32, 0, stream>>>(in, in_dim, w, out_dim, out, accumulate);
      break;
    case 3:
      GemvKernel<3, OutT>
          <<<blocks, kWarps * 32, 0, stream>>>(in, in_dim, w, out_dim, out, accumulate);
      break;
    default:
      GemvKernel<4, OutT>
          <<<blocks, kWarps * 32, 0, stream>>>(in, in_dim, w, out_dim, out, accumulate);
      break;
  }
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status GemvSwiGluCuda(const __nv_bfloat16* in, int rows, int in_dim, const __nv_bfloat16* w,
                      int inter, __nv_bfloat16* out, cudaStream_t stream) {
  if (inter <= 0 || out == nullptr || in == nullptr || w == nullptr ||
      !GemvFits(in, rows, in_dim, w)) {
    return InvalidArgument("GemvSwiGluCuda: rows=" + std::to_string(rows) +
                           " in_dim=" + std::to_string(in_dim) + " inter=" + std::to_string(inter));
  }
  const unsigned blocks = static_cast<unsigned>((inter + kWarps - 1) / kWarps);
  switch (rows) {
    case 1:
      GemvSwiGluKernel<1><<<blocks, kWarps * 32, 0, stream>>>(in, in_dim, w, inter, out);
      break;
    case 2:
      GemvSwiGluKernel<2><<<blocks, kWarps * 32, 0, stream>>>(in, in_dim, w, inter, out);
      break;
    case 3:
      GemvSwiGluKernel<3><<<blocks, kWarps * 32, 0, stream>>>(in, in_dim, w, inter, out);
      break;
    default:
      GemvSwiGluKernel<4><<<blocks, kWarps * 32, 0, stream>>>(in, in_dim, w, inter, out);
      break;
  }
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template Status GemvCuda<float>(const __nv_bfloat16*, int, int, const __nv_bfloat16*, int, float*,
                                bool, cudaStream_t);
template Status GemvCuda<__nv_bfloat16>(const __nv_bfloat16*, int, int, const __nv_bfloat16*, int,
                                        __nv_bfloat16*, bool, cudaStream_t);

}  // namespace kdn::engine::cuda
