#pragma once
// Engine: the one interface every backend implements (docs/engine.md, "The
// engine interface"): a Llama-family transformer over a paged KV cache, on
// the CPU (CpuEngine) or on a GPU (cuda::CudaEngine). Workers, blend, bench
// and tools use only this interface; OpenEngine (open_engine.h) picks the
// backend from a device name.
//
// Entry points:
//   Prefill       appends a range of tokens to a sequence on top of the KV it
//                 already holds, calling a hook after each layer;
//   DecodeStep    one token for each sequence of a batch, logits back;
//   DecodeSample  the same step, each sequence's next token drawn where the
//                 logits live (on the device for a GPU);
//   BeginRowPass, RotateCachedKeys
//                 the per-layer calls blend needs;
//   kv_cache()    the blocks, and their KV by layer in a host element type.
// Every call that writes KV writes it into the sequence's blocks; failure
// leaves sequences as they were unless a call says otherwise.
//
// Thread-compatible: one thread at a time calls into an Engine (a worker owns
// one), except where a method says otherwise. The per-layer hook runs on the
// calling thread once the layer's KV is in the cache, so it may read it. Any
// thread may be that one, not only the thread that opened the engine: a
// backend on a device makes its own device current on the calling thread at
// each entry point (and in its KvCache's reads and writes), so callers never
// select a device themselves.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/model/config.h"
#include "kdn/engine/kv_cache.h"
#include "kdn/engine/sampler.h"

namespace kdn::engine {

// Called after layer `layer` has written the KV of the tokens being
// prefilled; a non-OK Status aborts the prefill with that Status (the tokens'
// KV is then dropped from the sequence).
using LayerHook = std::function<Status(int layer)>;

// Sees the queries a prefill computes, layer by layer, before RoPE: `q` is
// [rows][num_heads * head_dim] and `positions` the rows' RoPE positions,
// ascending. Called on the engine's thread, once per layer and call; `q` is
// valid only during the call. What KV pruning scores tokens from
// (kdn/prune/): QueryStats sums them, prune::KvzipScores keeps them.
using QueryHook =
    std::function<void(int layer, const float* q, int64_t rows, const int32_t* positions)>;

// Running sums of the queries a prefill computes, before RoPE, per layer and
// query head: what Expected Attention (kdn/prune/expected_attention.h)
// estimates the queries still to come from. Rows at positions below `skip`
// (sink tokens, whose queries are outliers) are left out. Sums add up across
// Prefill calls, so a context prefilled in pieces gives what one call would.
struct QueryStats {
  int64_t skip = 0;
  int64_t count = 0;  // rows summed (the same at every layer)
  // Sized by the engine at first use: [layer][head][head_dim] sums of q and
  // [layer][head][head_dim][head_dim] sums of q q^T, in double.
  std::vector<double> sum, outer;
  // Adds the rows of one layer's pre-RoPE queries `q` ([rows][heads *
  // head_dim], positions `positions`, ascending) to the sums; the engines
  // call it, `count` grows at layer 0.
  void Add(const model::ModelConfig& config, int layer, const float* q, int64_t rows,
           const int32_t* positions);
  // A hook that adds what a prefill of `config`'s model computes (to this
  // object, which must outlive the prefill).
  QueryHook Hook(const model::ModelConfig& config);
};

struct PrefillOptions {
  bool all_logits = false;  // logits of every new token, not only the last
  LayerHook on_layer;
  // When set, the prefill shows it its queries, in f32 on the host (the
  // CUDA engine copies its bf16 queries there, layer by layer).
  QueryHook on_queries;
  // Computes only the first `layers` layers (0: every layer): a scoring
  // pass that wants a few layers' queries (prune::KvzipScores). The rows'
  // KV of the later layers is not written and no logits are returned
  // (`logits` is left empty), so the caller truncates the sequence back
  // before anything else reads it. Past the model's layers: every layer.
  int layers = 0;
};

class RowPass;

// Page-locks host memory so that copies between it and an engine's device
// run by DMA at the link's rate (a pageable buffer goes through the driver's
// staging at a fraction of it). Plain functions, valid for the life of the
// process and callable from any thread: a buffer may be unpinned after the
// engine that asked for it is gone.
struct HostPinning {
  bool (*pin)(void* p, size_t bytes);  // false: the memory stays pageable
  void (*unpin)(void* p);
};

class Engine {
 public:
  virtual ~Engine() = default;

