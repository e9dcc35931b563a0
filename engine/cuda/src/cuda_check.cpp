#include "kdn/engine/cuda/cuda_check.h"

#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {

// The project's one mapping (kdn/common/cuda_status.h), under the engine's
// names.
Status CudaErrorToStatus(cudaError_t err, const char* expr, const char* file, int line) {
  return ::kdn::CudaStatus(err, expr, file, line);
}

Result<int> CudaDeviceCount() { return ::kdn::CudaDeviceCount(); }

bool CudaDeviceAvailable() {
  const Result<int> count = CudaDeviceCount();
  return count.ok() && *count > 0;
}

}  // namespace kdn::engine::cuda
