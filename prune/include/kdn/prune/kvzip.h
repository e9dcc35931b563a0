#pragma once
// KVzip (Kim et al., arXiv 2505.23416): a token's KV is worth what the model
// needs of it to repeat the context. With the context's KV cached, the model
// prefills "Repeat the previous context exactly." and the context itself
// again; each cached token's score, per layer and KV head, is the most
// attention any of those rows (and any query head of the KV head's group)
// pays it, the softmax being over the sink tokens, the part of the context
// being repeated and the repeat's own rows (causal). A context longer than
// `chunk_tokens` is repeated in parts, each after "Repeat the part of the
// previous context exactly, starting with" and the previous part's last
// `overlap` tokens. The repeat's KV is dropped again. It costs about two
// prefills of the context, so it runs when a document is stored, not on a
// request's path. The same quantities as kvpress's KVzipPress (0.5.5), which
// bench/kvpress_peer.py checks kdn's scores against. KVzip's scores are
// attention weights, comparable across layers and heads: kvpress keeps the
// best of all layers and heads together (Granularity::kGlobal).

#include <cstdint>
#include <span>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/engine.h"
#include "kdn/prune/prune.h"
#include "kdn/prune/spec.h"

namespace kdn::prune {

// The token ids of the repeat prompts, in the model's vocabulary (the
// caller tokenizes them: kdn-bench and the prefill worker with the model's
// tokenizer).
struct KvzipPrompts {
  std::vector<int32_t> first;  // "\n\nRepeat the previous context exactly."
  std::vector<int32_t>
      next;  // "\n\nRepeat the part of the previous context exactly, starting with"
  std::vector<int32_t> suffix;  // what ends the request: "\n", or a chat template's turn end
};

struct KvzipOptions {
  int sinks = kDefaultPruneSinks;            // keys every part's softmax includes
  int64_t chunk_tokens = kKvzipChunkTokens;  // context tokens repeated per pass
  int overlap = kKvzipOverlap;               // the previous part's tokens a later part starts from
  // Scores only layers [0, layers) (0: every layer), each repeat pass
  // stopping there (engine::PrefillOptions::layers); the later layers'
  // scores are 0. What kvzip's profiled scoring takes (head_budgets.h).
  int layers = 0;
};

// Scores of `context`, whose KV `seq` holds in slots [0, context.size()) at
// positions 0 .. size-1 (nothing else, no pruned KV), by repeat passes of
// `model` appended to `seq`; `seq` holds the context alone again afterwards,
// whatever the outcome. INVALID_ARGUMENT when `seq` does not fit or the
// prompts are empty; an engine's error (RESOURCE_EXHAUSTED when the cache
// has no room for a repeat pass, UNIMPLEMENTED on an engine without query
// hooks) as it is.
Result<Scores> KvzipScores(engine::Engine& model, engine::KvSequence& seq,
                           std::span<const int32_t> context, const KvzipPrompts& prompts,
                           const KvzipOptions& options = {});

}  // namespace kdn::prune
