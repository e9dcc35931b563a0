#pragma once
// Sampling on the GPU: greedy (engine::Argmax, sampler.h).
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

// out[r] = the index of the largest of logits[r][0..vocab), the first one on
// ties (as engine::Argmax), for `rows` rows of fp32 logits. NaNs are never
// chosen unless the whole row is NaN (then 0).
//
// With `workspace` (device, ArgmaxWorkspaceBytes(rows)), each row is split
// across kArgmaxSplits blocks and a second kernel combines their winners: a
// wide vocabulary no longer rests on one SM (a decode step's argmax).
// Without it, one block per row.
Status ArgmaxCuda(const float* logits, int64_t rows, int64_t vocab, int32_t* out,
                  cudaStream_t stream, void* workspace = nullptr);

inline constexpr int kArgmaxSplits = 32;
size_t ArgmaxWorkspaceBytes(int64_t rows);

}  // namespace kdn::engine::cuda
