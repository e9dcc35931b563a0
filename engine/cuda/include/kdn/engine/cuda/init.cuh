#pragma once
// Seeded weights made on the GPU, to materialise a generated preset (the
// llama3-8b shapes and up) directly in device memory without a 16 GB file.
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

// Fills n elements with values uniform in [-scale, scale] from a counter-based
// hash of (seed, stream_id, index): the same values on every device and for
// every launch configuration, without a host copy. Used to materialise
// generated presets (llama3-8b shapes and up) directly in device memory.
// Not the CPU generator's sequence: a model made this way is compared with
// itself, not with kdn-mkmodel's files.
template <typename T>
Status FillUniformCuda(T* out, int64_t n, uint64_t seed, uint64_t stream_id, float scale,
                       cudaStream_t stream);

// The value FillUniformCuda writes at `index`, computed on the host (for tests
// and for host-side copies of small tensors).
float UniformAt(uint64_t seed, uint64_t stream_id, uint64_t index, float scale);

}  // namespace kdn::engine::cuda
