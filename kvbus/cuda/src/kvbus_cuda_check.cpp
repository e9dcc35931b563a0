#include "kdn/kvbus/cuda/kvbus_cuda_check.h"

#include "kdn/common/cuda_status.h"

namespace kdn::kvbus::cuda {

// The project's one mapping (kdn/common/cuda_status.h), under kvbus's names.
Status CudaStatus(cudaError_t err, const char* expr, const char* file, int line) {
  return ::kdn::CudaStatus(err, expr, file, line);
}

int DeviceCount() { return ::kdn::CudaDevices(); }

}  // namespace kdn::kvbus::cuda
