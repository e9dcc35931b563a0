#pragma once
// Products of a few activation rows with a weight matrix (a decode step of a
// small batch): the weights are streamed once, 16 bytes per load, which a
// general matrix product does not manage at so few rows. cuBLAS (the engine's
// Gemm) stays the reference and serves every other shape.
//
// Host-only header. The launcher enqueues one kernel on `stream` and returns
// without waiting; INVALID_ARGUMENT for a bad shape, a misaligned or null
// pointer. Thread-safe.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kdn/common/status.h"

namespace kdn::engine::cuda {

inline constexpr int kGemvMaxRows = 4;

// out[r][o] = (accumulate ? out[r][o] : 0) + sum_i in[r][i] * w[o][i] for r <
// rows (1 .. kGemvMaxRows) and o < out_dim: in is [rows][in_dim] and w
// [out_dim][in_dim], bf16, both 16-byte aligned with in_dim a multiple of 8;
// out is [rows][out_dim], OutT bf16 or float. Accumulated in fp32, rounded to
// OutT once.
template <typename OutT>
Status GemvCuda(const __nv_bfloat16* in, int rows, int in_dim, const __nv_bfloat16* w, int out_dim,
                OutT* out, bool accumulate, cudaStream_t stream);

// The gate/up product and SwiGLU's gate in one pass: w is the stacked
// [2 * inter][in_dim] gate and up weight, out [rows][inter] =
// silu(gate) * up, each product rounded to bf16 first, exactly as GemvCuda
// into [rows][2 * inter] followed by SiluMulCuda computes it. Operands as
// GemvCuda's.
Status GemvSwiGluCuda(const __nv_bfloat16* in, int rows, int in_dim, const __nv_bfloat16* w,
                      int inter, __nv_bfloat16* out, cudaStream_t stream);

// Whether GemvCuda and GemvSwiGluCuda take these operands.
bool GemvFits(const void* in, int rows, int in_dim, const void* w);

}  // namespace kdn::engine::cuda
