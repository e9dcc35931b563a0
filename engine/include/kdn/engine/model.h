#pragma once
// Model: a Llama-family transformer on the CPU backend (fp32, OpenBLAS for the
// matrix products, OpenMP across cores) over a paged KV cache.
//
// Entry points (the engine contract of docs/engine.md):
//   Prefill     appends a range of tokens to a sequence on top of the KV it
//               already holds, calling a hook after each layer;
//   DecodeStep  one token for each sequence of a batch.
// Both write the new tokens' KV into the sequence's blocks and return logits.
//
// Thread-compatible: one thread at a time calls into a Model (a worker owns
// one). The per-layer hook runs on that thread.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/config.h"
#include "kdn/engine/kv_cache.h"
#include "kdn/engine/weights.h"

namespace kdn::engine {

struct EngineOptions {
  // KV pool size in blocks of 16 tokens; 0 picks enough for kv_tokens.
  int kv_blocks = 0;
  int64_t kv_tokens = 16384;
  // OpenMP/OpenBLAS threads; 0 = all cores.
  int threads = 0;
};

// Called after layer `layer` has written the KV of the tokens being
// prefilled; a non-OK Status aborts the prefill with that Status (the tokens'
// KV is then dropped from the sequence).
using LayerHook = std::function<Status(int layer)>;

struct PrefillOptions {
  bool all_logits = false;  // logits of every new token, not only the last
  LayerHook on_layer;
};

class Model {
 public:
  // Takes the weights (fp32, Hugging Face names) and builds the backend's
  // layouts; the map is consumed.
  static Result<std::unique_ptr<Model>> Create(const ModelConfig& config,
                                               ModelWeights weights,
                                               const EngineOptions& options = {});
  // Loads config.json and the safetensors weights of a model folder.
  static Result<std::unique_ptr<Model>> Load(const std::filesystem::path& dir,
                                             const EngineOptions& options = {});
  ~Model();

  const ModelConfig& config() const { return config_; }
  PagedKvCache& kv_cache() { return *kv_; }

  // Computes `tokens` at positions seq.length() .. seq.length()+n-1 and
  // appends their KV to `seq`. `logits` receives n x vocab floats if
  // all_logits, else the last token's vocab floats.
  Status Prefill(KvSequence& seq, std::span<const int32_t> tokens,
                 const PrefillOptions& options, std::vector<float>* logits);

  // One step for a batch: token tokens[b] is appended to *seqs[b] at position
  // seqs[b]->length(). `logits` receives batch x vocab floats. Sequences must
  // be distinct. On error no sequence changes length.
  Status DecodeStep(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                    std::vector<float>* logits);

 private:
  struct Layer;
  struct Segment;  // one sequence's run of new tokens inside a forward pass
  Model(const ModelConfig& config, const EngineOptions& options);
  Status Forward(std::span<Segment> segments, bool all_logits, const LayerHook& hook,
                 std::vector<float>* logits);
  // Attention of every new row over its sequence's KV (already written).
  void AttendAll(int layer, std::span<const Segment> segs, const float* q, float* out);
  void AttendPrefill(int layer, const Segment& seg, const float* q, float* out);

  ModelConfig config_;
  EngineOptions options_;
  std::vector<float> embed_;    // [vocab][hidden]
  std::vector<float> lm_head_;  // [vocab][hidden]; empty when tied to embed_
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
  std::unique_ptr<PagedKvCache> kv_;
};

}  // namespace kdn::engine
