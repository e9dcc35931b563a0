#pragma once
// Tensor-core attention over the paged KV cache, built on FlashInfer's
// batch prefill kernels (docs/engine.md, "Attention"). The FA2-style kernels
// serve decode (one query per sequence of a batch: grouped-query heads are
// packed into the query tile, so a decode step of a GQA model runs on tensor
// cores too, and long contexts are split across CTAs and merged) and, off
// Hopper, prefill (many queries of one sequence, on top of its cached KV). On
// a compute-capability 9.0 device prefill plans run FlashInfer's Hopper
// (FA3-style, wgmma) kernels instead.
//
// Compiled for bf16, head_dim 64 and 128, blocks of kKvBlockTokensCuda (16)
// tokens, causal masking aligned at the end of the keys (query i of n sees
// keys 0 .. kv_len - n + i). Other shapes, or a build without the FlashInfer
// headers (KDN_FLASHINFER off), report Supports() false and callers use the
// reference kernels of attention.cuh.
//
// Use: Plan once per forward pass (it uploads the block tables and the work
// split), then Run once per layer with that layer's cache. With `graph` the
// launch shape depends only on the batch size, so the Runs may be captured in
// a CUDA graph and replayed after later Plans of the same batch size.
//
// Host-only header. Thread-compatible: one thread at a time.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "kdn/common/status.h"
#include "kdn/engine/cuda/attention.cuh"
#include "kdn/engine/cuda/paged_kv.cuh"

namespace kdn::engine::cuda {

// One sequence of a planned batch: q_len new query rows (rows are laid out
// sequence after sequence), kv_len keys in all (the new ones included,
// kv_len >= q_len >= 1), and its block table (host memory, at least
// ceil(kv_len / 16) entries).
struct AttentionSequence {
  int32_t q_len = 0;
  int64_t kv_len = 0;
  const int32_t* table = nullptr;
  int64_t table_size = 0;
};

class FlashAttention {
 public:
  // Whether this build has kernels for the shape (bf16 cache).
  static bool Supports(const AttentionShape& shape);

  // Workspace for batches of up to `max_batch` sequences, `max_rows` query
  // rows in all and `max_blocks` blocks in all the block tables of one plan.
  // `hopper`: run prefill plans on the Hopper kernels where the device has
  // them (tests turn it off to check the FA2 prefill path on such a device).
  static Result<std::unique_ptr<FlashAttention>> Create(const AttentionShape& shape, int max_batch,
                                                        int64_t max_rows, int64_t max_blocks,
                                                        bool hopper = true);
  ~FlashAttention();
  FlashAttention(const FlashAttention&) = delete;
  FlashAttention& operator=(const FlashAttention&) = delete;

  // Plans a batch of `count` sequences; enqueues the uploads on `stream`.
  // `graph`: plan for replay inside a CUDA graph captured after a plan of
  // the same batch size with every q_len 1 (decode). Graph plans always
  // split keys across CTAs (FlashInfer's choice: the launch shape must not
  // depend on the lengths); an unsplit plan measured slower at 512 keys.
  Status Plan(const AttentionSequence* seqs, int count, bool graph, cudaStream_t stream);

  // Plans a batch in which every query row of a sequence sees all kv_len of
  // its keys (no mask): the keys a row pass's rows all share. On the Hopper
  // kernels only: UNIMPLEMENTED where hopper() is false.
  Status PlanFull(const AttentionSequence* seqs, int count, cudaStream_t stream);

  // Plans a batch whose query rows sit at ascending positions that need not
  // be consecutive (a RowPass's scattered rows): row r of a sequence sees
  // its keys 0 .. positions[r], counted from the sequence's first key.
  // `device_positions` holds one int32 per row of the batch, in row order,
  // on the device, and must stay there until the plan's last Run. FA2
  // kernels with a per-row mask (every key tile below kv_len is read).
  Status PlanPositions(const AttentionSequence* seqs, int count, const int32_t* device_positions,
                       cudaStream_t stream);

  // Whether prefill plans may run on the Hopper kernels here.
  bool hopper() const;

  // out (rows x heads x head_dim) and lse (rows x heads, base-2 log-sum-exp)
  // become the attention over the union of their keys and other's (disjoint
  // sets of keys: the two parts of a row pass's attention), in place.
  static Status MergeInPlace(__nv_bfloat16* out, float* lse, const __nv_bfloat16* other_out,
                             const float* other_lse, int64_t rows, int heads, int head_dim,
                             cudaStream_t stream);

  // Attention of the planned batch for one layer: row r of q (heads x
  // head_dim bf16) starts at q + r * q_row_stride (so q may be the query part
  // of a fused QKV row); out is [rows][heads][head_dim]. The new tokens' K and
  // V must be in `cache`. Enqueues on `stream`.
  // `lse`, if not null, gets each row and head's base-2 log-sum-exp
  // ([rows][heads]), for MergeInPlace.
  Status Run(const __nv_bfloat16* q, int64_t q_row_stride, PagedKvLayer<const __nv_bfloat16> cache,
             __nv_bfloat16* out, cudaStream_t stream, float* lse = nullptr);

  // Whether the last plan runs on the Hopper kernels.
  bool planned_hopper() const;

 private:
  struct Impl;
  explicit FlashAttention(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kdn::engine::cuda
