#pragma once
// KV deviation on the GPU: the squared L2 distance between rows of two
// buffers, which CacheBlend's check layer takes between the KV a segment's
// cache held and the KV recomputed for it (engine.h: RowPass::RunLayer).
//
// Host-only header: it declares the launcher and can be included from .cpp
// files compiled by the host compiler.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kdn/common/status.h"

namespace kdn::engine::cuda {

// out[r] = sum_i (b[r][i] - a[r][i])^2 over `rows` rows of `dim` contiguous
// elements, accumulated in fp32. T is float or __nv_bfloat16. Enqueues one
// kernel on `stream`. INVALID_ARGUMENT for dim <= 0, rows < 0 or a null
// pointer with rows > 0.
template <typename T>
Status RowSquaredDistanceCuda(const T* a, const T* b, int64_t rows, int64_t dim, float* out,
                              cudaStream_t stream);

}  // namespace kdn::engine::cuda
