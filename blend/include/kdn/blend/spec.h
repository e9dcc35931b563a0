#pragma once
// A blend request's vocabulary and rules (docs/serving.md, "Documents";
// docs/blend.md): its defaults, the checks that choose the recomputed
// tokens, the selection policies' names. Engine-free (the library
// kdn_blend_spec, which links kdn_common alone): the router validates a
// request with it, the prefill worker's blend (kdn/blend/blend.h) runs it,
// and control/request_spec.h carries it on the wire.
//
// Thread-compatible values; pure functions.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kdn/blend/steering.h"
#include "kdn/common/status.h"

namespace kdn::blend {

// Blend's defaults (docs/serving.md, "Documents"); kdn-router's
// --recompute-ratio and --check-layer and a request may override them.
inline constexpr double kDefaultRecomputeRatio = 0.15;
inline constexpr int kDefaultCheckLayer = 1;
// Where a quality target (BlendSpec::max_kl) starts raising the ratio when
// the request names none: blend::kRatioLadder's first.
inline constexpr double kMinTargetRatio = 0.05;

// No check layers named: in a BlendSpec, one check at check_layer; in
// kdn-router's options, its default (progressive checks at check_layer and
// the two layers after it; docs/blend.md, "Choosing the tokens").
inline std::vector<int> DefaultCheckLayers() { return {}; }

// One check of a blend: at `layer` the tokens still recomputed are scored by
// KV deviation and the top `ratio` of the prompt's cached tokens go on.
struct CheckStep {
  int layer = kDefaultCheckLayer;
  double ratio = kDefaultRecomputeRatio;
};

// The checks of a blend (docs/blend.md, "Choosing the tokens"). With no
// check_layers, one check at check_layer keeps recompute_ratio (kdn's
// one-layer choice). Otherwise CacheBlend's progressive filtering: one check
// at each of check_layers (ascending, each in [0, num_layers)), keeping
// check_ratios[i] of the cached tokens, among those kept at the check
// before; the ratios are non-increasing, in [0, 1], and the last equals
// recompute_ratio. Empty check_ratios: DefaultCheckRatios. INVALID_ARGUMENT
// (naming the field) for anything else.
Result<std::vector<CheckStep>> CheckSchedule(double recompute_ratio, int check_layer,
                                             std::span<const int> check_layers,
                                             std::span<const double> check_ratios, int num_layers);
// The check layers a blend uses when none are named: progressive filtering
// at `check_layer` and the two layers after it, where the model has them
// (one layer left is one check: empty), unless `ratios_named` (explicit
// check ratios need explicit layers). Named layers are kept as they are.
std::vector<int> ResolveCheckLayers(int check_layer, std::span<const int> check_layers,
                                    bool ratios_named, int num_layers);

// `checks` ratios falling in equal steps from min(1, 2 * ratio) at the first
// check to `ratio` at the last: a larger share is kept where the deviation
// is least telling, as the paper does.
std::vector<double> DefaultCheckRatios(double ratio, size_t checks);

// How a blend chooses the cached tokens it recomputes (docs/blend.md,
// "Selection policies"):
//   deviation            CacheBlend's: at each check, the cached tokens whose
//                        KV deviates most, up to the check's ratio
//   random               as many, drawn at random (the baseline)
//   boundary:K           EPIC's: the first K tokens of each document, at
//                        every layer; no check (the ratio is not used)
//   boundary+deviation:K the first K of each document always, and the rest
//                        of each check's budget by deviation
//   query                the question's: before the recompute, the question
//                        runs over the documents' reused KV, and the budget
//                        goes to the cached tokens it attends to most
//                        (summed over its tokens, heads and layers); no
//                        check, the tokens recomputed at every layer
//   query+boundary:K     the first K of each document always, and the rest
//                        of the budget by the question's attention
// K defaults to kDefaultBoundaryTokens and is at most kMaxBoundaryTokens.
// kdn-router's default is DefaultBlendSelection(): the best measured on
// SmolLM2 (docs/blend.md, "Selection policies").
struct BlendSelection {
  enum class Kind { kDeviation, kRandom, kBoundary, kBoundaryDeviation, kQuery, kQueryBoundary };
  Kind kind = Kind::kDeviation;
  int boundary_tokens = 0;  // K, for the boundary kinds

  // Whether the blend scores deviation at check layers (every kind but
  // boundary and the query kinds, which know their tokens from the start).
  bool checks() const { return kind != Kind::kBoundary && !query(); }
  // Whether it needs the question's attention to the cached tokens.
  bool query() const { return kind == Kind::kQuery || kind == Kind::kQueryBoundary; }
  // Whether it spends the ratio's budget (every kind but boundary, whose K
  // tokens a document are all it recomputes).
  bool uses_ratio() const { return kind != Kind::kBoundary; }
  friend bool operator==(const BlendSelection&, const BlendSelection&) = default;
};
inline constexpr int kDefaultBoundaryTokens = 8;
inline constexpr int kMaxBoundaryTokens = 256;
// "deviation", "random", "boundary:16", "boundary+deviation" (K 8),
// "boundary+deviation:4", "query", "query+boundary" (K 8) or
// "query+boundary:4"; INVALID_ARGUMENT naming the choices otherwise.
Result<BlendSelection> ParseBlendSelection(std::string_view text);
inline BlendSelection DefaultBlendSelection() {
  return {BlendSelection::Kind::kBoundaryDeviation, kDefaultBoundaryTokens};
}
// The text ParseBlendSelection reads back ("boundary+deviation:8").
std::string BlendSelectionName(const BlendSelection& s);

// Emphasis on spans of a blend prompt's documents, as PASTA steers
// attention (docs/serving.md, "Emphasis"): every query row computed over the
// prompt's KV (the blend's recomputed rows, the question, each generated
// token) at layer l and query head h adds bias[l * heads + h] to its score
// of each key in `spans` (prompt positions [begin, end), ascending,
// disjoint, not empty) before the softmax. The engine's form of it is
// engine::KvSequence::AttentionBias; kdn/blend/emphasis.h builds one.
struct Emphasis {
  std::vector<std::pair<int64_t, int64_t>> spans;
  int heads = 0;            // the model's query heads per layer
  std::vector<float> bias;  // [layer][head]
  friend bool operator==(const Emphasis&, const Emphasis&) = default;
};

// A prompt made of documents (CacheBlend; docs/serving.md, "Documents"): the
// prompt's first head_tokens tokens are computed in full, then come the
// documents (segment_tokens each), whose KV is reused from the KDN when held,
// then the rest of the prompt.
struct BlendSpec {
  int head_tokens = 0;              // leading prompt tokens computed in full
  std::vector<int> segment_tokens;  // then the documents' lengths, in order
  double recompute_ratio = kDefaultRecomputeRatio;
  int check_layer = kDefaultCheckLayer;
  // Progressive filtering (CheckSchedule); empty: one check at check_layer.
  std::vector<int> check_layers;
  std::vector<double> check_ratios;  // one per check layer; empty: the default
  BlendSelection selection;
  // > 0: a quality target instead of a fixed ratio (docs/blend.md, "A
  // quality target"): recompute_ratio is where the ratio starts, raised at
  // the first check until the KL the deviation predicts is at most this.
  double max_kl = 0;
  // Set: the request's emphasis (Emphasis), for the prefill worker's blend
  // and, in PrepareRequest, the decode worker's steps.
  std::optional<Emphasis> emphasis;
  // Empty, or one per document: the steered version a document names
  // (kdn/blend/steering.h), which the KDN must hold; unset: the document.
  std::vector<std::optional<SteerSpec>> steer;
};

}  // namespace kdn::blend
