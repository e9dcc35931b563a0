#pragma once
// KVzip's head budgets (docs/kvbus.md, "Profiled and combined KVzip"). When
// KVzip's scores are chosen globally, how many of a text's tokens each
// (layer, KV head) keeps depends mostly on the model and little on the text
// (on SmolLM2 at keep 0.25, a text's own KVzip scores kept by budgets
// measured on other texts gave KL 0.0802, chosen globally 0.0815).
// Measured once per model, on kdn's calibration texts, they let a text be
// scored for less than a prefill: its tokens are ranked within each head
// by cheaper scores (kvzip's repeat pass over the first layers, Expected
// Attention in the others: ProfiledKvzipScores) and each head keeps as many
// as its budget says (SelectBudgeted). That is kvzip's profiled scoring
// (spec.h, KvzipScoring::kProfiled), what a deployment uses by default.
// Thread-compatible values; the engine-running calls use the engine's
// thread, as any prefill does.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/engine.h"
#include "kdn/prune/kvzip.h"
#include "kdn/prune/prune.h"

namespace kdn::prune {

struct HeadBudgets {
  // Keep ratios 1/kKeeps, 2/kKeeps, ..., 1.
  static constexpr int kKeeps = 64;
  int layers = 0, kv_heads = 0;
  int documents = 0;  // texts measured
  // [keep][layer][kv_head]: the mean share of a head's tokens past the
  // sinks that KVzip's global choice keeps at that ratio.
  std::vector<double> share;
};

// The budgets of KVzip's scores of some texts (each scored whole:
// KvzipScores over every layer), each chosen globally at every ratio
// (SelectKept). INVALID_ARGUMENT for no texts, texts of different shapes,
// or a text of no more than `sinks` tokens.
Result<HeadBudgets> MeasureHeadBudgets(std::span<const Scores> kvzip_scores, int sinks);

// Prefills each text on its own (its first kMaxBudgetTextTokens at most,
// and no more than fit the model's context with a repeat pass), scores it
// by KVzip and measures the budgets of them all (kDefaultPruneSinks
// sinks). An engine's error as it is; the cache holds what it held before.
inline constexpr int64_t kMaxBudgetTextTokens = 1024;
Result<HeadBudgets> MeasureHeadBudgets(engine::Engine& model,
                                       std::span<const std::vector<int32_t>> documents,
                                       const KvzipPrompts& prompts);

// The texts budgets are measured on: ten passages kdn's authors wrote for
// it, of 300 to 400 words each, in different registers (a story, a recipe,
// a report, a letter, terms of an agreement, a technical reference ...). A worker tokenizes them
// with its model's tokenizer, no BOS.
std::vector<std::string> CalibrationTexts();

// Each (layer, KV head) keeps its sinks and its budget's share of the rest,
// the best of them by `scores` within the head (granularity kGlobal). The
// shares are those of the two measured ratios around `keep`, interpolated,
// and scaled so that the heads keep as many tokens in all as SelectKept's
// kGlobal would (KeptCount per head on average), no head more than it has.
// INVALID_ARGUMENT as SelectKept, and for budgets of another shape.
Result<KeptTokens> SelectBudgeted(const Scores& scores, double keep, int sinks,
                                  const HeadBudgets& budgets);

// kvzip's profiled ranking of a context `seq` holds (as KvzipScores wants
// it): the KVzip scores of layers [0, kKvzipProfiledLayers) and the
// Expected Attention scores (from `stats`, the context's prefill's queries)
// of the others. Only their order within each head means anything.
Result<Scores> ProfiledKvzipScores(engine::Engine& model, engine::KvSequence& seq,
                                   std::span<const int32_t> context,
                                   const engine::QueryStats& stats, const KvzipPrompts& prompts,
                                   int sinks);

}  // namespace kdn::prune