  virtual const model::ModelConfig& config() const = 0;
  // Where it runs, for logs and /metrics: "cpu", "cuda:0".
  virtual std::string device() const = 0;
  // The element type its KV cache holds: what its chunks carry (so another
  // backend's KV is never mistaken for its own) and what the model
  // fingerprint covers.
  virtual DType kv_dtype() const = 0;
  virtual KvCache& kv_cache() = 0;
  // How to pin host buffers for this engine's KV copies (chunks it is read
  // into and written from); null when its cache is in host memory.
  virtual const HostPinning* host_pinning() const { return nullptr; }
  // The most tokens one Prefill call computes, and the most rows of one row
  // pass (a GPU's activation buffers are sized for them:
  // OpenOptions::max_prefill_tokens); more is INVALID_ARGUMENT. A longer
  // prompt is prefilled in pieces no longer than this, each appended to the
  // sequence. INT64_MAX when the backend has no such limit.
  virtual int64_t max_prefill_tokens() const { return INT64_MAX; }
  // Whether its attention skips holes (KvSequence::Holes: KV pruned per
  // head); a backend that cannot refuses such sequences (RefuseHoles).
  virtual bool attends_holes() const { return false; }

  // Computes `tokens` at positions seq.next_position() .. +n-1 (which is
  // seq.length() .. unless seq holds pruned KV) and appends their KV to `seq`. `logits` receives n
  // x vocab floats if all_logits, else the last token's vocab floats (fp32 on the host: the first
  // token of a request is drawn from one row, so it is drawn there).
  virtual Status Prefill(KvSequence& seq, std::span<const int32_t> tokens,
                         const PrefillOptions& options, std::vector<float>* logits) = 0;

  // One step for a batch: token tokens[b] is appended to *seqs[b] at
  // position seqs[b]->next_position(). `logits` receives batch x vocab floats.
  // Sequences must be distinct. On error no sequence changes length.
  virtual Status DecodeStep(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                            std::vector<float>* logits) = 0;
  // The same step, drawing next[b] with samplers[b] (its parameters and its
  // random stream) exactly as samplers[b]->Sample would from the step's
  // logits; only the ids leave the backend. On failure the samplers' streams
  // are as they were.
  virtual Status DecodeSample(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                              std::span<Sampler* const> samplers, std::vector<int32_t>* next) = 0;

  // A prefill piece that rides in a decode step (DecodeSampleWith): `tokens`
  // appended to `*seq` as Prefill appends them, the last one's logits
  // (vocab floats) into `*logits` unless it is null.
  struct Piece {
    KvSequence* seq = nullptr;
    std::span<const int32_t> tokens;
    std::vector<float>* logits = nullptr;
  };
  // DecodeSample with prefill pieces of other sequences in the same pass
  // (docs/engine.md, "Mixed steps"), so that a backend may read each weight
  // once for the decode rows and the pieces' rows together. Every row gets
  // the bits DecodeSample and Prefill give it on their own; on failure no
  // sequence changes length and the samplers' streams are as they were.
  // This one runs the pieces' Prefills, then DecodeSample.
  virtual Status DecodeSampleWith(std::span<KvSequence* const> seqs,
                                  std::span<const int32_t> tokens,
                                  std::span<Sampler* const> samplers, std::vector<int32_t>* next,
                                  std::span<const Piece> pieces);

  // The per-layer calls blend needs (docs/design.md, "Blend"). A RowPass
  // recomputes chosen positions of a sequence whose cache already holds KV
  // for every position below seq.length() (for blend: KV fused from cached
  // segments). Each RunLayer computes the rows' K and V at one layer,
  // overwrites them in the cache, attends causally over the whole cache at
  // that layer and moves the rows' hidden states on; Keep narrows the rows
  // for the layers that follow. Recomputing every position at every layer
  // is a full prefill. The pass borrows the engine and the sequence; one
  // pass at a time, on the engine's thread.
  // `tokens` has one token per slot of `seq` (seq.length() of them);
  // `positions` (ascending, distinct, each < seq.length()) are the rows, as
  // slots. `slot_positions`, when given (one per slot, ascending), is the
  // position each slot's token sits at, which RoPE rotates its row for: a
  // sequence holding pruned KV (KvSequence::next_position) needs it, and
  // rows still attend by slot. Over a sequence with holes (KvSequence::
  // SetHoles) a row's K and V, written in every head, fill its slot's
  // holes at each layer it is computed at (the CPU engine; the CUDA
  // engine refuses holes).
  virtual Result<std::unique_ptr<RowPass>> BeginRowPass(
      KvSequence& seq, std::span<const int32_t> tokens, std::span<const int64_t> positions,
      std::span<const int64_t> slot_positions = {}) = 0;

