#pragma once
// CpuEngine: the Engine (engine.h) on the CPU: fp32 activations, weight
// matrices in their stored format (WeightMatrix: quantized dot products for
// decode, OpenBLAS for prefill), OpenMP across cores, over a CpuKvCache in
// host memory.
//
// Thread-compatible, as Engine says: one thread at a time calls into it (a
// worker owns one), but RotateCachedKeys and kv_cache().Write on one layer
// may run beside a RowPass on another.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/model/config.h"
#include "kdn/engine/engine.h"
#include "kdn/engine/kv_cache.h"
#include "kdn/engine/rope.h"
#include "kdn/engine/weight_matrix.h"
#include "kdn/engine/weights.h"

namespace kdn::engine {

struct EngineOptions {
  // KV pool size in blocks of 16 tokens; 0 picks enough for kv_tokens.
  int kv_blocks = 0;
  int64_t kv_tokens = 16384;
  // OpenMP/OpenBLAS threads; 0 = all cores.
  int threads = 0;
  // > 0: the most tokens one Prefill call (or rows one row pass) takes, as
  // a GPU's activation buffers limit it (for tests of callers that split
  // prompts); 0: no limit.
  int64_t max_prefill_tokens = 0;
  // Where the KV pool lives (CpuKvCache's storage): called once with the
  // pool's size in bytes; it returns memory that outlives the engine, or an
  // error that Create returns. Empty: the engine's own memory.
  std::function<Result<uint8_t*>(uint64_t bytes)> kv_pool_memory;
  // What Load asks of the weights' loader (weights.h): matrices in the
  // file's format, or widened to f32.
  WeightsDType weights_dtype = WeightsDType::kNative;
};

class CpuEngine final : public Engine {
 public:
  // Takes the weights (Hugging Face names; matrices fp32 or in a format of
  // quant.h's table) and builds the backend's layouts; the map is consumed.
  static Result<std::unique_ptr<CpuEngine>> Create(const model::ModelConfig& config,
                                                   ModelWeights weights,
                                                   const EngineOptions& options = {});
  // Loads config.json and the safetensors weights of a model folder.
  static Result<std::unique_ptr<CpuEngine>> Load(const std::filesystem::path& dir,
                                                 const EngineOptions& options = {});
  ~CpuEngine();

  const model::ModelConfig& config() const override { return config_; }
  std::string device() const override { return "cpu"; }
  DType kv_dtype() const override { return DType::kF32; }
  CpuKvCache& kv_cache() override { return *kv_; }
  int64_t max_prefill_tokens() const override {
    return options_.max_prefill_tokens > 0 ? options_.max_prefill_tokens : INT64_MAX;
  }
  bool attends_holes() const override { return true; }

  Status Prefill(KvSequence& seq, std::span<const int32_t> tokens, const PrefillOptions& options,
                 std::vector<float>* logits) override;
  Status DecodeStep(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                    std::vector<float>* logits) override;
  Status DecodeSample(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                      std::span<Sampler* const> samplers, std::vector<int32_t>* next) override;
  // One forward pass over the decode rows and the pieces' rows together.
  Status DecodeSampleWith(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                          std::span<Sampler* const> samplers, std::vector<int32_t>* next,
                          std::span<const Piece> pieces) override;
  Result<std::unique_ptr<RowPass>> BeginRowPass(
      KvSequence& seq, std::span<const int32_t> tokens, std::span<const int64_t> positions,
      std::span<const int64_t> slot_positions = {}) override;
  Status RotateCachedKeys(KvSequence& seq, int64_t first, int64_t count, int64_t delta,
                          int layer = -1) override;

  // Bytes the weights hold in memory (matrices in their formats, vectors in
  // f32): what one decode step reads.
  int64_t weight_bytes() const;

 private:
  struct Layer;
  struct Segment;  // one sequence's run of new tokens inside a forward pass
  struct Scratch;  // a pass's activations, allocated once for all its layers
  class CpuRowPass;
  CpuEngine(const model::ModelConfig& config, const EngineOptions& options);
  Status Forward(std::span<Segment> segments, bool all_logits, const LayerHook& hook,
                 const QueryHook& on_queries, std::vector<float>* logits, int layers = 0);
  // INVALID_ARGUMENT for a prefill of no tokens or past max_prefill_tokens.
  Status CheckPrefillTokens(size_t n) const;
  // A decode step's segments (token b appended to *seqs[b]), in the
  // scratch's vector.
  std::vector<Segment>& DecodeSegments(std::span<KvSequence* const> seqs,
                                       std::span<const int32_t> tokens);
  // Each row's slot in its sequence's KV (where its KV goes, and what it
  // attends to: slots up to its own) and its position (RoPE's).
  struct RowPositions {
    const int32_t* slot;
    const int32_t* rope;
  };
  // Runs layer l over `rows` rows whose hidden states are in `x`, at `rp`;
  // segs name the sequences the rows belong to. When `deviation` is given
  // (one sequence only), it receives per row the squared distance of its
  // new K and V from those the cache held before; `on_queries`, when given
  // and set, sees the rows' queries.
  void RunLayer(int l, std::span<Segment> segs, RowPositions rp, int64_t rows, float* x,
                Scratch& scratch, std::vector<float>* deviation, const QueryHook* on_queries);
  // Attention of every new row over its sequence's KV (already written).
  void AttendAll(int layer, std::span<const Segment> segs, const int32_t* pos, const float* q,
                 float* out, Scratch& scratch);

  // The output projection: lm_head_, or embed_ when tied.
  const WeightMatrix& head() const { return lm_head_.empty() ? embed_ : lm_head_; }

  model::ModelConfig config_;
  EngineOptions options_;
  WeightMatrix embed_;    // [vocab][hidden]
  WeightMatrix lm_head_;  // [vocab][hidden]; empty when tied to embed_
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
  RopeParams rope_;
  std::unique_ptr<CpuKvCache> kv_;
  // Forward's buffers, kept across calls (one caller at a time).
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace kdn::engine
