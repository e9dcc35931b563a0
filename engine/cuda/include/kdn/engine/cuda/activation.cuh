#pragma once
// SwiGLU's gate on the GPU (the CUDA twin of SiluMul, cpu_ops.h) and the
// projections' bias add.
//
// Host-only header: the launcher enqueues one kernel on `stream` and returns
// without waiting. T is float or __nv_bfloat16 (the only instantiations).
// INVALID_ARGUMENT for a bad shape or a null pointer where work is to be
// done, the launch's error if the kernel could not be launched, OK without
// enqueuing anything for empty work; errors of the kernel's execution show up
// at the stream's next synchronization. Thread-safe.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kdn/common/status.h"

namespace kdn::engine::cuda {

// out[r][i] = silu(gate_up[r][i]) * gate_up[r][inter + i] for `rows` rows:
// gate_up is [rows][2 * inter] (the fused gate/up projection), out
// [rows][inter]. Computed in fp32, rounded to T once.
template <typename T>
Status SiluMulCuda(const T* gate_up, int64_t rows, int inter, T* out, cudaStream_t stream);

// x[r][i] += bias[i] for `rows` rows of `dim` elements (projection biases).
template <typename T>
Status AddBiasCuda(T* x, const T* bias, int64_t rows, int dim, cudaStream_t stream);

}  // namespace kdn::engine::cuda