  // Rotates the cached K of positions [first, first + count) of `seq`, at
  // `layer` (-1: every layer), as if RoPE had been applied at position +
  // delta instead of position: RoPE is a rotation, so a delta rotation moves
  // a segment's cached K to where it now sits in a prompt. Touches only that
  // KV, so it may run on another thread beside a RowPass working on other
  // layers of the same sequence (as may kv_cache().Write).
  virtual Status RotateCachedKeys(KvSequence& seq, int64_t first, int64_t count, int64_t delta,
                                  int layer = -1) = 0;
};

class RowPass {
 public:
  virtual ~RowPass() = default;
  // Runs the next layer (layers run in order, from 0). With `deviation`,
  // fills one value per current row: the squared L2 distance between its
  // recomputed K and V and the K and V the cache held for it before (zeros
  // in a hole: a head that held none counts all of its recomputed KV).
  virtual Status RunLayer(std::vector<float>* deviation = nullptr) = 0;
  // Keeps the current rows at these indices (ascending) for later layers.
  virtual Status Keep(std::span<const int64_t> rows) = 0;
  // The positions of the current rows.
  virtual const std::vector<int64_t>& positions() const = 0;
  virtual int next_layer() const = 0;
  // After the last layer: the logits of the last current row.
  virtual Status Logits(std::vector<float>* logits) = 0;
};

// Checks a row pass's arguments against `seq` (shared by the backends).
Status CheckRowPass(const model::ModelConfig& config, const KvSequence& seq,
                    std::span<const int32_t> tokens, std::span<const int64_t> positions,
                    std::span<const int64_t> slot_positions);
// Checks RowPass::Keep's rows against a pass of `current` rows.
Status CheckKeep(std::span<const int64_t> rows, size_t current);
// Checks RotateCachedKeys' arguments against `seq` (and that the model's
// RoPE allows the move: not past dynamic scaling's threshold).
Status CheckRotation(const model::ModelConfig& config, const KvSequence& seq, int64_t first,
                     int64_t count, int64_t delta, int layer);
// Prefills `tokens` into `seq` in calls of at most model.max_prefill_tokens()
// tokens (one call on the CPU), each appended to the last, as a long
// prompt is; `logits` holds the last call's. The first error is returned as
// it is, the pieces before it left appended.
Status PrefillInPieces(Engine& model, KvSequence& seq, std::span<const int32_t> tokens,
                       const PrefillOptions& options, std::vector<float>* logits);
// Checks a decode batch: as many tokens as sequences, none twice, not empty.
Status CheckDecodeBatch(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                        size_t samplers);
// UNIMPLEMENTED for a sequence with holes (KvSequence::Holes): what
// a backend whose attention cannot skip them answers (the CUDA engine).
Status RefuseHoles(const KvSequence& seq, const char* what);
// INVALID_ARGUMENT for a sequence whose attention bias is for another
// number of query heads than the model's (what a backend checks at use).
Status CheckAttentionBias(const model::ModelConfig& config, const KvSequence& seq);
// The attention biases of a batch's sequences (KvSequence::AttentionBias)
// laid out for one kernel launch (the CUDA engine's ScoreBiasCuda): row b's
// values are head_bias[b * layers * heads ..] (zeros for a sequence with
// none), its spans the [begin, end) pairs spans[2i], spans[2i + 1] for i in
// [span_first[b], span_first[b + 1]). `any`: some sequence has one.
struct BatchBias {
  std::vector<float> head_bias;
  std::vector<int64_t> spans;
  std::vector<int32_t> span_first;
  bool any = false;
};
BatchBias LayOutBias(std::span<const KvSequence* const> seqs, int layers, int heads);

}  // namespace kdn::engine
