#include "kdn/engine/cuda/deviation.cuh"

#include "element.cuh"
#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row: a strided sum of squares, then a tree over the block.
template <typename T>
__global__ void RowSquaredDistanceKernel(const T* a, const T* b, int64_t dim, float* out) {
  const int64_t r = blockIdx.x;
  const T* ra = a + r * dim;
  const T* rb = b + r * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    const float d = ToFloat(rb[i]) - ToFloat(ra[i]);
    sum += d * d;
  }
  __shared__ float partial[kThreads];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[r] = partial[0];
}

}  // namespace

template <typename T>
Status RowSquaredDistanceCuda(const T* a, const T* b, int64_t rows, int64_t dim, float* out,
                              cudaStream_t stream) {
  if (dim <= 0 || rows < 0 || rows > kMaxGridX) {
    return InvalidArgument("RowSquaredDistanceCuda: bad shape");
  }
  if (rows == 0) return Status::Ok();
  if (a == nullptr || b == nullptr || out == nullptr) {
    return InvalidArgument("RowSquaredDistanceCuda: null pointer");
  }
  RowSquaredDistanceKernel<T><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(a, b, dim, out);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template Status RowSquaredDistanceCuda<float>(const float*, const float*, int64_t, int64_t, float*,
                                              cudaStream_t);
template Status RowSquaredDistanceCuda<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*,
                                                      int64_t, int64_t, float*, cudaStream_t);

}  // namespace kdn::engine::cuda
