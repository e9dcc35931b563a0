#include "kdn/common/cuda_status.h"

#include <string>

namespace kdn {

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

Result<int> CudaDeviceCount() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorNoDevice) return 0;
  if (err != cudaSuccess) {
    return CudaStatus(err, "cudaGetDeviceCount(&count)", __FILE__, __LINE__);
  }
  return count;
}

int CudaDevices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky for the caller's next call
    return 0;
  }
  return count;
}

bool CudaDeviceAvailable() {
  const Result<int> count = CudaDeviceCount();
  return count.ok() && *count > 0;
}

}  // namespace kdn
