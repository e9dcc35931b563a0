#pragma once
// The attention biases of one engine call's sequences on the device, for
// the reference attention kernels (ScoreBiasCuda): CudaEngine's prefill and
// decode stage theirs in its Impl, a row pass its own for the pass.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "device_kv_cache.h"
#include "kdn/common/cuda_status.h"
#include "kdn/engine/cuda/attention.cuh"
#include "kdn/engine/engine.h"

namespace kdn::engine::cuda::internal {

// The attention biases of one call's sequences (engine::LayOutBias) on the
// device, for the reference kernels: a call with a bias runs them instead
// of FlashAttention, without a graph.
struct DeviceBias {
  DeviceArray<float> head_bias;
  DeviceArray<int64_t> spans;
  DeviceArray<int32_t> span_first;
  int64_t head_stride = 0;  // layers * heads
  bool any = false;

  // Lays out and uploads the biases of `seqs`; `any` says whether one has
  // a bias (nothing is uploaded otherwise).
  Status Stage(std::span<const KvSequence* const> seqs, int layers, int heads,
               cudaStream_t stream) {
    const BatchBias b = LayOutBias(seqs, layers, heads);
    any = b.any;
    if (!any) return Status::Ok();
    head_stride = int64_t{layers} * heads;
    KDN_RETURN_IF_ERROR(Upload(b.head_bias, &head_bias, stream));
    KDN_RETURN_IF_ERROR(Upload(b.spans, &spans, stream));
    return Upload(b.span_first, &span_first, stream);
  }
  // Layer l's view (ScoreBiasCuda); none when nothing is staged.
  ScoreBiasCuda Layer(int l, int heads) const {
    if (!any) return {};
    return {head_bias.get() + int64_t{l} * heads, head_stride, spans.get(), span_first.get()};
  }

 private:
  template <typename T>
  static Status Upload(const std::vector<T>& host, DeviceArray<T>* dst, cudaStream_t stream) {
    const auto n = static_cast<int64_t>(host.size());
    if (dst->size() < n) KDN_RETURN_IF_ERROR(dst->Allocate(n));
    if (n == 0) return Status::Ok();
    // From pageable memory: the copy has read the vector when it returns.
    KDN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst->get(), host.data(), n * sizeof(T), cudaMemcpyHostToDevice, stream));
    return Status::Ok();
  }
};

}  // namespace kdn::engine::cuda::internal
