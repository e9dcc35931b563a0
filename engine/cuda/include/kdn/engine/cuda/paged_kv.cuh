#pragma once
// The paged KV cache on the GPU: writing new tokens' K and V into their
// blocks, the gather and scatter between a layer of paged KV and the
// contiguous layout of a KV chunk (docs/kvbus.md, "Payload"), and block
// copies. The device twin of engine::PagedKvCache's layout: one layer's K
// (and likewise V) is [num_blocks][kKvBlockTokens][kv_heads][head_dim];
// a sequence's block table lists its blocks in order, so position p lives in
// block table[p / kKvBlockTokens] at row p % kKvBlockTokens.
//
// Host-only header. T is float or __nv_bfloat16. Launchers enqueue one
// kernel on `stream` and return without waiting; INVALID_ARGUMENT for a bad
// shape or a null pointer where work is to be done; OK with nothing enqueued
// for empty work. Positions are not checked against the block table's
// length on the device: callers size the table for first + count tokens.
// Thread-safe.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kdn/common/status.h"

namespace kdn::engine::cuda {

inline constexpr int kKvBlockTokensCuda = 16;  // engine::kKvBlockTokens

// One layer of a paged cache in device memory.
template <typename T>
struct PagedKvLayer {
  T* k = nullptr;
  T* v = nullptr;
  int kv_heads = 0;
  int head_dim = 0;
};

// Writes `count` tokens' K and V (rows of kv_heads * head_dim elements, row r
// at k_src + r * src_stride) to positions first .. first + count - 1 of the
// sequence whose block table is `table`.
template <typename T>
Status WriteKvCuda(const T* k_src, const T* v_src, int64_t src_stride, int64_t count,
                   const int32_t* table, int64_t first, PagedKvLayer<T> layer, cudaStream_t stream);

// The same for rows of different sequences (a decode step's batch): row r
// goes to cache slot slots[r] (block id * kKvBlockTokensCuda + row in block,
// device memory).
template <typename T>
Status WriteKvSlotsCuda(const T* k_src, const T* v_src, int64_t src_stride, int64_t count,
                        const int64_t* slots, PagedKvLayer<T> layer, cudaStream_t stream);

// Gathers positions [first, first + count) of one layer into `out`: count
// rows of K, then count rows of V, each kv_heads * head_dim elements (one
// layer of a chunk's payload).
template <typename T>
Status GatherKvCuda(PagedKvLayer<T> layer, const int32_t* table, int64_t first, int64_t count,
                    T* out, cudaStream_t stream);

// The inverse: `in` (count rows of K, then of V) to positions [first, first +
// count) of one layer.
template <typename T>
Status ScatterKvCuda(const T* in, int64_t count, const int32_t* table, int64_t first,
                     PagedKvLayer<T> layer, cudaStream_t stream);

// Copies whole blocks of one layer, K and V: block pairs[2i] to pairs[2i+1].
template <typename T>
Status CopyKvBlocksCuda(PagedKvLayer<T> layer, const int32_t* pairs, int64_t n_pairs,
                        cudaStream_t stream);

}  // namespace kdn::engine::cuda
