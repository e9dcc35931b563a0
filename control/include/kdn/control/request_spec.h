#pragma once
// The request fields that cross the router -> worker edge, declared once with
// their defaults, and their one conversion to and from proto/serving.proto.
// The router's spec (router/request_spec.h) and the prefill worker's job
// (prefill_worker/prefiller.h) use these types, not copies of them.
//
// Thread-compatible values.

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kdn/common/kv_block.h"
#include "kdn/common/status.h"

namespace kdn::proto {
class BlendSpec;
class PruneSpec;
}  // namespace kdn::proto

namespace kdn::control {

// Tokens generated in all, the first included, when a request names none.
inline constexpr int kDefaultMaxTokens = 16;
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
// K defaults to kDefaultBoundaryTokens and is at most kMaxBoundaryTokens.
// kdn-router's default is DefaultBlendSelection(): the best measured on
// SmolLM2 (docs/blend.md, "Selection policies").
struct BlendSelection {
  enum class Kind { kDeviation, kRandom, kBoundary, kBoundaryDeviation };
  Kind kind = Kind::kDeviation;
  int boundary_tokens = 0;  // K, for the boundary kinds

  // Whether the blend scores deviation at check layers (every kind but
  // boundary, which knows its tokens from the start).
  bool checks() const { return kind != Kind::kBoundary; }
  friend bool operator==(const BlendSelection&, const BlendSelection&) = default;
};
inline constexpr int kDefaultBoundaryTokens = 8;
inline constexpr int kMaxBoundaryTokens = 256;
// "deviation", "random", "boundary:16", "boundary+deviation" (K 8) or
// "boundary+deviation:4"; INVALID_ARGUMENT naming the choices otherwise.
Result<BlendSelection> ParseBlendSelection(std::string_view text);
inline BlendSelection DefaultBlendSelection() {
  return {BlendSelection::Kind::kBoundaryDeviation, kDefaultBoundaryTokens};
}
// The text ParseBlendSelection reads back ("boundary+deviation:8").
std::string BlendSelectionName(const BlendSelection& s);

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
};

void BlendToProto(const BlendSpec& spec, proto::BlendSpec* out);
BlendSpec BlendFromProto(const proto::BlendSpec& p);

// Question-free pruning of a document's KV when it is stored
// (/v1/kdn/inject's `prune`; docs/kvbus.md, "Pruned KV"): the method that
// scores each token, the share kept, at token granularity (the same tokens
// in every layer and head: what a pruned chunk holds).
inline constexpr std::string_view kPruneMethods[] = {"expected_attention", "knorm", "kvzip"};
inline constexpr int kDefaultPruneSinks = 4;
inline constexpr int kMaxPruneSinks = 1024;
// KVzip's repeat prompts as kvpress words them, and "\n" to end the request
// (kvpress's ending for a tokenizer without a chat template).
inline constexpr std::string_view kKvzipFirstPrompt = "\n\nRepeat the previous context exactly.";
inline constexpr std::string_view kKvzipNextPrompt =
    "\n\nRepeat the part of the previous context exactly, starting with";
inline constexpr std::string_view kKvzipSuffix = "\n";
// KVzip's parts (prune::KvzipOptions' defaults): a text repeated this many
// tokens a pass, each later pass starting from the previous part's last
// kKvzipOverlap tokens.
inline constexpr int64_t kKvzipChunkTokens = 2048;
inline constexpr int kKvzipOverlap = 8;
struct PruneSpec {
  std::string method;
  double keep = 1;
  int sinks = kDefaultPruneSinks;  // the leading tokens always kept
  // KVzip's repeat prompts in the model's vocabulary (prune::KvzipPrompts;
  // the router tokenizes them); for "kvzip" only.
  std::vector<int32_t> kvzip_first, kvzip_next, kvzip_suffix;
};
bool IsPruneMethod(std::string_view method);
std::string PruneMethodNames();  // "'expected_attention', 'knorm', 'kvzip'"
// Under kvzip, sets spec's repeat prompts to `encode`'s ids of
// kKvzipFirstPrompt, kKvzipNextPrompt and kKvzipSuffix (the model's
// tokenizer, no BOS); other methods need none.
void TokenizeKvzipPrompts(const std::function<std::vector<int32_t>(const std::string&)>& encode,
                          PruneSpec* spec);
// INVALID_ARGUMENT naming what is wrong: an unknown method, a keep ratio
// outside (0, 1], negative sinks, kvzip without its prompts.
Status ValidatePruneSpec(const PruneSpec& spec);
// The most tokens pruning a text of `tokens` tokens holds in one sequence:
// the text, and under kvzip a repeat pass appended to it (its prompt, the
// previous part's tail, the request's end and a part). It must be within
// the model's context.
int64_t PrunePeakTokens(const PruneSpec& spec, int64_t tokens);
void PruneToProto(const PruneSpec& spec, proto::PruneSpec* out);
PruneSpec PruneFromProto(const proto::PruneSpec& p);

}  // namespace kdn::control
