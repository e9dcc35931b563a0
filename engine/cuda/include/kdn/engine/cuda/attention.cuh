#pragma once
// Attention over the paged KV cache on the GPU (the engine's AttendRows and
// decode attention): causal, grouped-query (query head h reads KV head
// h / (heads / kv_heads), as Hugging Face's repeat_kv), softmax in fp32 with
// running max and sum (flash-style: scores never reach global memory).
//
//   DecodeAttentionCuda  one query per sequence (a decode step of a batch),
//                        the keys split across blocks (flash-decoding) so that
//                        even batch 1 fills the GPU, then one combine pass.
//   PrefillAttentionCuda n queries of one sequence at positions q_start ..
//                        q_start + n - 1, tiled over queries and keys; query i
//                        attends to keys 0 .. q_start + i (within the shape's
//                        window, if it has one).
//
// This first version multiplies with CUDA cores in fp32 (no tensor cores);
// it is the correctness baseline the tensor-core version is tested against.
// head_dim may be any multiple of 8 up to 256; heads a multiple of kv_heads,
// at most 16 query heads per KV head.
//
// Host-only header. T is float or __nv_bfloat16: q, out and the cache are T.
// The new tokens' K and V must already be in the cache (WriteKvCuda).
// Launchers enqueue on `stream` and return without waiting; INVALID_ARGUMENT
// for a bad shape or a null pointer. Thread-safe.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kdn/common/status.h"
#include "kdn/engine/cuda/paged_kv.cuh"

namespace kdn::engine::cuda {

struct AttentionShape {
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 0;
  float scale = 0;  // usually 1 / sqrt(head_dim)
  // Sliding window: a query at position p sees keys p - window + 1 .. p
  // (transformers' mask). 0: every earlier key. The reference kernels below
  // honour it; FlashAttention does not (Supports() is false with one).
  int64_t window = 0;
};

// An additive bias on attention scores (KvSequence::AttentionBias, PASTA's
// emphasis) for the kernels below, in device memory: query head h of batch
// row b (decode; a prefill's one sequence is row 0) adds
// head_bias[b * head_stride + h] to its scaled score of each key whose
// slot lies in one of row b's spans, [spans[2i], spans[2i + 1]) for i in
// [span_first[b], span_first[b + 1]), before the softmax. head_bias null:
// none (the kernels' fast path).
struct ScoreBiasCuda {
  const float* head_bias = nullptr;
  int64_t head_stride = 0;
  const int64_t* spans = nullptr;
  const int32_t* span_first = nullptr;
};

// Bytes of `workspace` DecodeAttentionCuda needs for `batch` sequences split
// at most `max_splits` ways.
size_t DecodeAttentionWorkspaceBytes(int64_t batch, const AttentionShape& shape, int max_splits);

// q and out: [batch][heads][head_dim]. tables: [batch][table_stride] block
// ids; lengths: [batch] keys per sequence (the new token included, >= 1),
// all device memory. `max_length` bounds the lengths (it sizes the split).
// `workspace` (device, DecodeAttentionWorkspaceBytes) holds the partial
// results when a sequence is split (max_splits > 1).
template <typename T>
Status DecodeAttentionCuda(const T* q, PagedKvLayer<const T> cache, const int32_t* tables,
                           int64_t table_stride, const int32_t* lengths, int64_t batch,
                           int64_t max_length, const AttentionShape& shape, int max_splits,
                           float* workspace, T* out, cudaStream_t stream,
                           const ScoreBiasCuda& bias = {});

// q and out: [n][heads][head_dim], the queries of positions q_start ..
// q_start + n - 1 of the sequence whose block table is `table`.
template <typename T>
Status PrefillAttentionCuda(const T* q, int64_t n, int64_t q_start, PagedKvLayer<const T> cache,
                            const int32_t* table, const AttentionShape& shape, T* out,
                            cudaStream_t stream, const ScoreBiasCuda& bias = {});

}  // namespace kdn::engine::cuda
