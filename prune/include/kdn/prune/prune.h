#pragma once
// Question-free KV pruning (docs/kvbus.md, "Pruned KV"): a context's KV is
// scored once, from the context alone, per layer, KV head and token; the
// best-scored tokens are kept, the rest dropped, and what is kept is an
// ordinary shorter sequence: each kept K stays rotated (RoPE) for the
// position it was computed at, and the sequence's next position is the
// context's length, not its KV's (engine::KvSequence::next_position).
//
// Scores: Expected Attention (arXiv 2510.00636; expected_attention.h) and
// the key norm (Knorm's, as a baseline). Granularity, coarsest first:
//   kToken  the same tokens in every layer and head (the scores of a token,
//           each layer's and head's normalized to sum 1, added up);
//   kLayer  the same tokens in every head of a layer, chosen per layer;
//   kHead   chosen per layer and KV head;
//   kGlobal the best of every layer's and head's scores together, so each
//           (layer, KV head) keeps as many tokens as its scores earn
//           (KVzip's rule: its scores are attention weights, comparable
//           across layers and heads; other scores are not).
// Under the first three every (layer, KV head) keeps the same number of
// tokens, so the KV keeps its shape ([token][kv_head][head_dim] per layer)
// and attention reads it as it reads any sequence: slot j of head h holds
// the j-th token head h kept. Under kGlobal the sequence has as many slots
// as the head that kept the most; a head that kept fewer leaves the rest of
// its slots empty, and attention skips them (KvSequence::SetHeadTokens).
// The first `sinks` tokens are always kept. Thread-compatible (values).

#include <cstdint>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/kv_cache.h"
#include "kdn/model/config.h"
#include "kdn/prune/spec.h"

namespace kdn::prune {

// Scores [layer][kv_head][token] of a context of `tokens` tokens: higher is
// kept first.
struct Scores {
  int layers = 0, kv_heads = 0;
  int64_t tokens = 0;
  std::vector<float> v;
  float& at(int l, int h, int64_t t) { return v[(int64_t{l} * kv_heads + h) * tokens + t]; }
  float at(int l, int h, int64_t t) const { return v[(int64_t{l} * kv_heads + h) * tokens + t]; }
};

// Which tokens each (layer, KV head) keeps, ascending: `kept` of them, or
// under kGlobal count(l, h) <= kept (the rest of its row of `index` is -1).
struct KeptTokens {
  int layers = 0, kv_heads = 0;
  int64_t logical = 0;  // the context's tokens
  int64_t kept = 0;     // slots: the tokens each (layer, KV head) keeps, or the most any keeps
  Granularity granularity = Granularity::kToken;
  std::vector<int32_t> index;   // [layer][kv_head][kept]
  std::vector<int32_t> counts;  // [layer][kv_head] under kGlobal; empty: `kept` each
  const int32_t* of(int l, int h) const { return &index[(int64_t{l} * kv_heads + h) * kept]; }
  int64_t count(int l, int h) const {
    return counts.empty() ? kept : counts[size_t(l) * kv_heads + h];
  }
  // Tokens' KV stored over every layer and head, in units of a whole
  // token's (all layers and heads): kept, or the mean count under kGlobal.
  double stored_tokens() const;
};

// How many of `tokens` a keep ratio keeps: floor(tokens * keep), at least
// `sinks` + 1 and at most tokens (kvpress's rule, sinks included).
int64_t KeptCount(int64_t tokens, double keep, int sinks);

// What a choice of kept tokens checks first (SelectKept, SelectBudgeted):
// INVALID_ARGUMENT for a keep ratio outside (0, 1] or a text of no more
// tokens than sinks.
Status CheckSelection(const Scores& scores, double keep, int sinks);

// Picks the kept tokens from `scores` at `granularity`: the KeptCount best
// of each (layer, KV head) (kHead), of each layer's heads' normalized scores
// summed (kLayer) or of every layer's and head's (kToken); under kGlobal,
// KeptCount times the layers and heads of (layer, head, token) triples, the
// best scores of all (each head's sinks among them). The first `sinks`
// always. INVALID_ARGUMENT for a keep ratio outside (0, 1] or fewer tokens
// than sinks.
Result<KeptTokens> SelectKept(const Scores& scores, double keep, int sinks,
                              Granularity granularity);

// Each (layer, KV head) keeps as many tokens as in `kept` (its sinks among
// them), the best of the others by `ranking` within the head, ties to the
// earlier token: another ranking of the same counts (kvzip's combined
// scoring). INVALID_ARGUMENT when the shapes differ.
Result<KeptTokens> Rerank(const KeptTokens& kept, const Scores& ranking, int sinks);

// Scores whose order within each (layer, KV head) is that of the mean of a
// token's ranks under `a` and under `b` (ties in either to the earlier
// token). INVALID_ARGUMENT when the shapes differ.
Result<Scores> MeanRanks(const Scores& a, const Scores& b);

// The key-norm baseline: minus the L2 norm of each cached key (small keys
// draw more attention: Devoto et al. 2024), over slots [0, tokens) of `seq`.
Result<Scores> KeyNormScores(const engine::KvCache& kv, const engine::KvSequence& seq,
                             int64_t tokens);

// Writes the kept KV of slots [0, kept.logical) of `src` into `dst` (an
// empty sequence of the same cache): slot j of head h at every layer holds
// the KV of token kept.of(l, h)[j] (under kGlobal, slots past the head's
// count hold zeros and are holes: KvSequence::SetHeadTokens); dst's next position becomes src's
// position of slot kept.logical (the context's length when src starts at
// 0). `src` is left as it was. RESOURCE_EXHAUSTED when the cache has too
// few free blocks; dst is then empty.
Status CompactKv(engine::KvCache& kv, const engine::KvSequence& src, const KeptTokens& kept,
                 engine::KvSequence* dst);

}  // namespace kdn::prune
