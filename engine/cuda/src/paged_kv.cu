#include "kdn/engine/cuda/paged_kv.cuh"

#include <algorithm>
#include <string>

#include "element.cuh"
#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t SlotOf(const int32_t* table, int64_t pos) {
  return static_cast<int64_t>(table[pos / kKvBlockTokensCuda]) * kKvBlockTokensCuda +
         pos % kKvBlockTokensCuda;
}

// One block per token; threads over the row. `to_cache`: src rows -> cache
// slots, else cache slots -> dst rows. K and V in one pass.
template <typename T, bool kToCache>
__global__ void MoveRowsKernel(const T* k_src, const T* v_src, int64_t src_stride, T* k_dst,
                               T* v_dst, int64_t dst_stride, const int32_t* table, int64_t first,
                               int row) {
  const int64_t r = blockIdx.x;
  const int64_t slot = SlotOf(table, first + r) * row;
  const int64_t src = kToCache ? r * src_stride : slot;
  const int64_t dst = kToCache ? slot : r * dst_stride;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    k_dst[dst + i] = k_src[src + i];
    v_dst[dst + i] = v_src[src + i];
  }
}

template <typename T>
__global__ void WriteSlotsKernel(const T* k_src, const T* v_src, int64_t src_stride, T* k_dst,
                                 T* v_dst, const int64_t* slots, int row) {
  const int64_t r = blockIdx.x;
  const int64_t dst = slots[r] * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    k_dst[dst + i] = k_src[r * src_stride + i];
    v_dst[dst + i] = v_src[r * src_stride + i];
  }
}

template <typename T>
__global__ void CopyBlocksKernel(T* k, T* v, const int32_t* pairs, int64_t block_elems) {
  const int64_t p = blockIdx.y;
  const int64_t src = static_cast<int64_t>(pairs[2 * p]) * block_elems;
  const int64_t dst = static_cast<int64_t>(pairs[2 * p + 1]) * block_elems;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < block_elems;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    k[dst + i] = k[src + i];
    v[dst + i] = v[src + i];
  }
}

template <typename T>
Status CheckLayer(const char* who, const PagedKvLayer<T>& layer, int64_t count) {
  if (layer.kv_heads <= 0 || layer.head_dim <= 0 || count < 0 || count > kMaxGridX) {
    return InvalidArgument(
        std::string(who) + ": bad shape kv_heads=" + std::to_string(layer.kv_heads) +
        " head_dim=" + std::to_string(layer.head_dim) + " count=" + std::to_string(count));
  }
  if (count > 0 && (layer.k == nullptr || layer.v == nullptr)) {
    return InvalidArgument(std::string(who) + ": null cache pointer");
  }
  return Status::Ok();
}

template <typename T>
int ThreadsFor(const PagedKvLayer<T>& layer) {
  return std::min(kThreads, RoundUpToWarp(layer.kv_heads * layer.head_dim));
}

}  // namespace

