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
#include <string>
#include <string_view>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::prune {

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
}  // namespace kdn::prune
