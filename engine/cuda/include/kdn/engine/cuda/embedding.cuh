#pragma once
// The embedding lookup on the GPU.
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

// out[r][:] = table[ids[r]][:] for `rows` ids (device memory), table
// [vocab][dim]. Ids outside [0, vocab) give a row of zeros and set *bad_id
// (device memory, may be null) to 1, so that a caller that validated nothing
// on the host still finds out.
template <typename T>
Status EmbedCuda(const T* table, int64_t vocab, int dim, const int32_t* ids, int64_t rows, T* out,
                 int32_t* bad_id, cudaStream_t stream);

}  // namespace kdn::engine::cuda
