#include "kdn/engine/cuda/embedding.cuh"

#include <algorithm>
#include <string>

#include "element.cuh"
#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {
namespace {

template <typename T>
__global__ void EmbedKernel(const T* __restrict__ table, int64_t vocab, int dim,
                            const int32_t* __restrict__ ids, T* __restrict__ out, int32_t* bad_id) {
  const int64_t r = blockIdx.x;
  const int32_t id = ids[r];
  const bool ok = id >= 0 && id < vocab;
  if (!ok && threadIdx.x == 0 && bad_id != nullptr) *bad_id = 1;
  const T* src = table + static_cast<int64_t>(ok ? id : 0) * dim;
  T* dst = out + r * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = ok ? src[i] : FromFloat<T>(0.0f);
}

}  // namespace

template <typename T>
Status EmbedCuda(const T* table, int64_t vocab, int dim, const int32_t* ids, int64_t rows, T* out,
                 int32_t* bad_id, cudaStream_t stream) {
  if (vocab <= 0 || dim <= 0 || rows < 0 || rows > kMaxGridX) {
    return InvalidArgument("EmbedCuda: bad shape vocab=" + std::to_string(vocab) +
                           " dim=" + std::to_string(dim) + " rows=" + std::to_string(rows));
  }
  if (rows == 0) return Status::Ok();
  if (table == nullptr || ids == nullptr || out == nullptr) {
    return InvalidArgument("EmbedCuda: null pointer");
  }
  const int threads = std::min(1024, RoundUpToWarp(dim));
  EmbedKernel<T>
      <<<static_cast<unsigned>(rows), threads, 0, stream>>>(table, vocab, dim, ids, out, bad_id);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template Status EmbedCuda<float>(const float*, int64_t, int, const int32_t*, int64_t, float*,
                                 int32_t*, cudaStream_t);
template Status EmbedCuda<__nv_bfloat16>(const __nv_bfloat16*, int64_t, int, const int32_t*,
                                         int64_t, __nv_bfloat16*, int32_t*, cudaStream_t);

}  // namespace kdn::engine::cuda