template <typename T>
Status WriteKvCuda(const T* k_src, const T* v_src, int64_t src_stride, int64_t count,
                   const int32_t* table, int64_t first, PagedKvLayer<T> layer,
                   cudaStream_t stream) {
  KDN_RETURN_IF_ERROR(CheckLayer("WriteKvCuda", layer, count));
  const int row = layer.kv_heads * layer.head_dim;
  if (src_stride < row || first < 0) return InvalidArgument("WriteKvCuda: bad stride or position");
  if (count == 0) return Status::Ok();
  if (k_src == nullptr || v_src == nullptr || table == nullptr) {
    return InvalidArgument("WriteKvCuda: null pointer");
  }
  MoveRowsKernel<T, true><<<static_cast<unsigned>(count), ThreadsFor(layer), 0, stream>>>(
      k_src, v_src, src_stride, layer.k, layer.v, 0, table, first, row);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status WriteKvSlotsCuda(const T* k_src, const T* v_src, int64_t src_stride, int64_t count,
                        const int64_t* slots, PagedKvLayer<T> layer, cudaStream_t stream) {
  KDN_RETURN_IF_ERROR(CheckLayer("WriteKvSlotsCuda", layer, count));
  const int row = layer.kv_heads * layer.head_dim;
  if (src_stride < row) return InvalidArgument("WriteKvSlotsCuda: bad stride");
  if (count == 0) return Status::Ok();
  if (k_src == nullptr || v_src == nullptr || slots == nullptr) {
    return InvalidArgument("WriteKvSlotsCuda: null pointer");
  }
  WriteSlotsKernel<T><<<static_cast<unsigned>(count), ThreadsFor(layer), 0, stream>>>(
      k_src, v_src, src_stride, layer.k, layer.v, slots, row);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status GatherKvCuda(PagedKvLayer<T> layer, const int32_t* table, int64_t first, int64_t count,
                    T* out, cudaStream_t stream) {
  KDN_RETURN_IF_ERROR(CheckLayer("GatherKvCuda", layer, count));
  if (first < 0) return InvalidArgument("GatherKvCuda: negative position");
  if (count == 0) return Status::Ok();
  if (out == nullptr || table == nullptr) return InvalidArgument("GatherKvCuda: null pointer");
  const int row = layer.kv_heads * layer.head_dim;
  MoveRowsKernel<T, false><<<static_cast<unsigned>(count), ThreadsFor(layer), 0, stream>>>(
      layer.k, layer.v, 0, out, out + count * row, row, table, first, row);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status ScatterKvCuda(const T* in, int64_t count, const int32_t* table, int64_t first,
                     PagedKvLayer<T> layer, cudaStream_t stream) {
  KDN_RETURN_IF_ERROR(CheckLayer("ScatterKvCuda", layer, count));
  if (first < 0) return InvalidArgument("ScatterKvCuda: negative position");
  if (count == 0) return Status::Ok();
  if (in == nullptr || table == nullptr) return InvalidArgument("ScatterKvCuda: null pointer");
  const int row = layer.kv_heads * layer.head_dim;
  MoveRowsKernel<T, true><<<static_cast<unsigned>(count), ThreadsFor(layer), 0, stream>>>(
      in, in + count * row, row, layer.k, layer.v, 0, table, first, row);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template <typename T>
Status CopyKvBlocksCuda(PagedKvLayer<T> layer, const int32_t* pairs, int64_t n_pairs,
                        cudaStream_t stream) {
  KDN_RETURN_IF_ERROR(CheckLayer("CopyKvBlocksCuda", layer, 1));
  if (n_pairs < 0 || n_pairs > 65535) {
    return InvalidArgument("CopyKvBlocksCuda: " + std::to_string(n_pairs) +
                           " block pairs (at most 65535 per launch)");
  }
  if (n_pairs == 0) return Status::Ok();
  if (pairs == nullptr) return InvalidArgument("CopyKvBlocksCuda: null pointer");
  const int64_t block_elems =
      static_cast<int64_t>(kKvBlockTokensCuda) * layer.kv_heads * layer.head_dim;
  const unsigned gx =
      static_cast<unsigned>(std::min<int64_t>((block_elems + kThreads - 1) / kThreads, 64));
  CopyBlocksKernel<T><<<dim3(gx, static_cast<unsigned>(n_pairs)), kThreads, 0, stream>>>(
      layer.k, layer.v, pairs, block_elems);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

#define KDN_PAGED_KV_INSTANTIATE(T)                                                             \
  template Status WriteKvCuda<T>(const T*, const T*, int64_t, int64_t, const int32_t*, int64_t, \
                                 PagedKvLayer<T>, cudaStream_t);                                \
  template Status WriteKvSlotsCuda<T>(const T*, const T*, int64_t, int64_t, const int64_t*,     \
                                      PagedKvLayer<T>, cudaStream_t);                           \
  template Status GatherKvCuda<T>(PagedKvLayer<T>, const int32_t*, int64_t, int64_t, T*,        \
                                  cudaStream_t);                                                \
  template Status ScatterKvCuda<T>(const T*, int64_t, const int32_t*, int64_t, PagedKvLayer<T>, \
                                   cudaStream_t);                                               \
  template Status CopyKvBlocksCuda<T>(PagedKvLayer<T>, const int32_t*, int64_t, cudaStream_t);
KDN_PAGED_KV_INSTANTIATE(float)
KDN_PAGED_KV_INSTANTIATE(__nv_bfloat16)
#undef KDN_PAGED_KV_INSTANTIATE

}  // namespace kdn::engine::cuda
