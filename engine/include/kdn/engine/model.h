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

  // The per-layer calls blend needs (docs/design.md, "Blend"). A RowPass
  // recomputes chosen positions of a sequence whose cache already holds KV
  // for every position below seq.length() (for blend: KV fused from cached
  // segments). Each RunLayer computes the rows' K and V at one layer,
  // overwrites them in the cache, attends causally over the whole cache at
  // that layer and moves the rows' hidden states on; Keep narrows the rows
  // for the layers that follow. Recomputing every position at every layer
  // is a full prefill. The pass borrows the model and the sequence; one
  // pass at a time, on the model's thread.
  class RowPass;
  // `tokens` has one token per position of `seq` (seq.length() of them);
  // `positions` (ascending, distinct, each < seq.length()) are the rows.
  Result<std::unique_ptr<RowPass>> BeginRowPass(KvSequence& seq, std::span<const int32_t> tokens,
                                                std::span<const int64_t> positions);

  // Rotates the cached K of positions [first, first + count) of `seq`, at
  // `layer` (-1: every layer), as if RoPE had been applied at position +
  // delta instead of position: RoPE is a rotation, so a delta rotation moves
  // a segment's cached K to where it now sits in a prompt. Touches only that
  // KV, so it may run on another thread beside a RowPass working on other
  // layers of the same sequence.
  Status RotateCachedKeys(KvSequence& seq, int64_t first, int64_t count, int64_t delta,
                          int layer = -1);

 private:
  struct Layer;
  struct Segment;  // one sequence's run of new tokens inside a forward pass
  struct Scratch;  // a pass's activations, allocated once for all its layers
  Model(const ModelConfig& config, const EngineOptions& options);
  Status Forward(std::span<Segment> segments, bool all_logits, const LayerHook& hook,
                 std::vector<float>* logits);
  // Attention of every new row over its sequence's KV (already written).
  // Runs layer l over `rows` rows whose hidden states are in `x`, at the
  // positions `pos`; segs name the sequences the rows belong to. When
  // `deviation` is given (one sequence only), it receives per row the squared
  // distance of its new K and V from those the cache held before.
  void RunLayer(int l, std::span<Segment> segs, const int32_t* pos, int64_t rows, float* x,
                Scratch& scratch, std::vector<float>* deviation);
  // Attention of every new row over its sequence's KV (already written).
  void AttendAll(int layer, std::span<const Segment> segs, const int32_t* pos, const float* q,
                 float* out);
  // One sequence's rows at ascending positions `pos` (n of them), causal.
  void AttendRows(int layer, const KvSequence& seq, const int32_t* pos, int64_t n, const float* q,
                  float* out);

  ModelConfig config_;
  EngineOptions options_;
  std::vector<float> embed_;    // [vocab][hidden]
  std::vector<float> lm_head_;  // [vocab][hidden]; empty when tied to embed_
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
  std::unique_ptr<PagedKvCache> kv_;
};

class Model::RowPass {
 public:
  ~RowPass();
  // Runs the next layer (layers run in order, from 0). With `deviation`,
  // fills one value per current row: the squared L2 distance between its
  // recomputed K and V and the K and V the cache held for it before.
  Status RunLayer(std::vector<float>* deviation = nullptr);
  // Keeps the current rows at these indices (ascending) for later layers.
  Status Keep(std::span<const int64_t> rows);
  const std::vector<int64_t>& positions() const { return positions_; }
  int next_layer() const { return next_layer_; }
  // After the last layer: the logits of the last current row.
  Status Logits(std::vector<float>* logits);

 private:
  friend class Model;
  RowPass(Model& model, KvSequence& seq);
  Model& model_;
  KvSequence& seq_;
  std::vector<int64_t> positions_;
  std::vector<float> x_;  // [row][hidden]
  std::unique_ptr<Scratch> scratch_;
  int next_layer_ = 0;
};

}  // namespace kdn::engine
