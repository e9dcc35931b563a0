#pragma once
// RMSNorm on the GPU: the CUDA twin of kdn::engine::RmsNorm (cpu_ops.h).
//
// Host-only header: it declares the launcher and can be included from .cpp
// files compiled by the host compiler.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kdn/common/status.h"

namespace kdn::engine::cuda {

// out[r][i] = weight[i] * (x[r][i] * inv_rms(r)), inv_rms(r) =
// 1 / sqrt(mean_i(x[r][i]^2) + eps), for `rows` rows of `dim` elements,
// row-major and contiguous. Enqueues one kernel on `stream` and returns
// without waiting for it.
//
// T is float or __nv_bfloat16 (the only instantiations; another T does not
// link). x, weight and out are device pointers; out may alias x exactly (in
// place) but must not otherwise overlap it. The sum of squares is accumulated
// in fp32 and the scale is computed in double, as the reference does; for
// bf16 the result is rounded to bf16 once, at the end (Hugging Face's Llama
// rounds x * inv_rms to bf16 before the weight multiply, one rounding more).
//
// Returns INVALID_ARGUMENT for dim <= 0, rows < 0, rows beyond the grid limit
// (2^31 - 1) or a null pointer with rows > 0, and the launch's error (see
// kdn/common/cuda_status.h) if the kernel could not be launched. Errors of the kernel's
// execution show up at the stream's next synchronization, as for any kernel.
// rows == 0 enqueues nothing and returns OK. Thread-safe.
template <typename T>
Status RmsNormCuda(const T* x, const T* weight, float eps, int64_t rows, int dim, T* out,
                   cudaStream_t stream);

extern template Status RmsNormCuda<float>(const float*, const float*, float, int64_t, int, float*,
                                          cudaStream_t);
extern template Status RmsNormCuda<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*, float,
                                                  int64_t, int, __nv_bfloat16*, cudaStream_t);

}  // namespace kdn::engine::cuda
