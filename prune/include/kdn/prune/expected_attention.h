#pragma once
// Expected Attention (Devoto et al., arXiv 2510.00636): the attention the
// queries still to come are expected to pay each cached token, estimated
// from the context's own queries. Per layer and query head, the queries the
// context computed (before RoPE, past the sink tokens) give a mean mu and a
// covariance S; RoPE over the next `future_positions` positions, averaged
// into one matrix R, carries them to where future queries sit (R mu,
// R S R^T). For a Gaussian query, E[exp(q.k / sqrt(d))] = exp(mu.k / sqrt(d)
// + k^T S k / 2d), so each token's score is that exponent's softmax over the
// context's non-sink tokens, averaged over the query heads of its KV head,
// times the norm of its value (the share of the output it moves). Sink
// tokens get the layer's highest score plus one, so they are always kept.
// The same quantities as kvpress's ExpectedAttentionPress (0.5.5), which
// bench/kvpress_peer.py checks kdn's scores against.

#include <cstdint>

#include "kdn/common/status.h"
#include "kdn/engine/engine.h"
#include "kdn/prune/prune.h"

namespace kdn::prune {

struct ExpectedAttentionOptions {
  int sinks = 4;               // tokens left out of the statistics, always kept
  int future_positions = 512;  // RoPE averaged over this many positions
  bool use_covariance = true;  // the k^T S k term
  bool use_value_norm = true;  // times |v|
  double epsilon = 0.0;        // added to the attention before |v|
};

// Scores of the context held in slots [0, tokens) of `seq` (computed at
// positions 0 .. tokens-1), from `stats`, the query sums of that context's
// prefill with stats.skip == options.sinks. INVALID_ARGUMENT when they do
// not fit (another skip, no rows, a context of no more tokens than sinks).
Result<Scores> ExpectedAttentionScores(const model::ModelConfig& config, const engine::KvCache& kv,
                                       const engine::KvSequence& seq, int64_t tokens,
                                       const engine::QueryStats& stats,
                                       const ExpectedAttentionOptions& options = {});

}  // namespace kdn::prune
