#include "kdn/kvbus/cuda/kvbus_cuda_check.h"

#include <string>

namespace kdn::kvbus::cuda {

Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line) {
  std::string msg = std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " +
                    cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")";
  switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorNoKernelImageForDevice: return Unavailable(std::move(msg));
    case cudaErrorMemoryAllocation: return ResourceExhausted(std::move(msg));
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle: return InvalidArgument(std::move(msg));
    default: return Internal(std::move(msg));
  }
}

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky for the caller's next call
    return 0;
  }
  return count;
}

}  // namespace kdn::kvbus::cuda
