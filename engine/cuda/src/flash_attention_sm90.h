#pragma once
// Private to kdn_engine_cuda: FlashInfer's Hopper (FA3-style, wgmma) batch
// prefill over the paged cache, compiled for sm_90a only in its own
// translation unit (flash_attention_sm90.cu). FlashAttention uses it for
// prefill plans on a compute-capability 9.0 device; decode plans stay on the
// FA2 kernels, which pack grouped query heads into one tile.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/cuda/attention.cuh"
#include "kdn/engine/cuda/paged_kv.cuh"

namespace kdn::engine::cuda::sm90 {

// Whether this build has the kernels for the shape and `device` runs them.
bool Available(const AttentionShape& shape, int device);

// The work split of a batch (FlashInfer's PrefillSM90Plan): qo_indptr and
// page_indptr (batch + 1 entries) and kv_lens (batch) are host arrays; the
// split goes to int_ws (device) through int_ws_host (pinned), enqueued on
// `stream`. *plan receives what Run needs. `causal`: query i of n sees keys
// 0 .. kv_len - n + i; otherwise every query sees all kv_len keys.
Status Plan(void* float_ws, size_t float_bytes, void* int_ws, void* int_ws_host, size_t int_bytes,
            int32_t* qo_indptr, int32_t* page_indptr, int32_t* kv_lens, int batch,
            const AttentionShape& shape, bool causal, cudaStream_t stream,
            std::vector<int64_t>* plan);

// Attention of the planned batch for one layer (with the plan's mask): q
// rows q_row_stride apart, out [rows][heads][head_dim], block ids of all
// sequences back to back in `indices` (device); `lse` (if not null) gets
// each row and head's base-2 log-sum-exp, [rows][heads].
Status Run(const std::vector<int64_t>& plan, void* int_ws, const __nv_bfloat16* q,
           int64_t q_row_stride, int64_t rows, PagedKvLayer<const __nv_bfloat16> cache,
           int32_t* indices, __nv_bfloat16* out, float* lse, const AttentionShape& shape,
           bool causal, cudaStream_t stream);

}  // namespace kdn::engine::cuda::sm90
