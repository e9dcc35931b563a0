#pragma once
// CUDA runtime return codes as kdn::Status, and the device probe: the one
// mapping of the project. Every CUDA runtime call of the engine's kernels
// and of kvbus's device planes goes through KDN_CUDA_RETURN_IF_ERROR (or
// CudaStatus where the caller wants the Status itself), so that a missing
// driver, an out-of-memory or a bad launch reaches the caller as a Status
// that names the call, the file:line and the runtime's own words.
// Thread-safe: nothing here keeps state.

#include <cuda_runtime_api.h>

#include "kdn/common/status.h"

namespace kdn {

// The Status for a failed CUDA runtime call; `expr` is the call's source
// text, `file` and `line` where it was made. `err` must not be cudaSuccess.
// The code says what the caller can do about it: UNAVAILABLE when there is
// no usable driver or device, RESOURCE_EXHAUSTED when device memory ran
// out, INVALID_ARGUMENT for a call with bad arguments (a bad pointer,
// device or IPC handle), INTERNAL for the rest. The message names `expr`,
// file:line and the runtime's own words.
Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line);

// The number of CUDA devices this process can use: 0 when the driver reports
// none, UNAVAILABLE (with the runtime's reason) when there is no usable
// driver at all. Never aborts. (Without a usable driver, the runtime's
// initialization error is sticky: later CUDA calls keep failing with it.)
Result<int> CudaDeviceCount();

// The same as a plain count: 0 without a driver or a device. Never fails;
// the runtime's last error is cleared, so the caller's next call does not
// see it.
int CudaDevices();

// True when at least one CUDA device can be used. False on a machine without
// a driver or a device (what tests check before they run a kernel).
bool CudaDeviceAvailable();

}  // namespace kdn

// Evaluates `expr`, a cudaError_t; if it is not cudaSuccess, returns from the
// enclosing function (which returns kdn::Status or kdn::Result<T>) the Status
// of CudaStatus for it, e.g.
//   KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, n, kind, stream));
#define KDN_CUDA_RETURN_IF_ERROR(expr)                                    \
  do {                                                                    \
    const cudaError_t _kdn_cuda_err = (expr);                             \
    if (_kdn_cuda_err != cudaSuccess) {                                   \
      return ::kdn::CudaStatus(_kdn_cuda_err, #expr, __FILE__, __LINE__); \
    }                                                                     \
  } while (0)
