#pragma once
// CUDA runtime return codes as kdn::Status, and the device probe: the one
// mapping of the project. The engine's kernels (kdn/engine/cuda/cuda_check.h,
// KDN_CUDA_RETURN_IF_ERROR) and kvbus's device planes
// (kdn/kvbus/cuda/kvbus_cuda_check.h, KDN_KVBUS_CUDA_RETURN_IF_ERROR) report
// through it. Thread-safe: nothing here keeps state.

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

}  // namespace kdn
