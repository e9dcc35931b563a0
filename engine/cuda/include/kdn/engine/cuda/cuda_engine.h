#pragma once
// CudaEngine: the Engine (engine.h) on one GPU, in bf16. Weights and the
// paged KV cache (blocks of 16 tokens, the CPU layout) live in device memory
// as bf16; matrix products go through cuBLAS (bf16 in, fp32 accumulation),
// one product for q, k and v and one for gate and up; RoPE and the KV write
// are one kernel; attention is FlashInfer's tensor-core kernels where the
// build has them for the shape (flash_attention.h), kdn's reference kernels
// otherwise; logits come back in fp32. Decode steps are replayed from CUDA
// graphs captured per batch-size bucket (the batch padded to the bucket), and
// DecodeGreedy and DecodeSample pick the next tokens on the device.
//
// Its KvCache (kv_cache()) reads and writes the device blocks by layer on a
// stream of its own, so blend's loader thread may place layer l+1's KV while
// a RowPass computes layer l on the engine's stream; RotateCachedKeys runs on
// that second stream too.
//
// The per-layer hook runs on the calling thread once the layer's KV is in the
// cache (the stream is synchronized first), so a caller may read it.
//
// Thread-compatible otherwise: one thread at a time calls into a CudaEngine,
// and it need not be the thread that made it. Every entry point (and every
// read, write and copy of its KvCache, and a RowPass's calls) makes
// options.device current on the calling thread first, so a worker on
// `cuda:1` may call it from its compute, store I/O and lookup threads, whose
// current device is otherwise 0.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/model/config.h"
#include "kdn/engine/engine.h"
#include "kdn/engine/sampler.h"
#include "kdn/engine/weights.h"

namespace kdn::engine::cuda {

struct CudaEngineOptions {
  int device = 0;
  int64_t kv_tokens = 65536;           // size of the KV pool
  int64_t max_prefill_tokens = 32768;  // the longest Prefill call and RowPass (activation buffers)
  int max_batch = 256;                 // the largest DecodeStep batch
  bool flash_attention = true;         // FlashInfer kernels where built for the shape
  bool cuda_graphs = true;             // decode from captured graphs (needs flash_attention)
  // Where the KV pool lives: device memory of `device` of the bytes asked
  // (a decode worker's pool exported for the cuda_ipc plane; it must
  // outlive the engine). Unset: the engine allocates it.
  std::function<Result<uint8_t*>(uint64_t bytes)> kv_pool_memory;
};

// The number of CUDA devices, 0 when there is none or no driver.
int DeviceCount();
// A device's memory now (cudaMemGetInfo). FAILED_PRECONDITION, naming what
// the machine has, for a device that does not exist.
struct DeviceMemoryInfo {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};
Result<DeviceMemoryInfo> DeviceMemory(int device);

// Device memory a CudaEngine of `config` and `options` takes: weights, KV
// pool, activations and workspaces (an estimate to within a few percent, for
// refusing at start what cannot fit, and for sizing the KV pool).
int64_t EstimateDeviceBytes(const model::ModelConfig& config, const CudaEngineOptions& options);
// Bytes of KV one token takes in the pool (all layers, K and V, bf16).
int64_t KvBytesPerToken(const model::ModelConfig& config);

class CudaEngine final : public Engine {
 public:
  // Uploads fp32 host weights (Hugging Face names, as CpuEngine::Create takes
  // them), rounding them to bf16. FAILED_PRECONDITION, saying what the
  // machine has, when options.device does not exist or has too little free
  // memory for EstimateDeviceBytes.
  static Result<std::unique_ptr<CudaEngine>> Create(const model::ModelConfig& config,
                                                    const ModelWeights& weights,
                                                    const CudaEngineOptions& options = {});
  // Builds the model's weights directly in device memory from `seed` (values
  // uniform in +-0.02, norms 1): for benchmarking real shapes without a
  // weights file. Not kdn-mkmodel's values.
  static Result<std::unique_ptr<CudaEngine>> Materialize(const model::ModelConfig& config,
                                                         uint64_t seed,
                                                         const CudaEngineOptions& options = {});
  ~CudaEngine() override;
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  const model::ModelConfig& config() const override;
  std::string device() const override;
  DType kv_dtype() const override { return DType::kBF16; }
  KvCache& kv_cache() override;
  // cudaHostRegister (portable: for every device) and cudaHostUnregister.
  const HostPinning* host_pinning() const override;
  // Bytes of device memory the weights take.
  int64_t weight_bytes() const;
  // The rows its activation buffers hold: options.max_prefill_tokens (or
  // max_batch, if larger).
  int64_t max_prefill_tokens() const override;

  // `logits` gets the last token's fp32 logits (or every new token's with
  // options.all_logits).
  Status Prefill(KvSequence& seq, std::span<const int32_t> tokens, const PrefillOptions& options,
                 std::vector<float>* logits) override;
  Status DecodeStep(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                    std::vector<float>* logits) override;
  // The same step, but the greedy choice (engine::Argmax: the first largest
  // logit) is made on the device and only the chosen ids come back: next[i]
  // for seqs[i].
  Status DecodeGreedy(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                      std::vector<int32_t>* next);
  // Drawn on the device as Sampler::Sample draws on the host
  // (device_sampler.h).
  Status DecodeSample(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                      std::span<Sampler* const> samplers, std::vector<int32_t>* next) override;
  // A row pass runs its rows through the activation buffers, so at most
  // options.max_prefill_tokens rows.
  Result<std::unique_ptr<RowPass>> BeginRowPass(
      KvSequence& seq, std::span<const int32_t> tokens, std::span<const int64_t> positions,
      std::span<const int64_t> slot_positions = {}) override;
  Status RotateCachedKeys(KvSequence& seq, int64_t first, int64_t count, int64_t delta,
                          int layer = -1) override;

  // Which attention and decode paths this model runs (for logs and benches).
  bool uses_flash_attention() const;
  bool uses_cuda_graphs() const;

  struct Impl;  // cuda_engine_impl.h

 private:
  explicit CudaEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kdn::engine::cuda
