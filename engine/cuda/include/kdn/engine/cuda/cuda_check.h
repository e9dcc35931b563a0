#pragma once
// CUDA runtime return codes as kdn::Status, and a device probe that never
// fails hard.
//
// Every CUDA runtime call of the project goes through KDN_CUDA_RETURN_IF_ERROR
// (or CudaErrorToStatus where the caller wants the Status itself), so that a
// missing driver, an out-of-memory or a bad launch reaches the caller as a
// Status that names the call, the file:line and the runtime's own words.
// Thread-safe: nothing here keeps state.

#include <cuda_runtime_api.h>

#include "kdn/common/status.h"

namespace kdn::engine::cuda {

// The Status for a failed CUDA runtime call; `expr` is the call's source
// text, `file` and `line` where it was made. `err` must not be cudaSuccess.
// The code says what the caller can do about it: UNAVAILABLE when there is no
// usable driver or device, RESOURCE_EXHAUSTED when device memory ran out,
// INVALID_ARGUMENT for a call with bad arguments, INTERNAL for the rest.
Status CudaErrorToStatus(cudaError_t err, const char* expr, const char* file, int line);

// The number of CUDA devices this process can use: 0 when the driver reports
// none, UNAVAILABLE (with the runtime's reason) when there is no usable driver
// at all. Never aborts. (Without a usable driver, the runtime's
// initialization error is sticky: later CUDA calls keep failing with it.)
Result<int> CudaDeviceCount();

// True when at least one CUDA device can be used. False on a machine without
// a driver or a device (what tests check before they run a kernel).
bool CudaDeviceAvailable();

}  // namespace kdn::engine::cuda

// Evaluates `expr`, a cudaError_t; if it is not cudaSuccess, returns from the
// enclosing function (which returns kdn::Status or kdn::Result<T>) the Status
// of CudaErrorToStatus for it, e.g.
//   KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, n, kind, stream));
#define KDN_CUDA_RETURN_IF_ERROR(expr)                                                         \
  do {                                                                                         \
    const cudaError_t _kdn_cuda_err = (expr);                                                  \
    if (_kdn_cuda_err != cudaSuccess) {                                                        \
      return ::kdn::engine::cuda::CudaErrorToStatus(_kdn_cuda_err, #expr, __FILE__, __LINE__); \
    }                                                                                          \
  } while (0)
