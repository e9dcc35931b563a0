#pragma once
// CacheBlend's fusion step (arXiv 2405.16444; docs/design.md, "Blend"): a
// prompt made of segments, each with the KV it had when computed on its own
// (positions 0..n-1) or with none, then a suffix. The fused prefill
//   1. places each cached segment's KV at its position in the prompt and
//      rotates its K there (RoPE is a rotation: a delta rotation suffices);
//   2. recomputes every token at layers 0..check_layer and, at the check
//      layer, scores each cached token by how far its recomputed KV is from
//      the cached KV;
//   3. keeps the top recompute_ratio of cached tokens by that deviation, plus
//      every uncached token and the suffix;
//   4. recomputes only those at the later layers, over the fused cache.
// With check_layers (the paper's progressive filtering), steps 2-3 repeat at
// each check layer: the rows still recomputed are scored again there and
// narrowed to that check's ratio (control::CheckSchedule).
// recompute_ratio 1 is a full prefill; recompute_ratio 0 is full reuse (no
// cached token is recomputed at any layer). With overlap_load, a loader
// thread places (copies and rotates) layer l+1 of the cached KV while layer l
// computes; layers below the check layer are recomputed for every token when
// recompute_ratio > 0, so their cached KV is never placed.
//
// Not thread-safe: runs on the model's thread.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/control/request_spec.h"
#include "kdn/engine/engine.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbridge/paged_chunks.h"

namespace kdn::blend {

struct Segment {
  std::vector<int32_t> tokens;
  // Its KV computed alone (all layers, from position chunk->info().position),
  // or null: computed in full like the suffix.
  std::shared_ptr<const kvbus::Chunk> kv;
};

enum class Selection {
  kDeviation,  // CacheBlend: the cached tokens whose KV deviates most
  kRandom,     // the same number chosen at random (the baseline it must beat)
};

struct BlendOptions {
  double recompute_ratio = 0.15;
  int check_layer = 1;
  // Progressive filtering: checks at these layers, keeping these shares of
  // the cached tokens (control::CheckSchedule; empty: one check at
  // check_layer).
  std::vector<int> check_layers;
  std::vector<double> check_ratios;
  Selection selection = Selection::kDeviation;
  uint64_t seed = 0;  // for kRandom
  bool overlap_load = true;
  // Called on the caller's thread once layer l of the fused KV is final in
  // `seq` (for pushing it to a decode worker); an error stops the blend.
  std::function<Status(int layer)> on_layer;
};

struct BlendResult {
  std::vector<float> logits;  // of the prompt's last token
  int cached_tokens = 0;      // tokens whose KV came from a segment's cache
  int recomputed_tokens = 0;  // of those, recomputed past the last check layer
  // Cached tokens kept at each check, in order (the last is recomputed_tokens).
  std::vector<int> kept_at_check;
  int computed_tokens = 0;  // uncached segments and the suffix
  // Where the time went: the layers up to the check and the choice of rows,
  // and of all the layers' time, how long the compute waited for the
  // loader to place a layer's cached KV.
  double check_seconds = 0;
  double load_wait_seconds = 0;
};

// Fuses `segments` then `suffix` (non-empty) into `seq` (empty on entry; it
// holds the fused prompt's KV on return). INVALID_ARGUMENT for a chunk that
// does not fit the model or its segment, a bad ratio or check layer.
Result<BlendResult> BlendPrefill(engine::Engine& model, engine::KvSequence& seq,
                                 std::span<const Segment> segments, std::span<const int32_t> suffix,
                                 const BlendOptions& options);

// The rows a check keeps: of the current rows (at `positions`, where
// cached[p] says whether position p came from a cache), every uncached one
// and the `keep` cached ones with the largest `deviation` (one per current
// row; ties to the earlier row), or `keep` drawn by `rng` with kRandom.
// Indices into the current rows, ascending. keep at most the cached rows.
std::vector<int64_t> ChooseRows(std::span<const int64_t> positions, const std::vector<bool>& cached,
                                std::span<const float> deviation, int64_t keep, Selection selection,
                                uint64_t seed);

// KL(p || q) of the next-token distributions softmax(p_logits) and
// softmax(q_logits): how far a blend's prediction is from full prefill's.
double KlDivergence(std::span<const float> p_logits, std::span<const float> q_logits);

}  // namespace kdn::blend
