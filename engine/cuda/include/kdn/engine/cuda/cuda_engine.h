#pragma once
// CudaEngine: the engine on one GPU, in bf16. The same entry points as the CPU
// backend's CpuEngine (docs/engine.md): Prefill appends a range of a sequence's
// tokens on top of the KV it holds and calls a hook after each layer;
// DecodeStep appends one token to each sequence of a batch. Weights and the
// paged KV cache (blocks of 16 tokens, the CPU layout) live in device memory
// as bf16; matrix products go through cuBLAS (bf16 in, fp32 accumulation),
// one product for q, k and v and one for gate and up; RoPE and the KV write
// are one kernel; attention is FlashInfer's tensor-core kernels where the
// build has them for the shape (flash_attention.h), kdn's reference kernels
// otherwise; logits come back in fp32. Decode steps are replayed from CUDA
// graphs captured per batch-size bucket (the batch padded to the bucket), and
// DecodeGreedy picks the next tokens on the device.
//
// The per-layer hook runs on the calling thread once the layer's KV is in the
// cache (the stream is synchronized first), so a caller may read it.
//
// Thread-compatible: one thread at a time calls into a CudaEngine.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/config.h"
#include "kdn/engine/cpu_engine.h"
#include "kdn/engine/sampler.h"
#include "kdn/engine/weights.h"

namespace kdn::engine::cuda {

struct CudaEngineOptions {
  int device = 0;
  int64_t kv_tokens = 65536;          // size of the KV pool
  int64_t max_prefill_tokens = 32768;  // the longest Prefill call (activation buffers)
  int max_batch = 256;                 // the largest DecodeStep batch
  bool flash_attention = true;         // FlashInfer kernels where built for the shape
  bool cuda_graphs = true;             // decode from captured graphs (needs flash_attention)
};

// A sequence's KV: its blocks in the model's pool, host-side. Free it with
// CudaEngine::Free.
struct CudaKvSequence {
  std::vector<int32_t> blocks;
  int64_t length = 0;
};

class CudaEngine {
 public:
  // Uploads fp32 host weights (Hugging Face names, as CpuEngine::Create takes
  // them), rounding them to bf16.
  static Result<std::unique_ptr<CudaEngine>> Create(const ModelConfig& config,
                                                   const ModelWeights& weights,
                                                   const CudaEngineOptions& options = {});
  // Builds the model's weights directly in device memory from `seed` (values
  // uniform in +-0.02, norms 1): for benchmarking real shapes without a
  // weights file. Not kdn-mkmodel's values.
  static Result<std::unique_ptr<CudaEngine>> Materialize(const ModelConfig& config, uint64_t seed,
                                                        const CudaEngineOptions& options = {});
  ~CudaEngine();
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  const ModelConfig& config() const;
  int free_blocks() const;
  // Bytes of device memory the weights take.
  int64_t weight_bytes() const;

  // Room for `tokens` tokens in `seq` (blocks taken from the pool);
  // RESOURCE_EXHAUSTED when the pool is short.
  Status Reserve(CudaKvSequence& seq, int64_t tokens);
  void Free(CudaKvSequence& seq);

  // As CpuEngine::Prefill. `logits` gets the last token's fp32 logits (or every
  // new token's with options.all_logits).
  Status Prefill(CudaKvSequence& seq, std::span<const int32_t> tokens,
                 const PrefillOptions& options, std::vector<float>* logits);
  // As CpuEngine::DecodeStep: batch x vocab logits.
  Status DecodeStep(std::span<CudaKvSequence* const> seqs, std::span<const int32_t> tokens,
                    std::vector<float>* logits);
  // The same step, but the greedy choice (engine::Argmax: the first largest
  // logit) is made on the device and only the chosen ids come back: next[i]
  // for seqs[i].
  Status DecodeGreedy(std::span<CudaKvSequence* const> seqs, std::span<const int32_t> tokens,
                      std::vector<int32_t>* next);
  // The same step with each sequence's own sampling parameters and random
  // stream: samplers[i] for seqs[i], drawn on the device as Sampler::Sample
  // draws on the host (device_sampler.h); only the chosen ids come back. On
  // failure the samplers' streams are as they were.
  Status DecodeSample(std::span<CudaKvSequence* const> seqs, std::span<const int32_t> tokens,
                      std::span<Sampler* const> samplers, std::vector<int32_t>* next);

  // Which attention and decode paths this model runs (for logs and benches).
  bool uses_flash_attention() const;
  bool uses_cuda_graphs() const;

  // Copies one layer's KV of positions [first, first + count) to the host as
  // floats: count rows of K then count rows of V (a chunk's layer layout).
  Status ReadKv(const CudaKvSequence& seq, int layer, int64_t first, int64_t count,
                std::vector<float>* out);

 private:
  struct Impl;
  explicit CudaEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kdn::engine::cuda
