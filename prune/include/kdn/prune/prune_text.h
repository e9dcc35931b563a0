#pragma once
// A text's pruned KV, as the prefill worker stores an injected document and
// kdn-generate reproduces it (docs/kvbus.md, "Pruned KV"): the text computed
// on its own from position 0, scored by the spec's method, and the kept
// tokens' KV written into a sequence of its own.
// Thread-compatible: the caller owns the engine.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/prune/spec.h"
#include "kdn/engine/engine.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/prune/head_budgets.h"
#include "kdn/prune/prune.h"

namespace kdn::prune {

// PruneText's checks of its input, before it computes anything:
// INVALID_ARGUMENT for a spec ValidatePruneSpec refuses, a text of no more
// tokens than its sinks, or one whose scoring would not fit the context.
Status CheckPruneText(const model::ModelConfig& config, int64_t tokens, const PruneSpec& spec);

// Computes `text` (non-empty, within the context) in a sequence of its own,
// scores it by spec.method, keeps tokens at its granularity (GranularityOf;
// under kvzip's profiled scoring, ScoringOf, as `budgets` say:
// SelectBudgeted; under its combined scoring, KVzip's global counts
// reranked: Rerank, MeanRanks) and writes the kept tokens' KV into `pruned` (an empty
// sequence of the model's cache; CompactKv), whose next position is the
// text's length. Returns what was kept. INVALID_ARGUMENT as CheckPruneText;
// FAILED_PRECONDITION for profiled scoring without `budgets`; the
// engine's errors as they are (RESOURCE_EXHAUSTED without room for the
// text and its copy, UNIMPLEMENTED for a method whose scores need query
// hooks on an engine without them). `pruned` is empty on error.
Result<KeptTokens> PruneText(engine::Engine& model, std::span<const int32_t> text,
                             const prune::PruneSpec& spec, engine::KvSequence* pruned,
                             const HeadBudgets* budgets = nullptr);

// The chunk of `pruned`, as PruneText made it with `kept`: a pruned chunk
// at token granularity, else one pruned per head (docs/kvbus.md, "Per-head
// kept tokens"), standing for the text of kept.logical tokens.
Result<std::shared_ptr<const kvbus::Chunk>> PrunedChunkOf(
    const engine::KvCache& cache, const engine::KvSequence& pruned, const KeptTokens& kept,
    const kvbus::ChunkKey& key, const kvbus::ChunkKey& model_fingerprint, DType dtype);

// The kept offsets of token-granularity KeptTokens (every layer's and
// head's), as a pruned chunk stores them.
std::vector<uint32_t> KeptOffsets(const KeptTokens& kept);

// The kept tokens of each layer and KV head, as a per-head pruned chunk
// stores them (kvbus::ChunkInfo::SetHeadKept): a count per (layer, KV
// head), and each head's kept offsets, head after head.
struct HeadKept {
  std::vector<uint32_t> counts, positions;
};
HeadKept HeadKeptOf(const KeptTokens& kept);

}  // namespace kdn::prune
