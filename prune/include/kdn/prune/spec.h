#pragma once
// A pruning request's vocabulary and rules (docs/kvbus.md, "Pruned KV"): the
// methods, their defaults (KVzip's prompts and parts among them) and the
// checks on a spec. Engine-free (the library kdn_prune_spec, which links
// kdn_common alone): the router validates a request with it, the prefill
// worker's pruning (kdn/prune/) runs it, and control/request_spec.h carries
// it on the wire.
//
// Thread-compatible values; pure functions.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::prune {

// What a pruned text keeps the same in every layer and KV head, coarsest
// first (kdn/prune/prune.h, SelectKept): the tokens (kToken), the tokens of
// each layer (kLayer), nothing (kHead: each layer's KV head its own), or
// not even the count (kGlobal: each head as many as its scores earn among
// all). A chunk holds kToken as a pruned chunk, the others per head
// (docs/kvbus.md, "Per-head kept tokens").
enum class Granularity { kToken, kLayer, kHead, kGlobal };
const char* GranularityName(Granularity g);
// "token", "layer", "head", "global"; INVALID_ARGUMENT naming them.
Result<Granularity> ParseGranularity(const std::string& name);

// Question-free pruning of a document's KV when it is stored
// (/v1/kdn/inject's `prune`; docs/kvbus.md, "Pruned KV"): the method that
// scores each token, the share kept (of every layer's and head's tokens,
// or of them all on average under kGlobal), and the granularity.
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
// How kvzip scores a text: kFull, KVzip as published (repeat passes over
// every layer, about two prefills of the text: kvzip.h); kProfiled, each
// (layer, KV head) keeps as many tokens as the model's head budgets give it
// (head_budgets.h), ranked within the head by a repeat pass over the first
// kKvzipProfiledLayers layers and by Expected Attention in the others, for
// less than one prefill of the text; kCombined, each (layer, KV head) keeps
// as many tokens as KVzip's global choice gives it, ranked within the head
// by the mean of their ranks under KVzip and Expected Attention (kFull's
// cost and Expected Attention's). kProfiled and kCombined choose globally
// only.
enum class KvzipScoring { kFull, kProfiled, kCombined };
inline constexpr int kKvzipProfiledLayers = 2;
const char* KvzipScoringName(KvzipScoring s);
// "full", "profiled", "combined"; INVALID_ARGUMENT naming them.
Result<KvzipScoring> ParseKvzipScoring(const std::string& name);

struct PruneSpec {
  std::string method;
  double keep = 1;
  int sinks = kDefaultPruneSinks;  // the leading tokens always kept
  // Unset: the method's (DefaultGranularity).
  std::optional<Granularity> granularity;
  // kvzip only. Unset: kProfiled under kGlobal, kFull otherwise (ScoringOf).
  std::optional<KvzipScoring> scoring;
  // KVzip's repeat prompts in the model's vocabulary (prune::KvzipPrompts;
  // the router tokenizes them); for "kvzip" only.
  std::vector<int32_t> kvzip_first, kvzip_next, kvzip_suffix;
};
// The granularity a method keeps by when none is asked for: its best KL
// measured on SmolLM2 (docs/kvbus.md, "Measured against kvpress"): kvzip
// global (its scores are attention weights, comparable across heads),
// expected_attention layer; knorm token (the only one measured for it).
Granularity DefaultGranularity(std::string_view method);
// spec.granularity, or the method's default.
Granularity GranularityOf(const PruneSpec& spec);
// spec.scoring, or kvzip's default at spec's granularity; kFull for
// another method, which has no choice (whatever spec.scoring says: a spec
// ValidatePruneSpec refuses).
KvzipScoring ScoringOf(const PruneSpec& spec);
bool IsPruneMethod(std::string_view method);
std::string PruneMethodNames();  // "'expected_attention', 'knorm', 'kvzip'"
// Under kvzip, sets spec's repeat prompts to `encode`'s ids of
// kKvzipFirstPrompt, kKvzipNextPrompt and kKvzipSuffix (the model's
// tokenizer, no BOS); other methods need none.
void TokenizeKvzipPrompts(const std::function<std::vector<int32_t>(const std::string&)>& encode,
                          PruneSpec* spec);
// INVALID_ARGUMENT naming what is wrong: an unknown method, a keep ratio
// outside (0, 1], negative sinks, kvzip without its prompts, a scoring for
// another method than kvzip, kvzip's profiled or combined scoring at a
// granularity other than global.
Status ValidatePruneSpec(const PruneSpec& spec);
// The most tokens pruning a text of `tokens` tokens holds in one sequence:
// the text, and under kvzip a repeat pass appended to it (its prompt, the
// previous part's tail, the request's end and a part). It must be within
// the model's context.
int64_t PrunePeakTokens(const PruneSpec& spec, int64_t tokens);
}  // namespace kdn::prune
