#pragma once
// CUDA runtime and NCCL return codes as kdn::Status for the kvbus device
// planes, and the device probe their callers use.
//
// kdn_kvbus_cuda does not link the engine: the transport links this library
// alone. Both report CUDA errors through the project's one mapping,
// kdn/common/cuda_status.h. Every CUDA call here goes through KDN_KVBUS_CUDA_RETURN_IF_ERROR
// and every NCCL call through KDN_NCCL_RETURN_IF_ERROR (nccl_link.cpp).
// Thread-safe: nothing here keeps state.

#include <cuda_runtime_api.h>

#include "kdn/common/status.h"

namespace kdn::kvbus::cuda {

// The Status of a failed CUDA runtime call (`err` is not cudaSuccess):
// UNAVAILABLE when there is no usable driver or device, RESOURCE_EXHAUSTED
// when memory ran out, INVALID_ARGUMENT for bad arguments (a bad pointer or
// IPC handle), INTERNAL for the rest. The message names `expr`, file:line and
// the runtime's words.
Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line);

// The number of devices this process can use: 0 without a driver or a
// device. Never fails, never aborts.
int DeviceCount();

}  // namespace kdn::kvbus::cuda

#define KDN_KVBUS_CUDA_RETURN_IF_ERROR(expr)                                         \
  do {                                                                               \
    const cudaError_t _kdn_kc_err = (expr);                                          \
    if (_kdn_kc_err != cudaSuccess) {                                                \
      return ::kdn::kvbus::cuda::CudaStatus(_kdn_kc_err, #expr, __FILE__, __LINE__); \
    }                                                                                \
  } while (0)
