#include "kdn/prune/prune_text.h"

#include "kdn/prune/expected_attention.h"
#include "kdn/prune/kvzip.h"
#include "kdn/kvbridge/head_pruned.h"
#include "kdn/kvbridge/paged_chunks.h"

namespace kdn::prune {

Status CheckPruneText(const model::ModelConfig& cfg, int64_t n, const PruneSpec& spec) {
  KDN_RETURN_IF_ERROR(ValidatePruneSpec(spec));
  if (n <= spec.sinks) {
    return InvalidArgument("prune: a text of " + std::to_string(n) +
                           " tokens has no more than its " + std::to_string(spec.sinks) +
                           " sink tokens");
  }
  if (const int64_t peak = PrunePeakTokens(spec, n); peak > cfg.max_context) {
    return InvalidArgument("prune: " + spec.method + " over a text of " + std::to_string(n) +
                           " tokens holds " + std::to_string(peak) +
                           " tokens at once, past the model's context of " +
                           std::to_string(cfg.max_context));
  }
  return Status::Ok();
}

Result<KeptTokens> PruneText(engine::Engine& model, std::span<const int32_t> text,
                             const prune::PruneSpec& spec, engine::KvSequence* pruned,
                             const HeadBudgets* budgets) {
  const auto n = static_cast<int64_t>(text.size());
  const model::ModelConfig& cfg = model.config();
  KDN_RETURN_IF_ERROR(CheckPruneText(cfg, n, spec));
  const KvzipScoring scoring = ScoringOf(spec);
  const bool profiled = scoring == KvzipScoring::kProfiled;
  const bool combined = scoring == KvzipScoring::kCombined;
  if (profiled && budgets == nullptr) {
    return FailedPrecondition("prune: kvzip's profiled scoring needs the model's head budgets");
  }
  engine::KvCache& cache = model.kv_cache();
  engine::KvSequence whole = cache.NewSequence();
  KDN_RETURN_IF_ERROR(cache.Reserve(whole, n));
  engine::QueryStats stats{.skip = spec.sinks};
  engine::PrefillOptions popts;
  if (spec.method == "expected_attention" || profiled || combined) {
    popts.on_queries = stats.Hook(cfg);
  }
  std::vector<float> logits;
  KDN_RETURN_IF_ERROR(model.Prefill(whole, text, popts, &logits));
  const KvzipPrompts prompts{spec.kvzip_first, spec.kvzip_next, spec.kvzip_suffix};
  Result<Scores> scores =
      spec.method == "expected_attention"
          ? ExpectedAttentionScores(cfg, cache, whole, n, stats, {.sinks = spec.sinks})
      : profiled               ? ProfiledKvzipScores(model, whole, text, stats, prompts, spec.sinks)
      : spec.method == "kvzip" ? KvzipScores(model, whole, text, prompts, {.sinks = spec.sinks})
                               : KeyNormScores(cache, whole, n);
  KDN_RETURN_IF_ERROR(scores.status());
  KDN_ASSIGN_OR_RETURN(KeptTokens kept,
                       profiled ? SelectBudgeted(*scores, spec.keep, spec.sinks, *budgets)
                                : SelectKept(*scores, spec.keep, spec.sinks, GranularityOf(spec)));
  if (combined) {
    // KVzip's counts, ranked within each head by KVzip's and Expected
    // Attention's ranks together.
    KDN_ASSIGN_OR_RETURN(
        Scores ea, ExpectedAttentionScores(cfg, cache, whole, n, stats, {.sinks = spec.sinks}));
    KDN_ASSIGN_OR_RETURN(Scores ranking, MeanRanks(*scores, ea));
    KDN_ASSIGN_OR_RETURN(kept, Rerank(kept, ranking, spec.sinks));
  }
  // `whole` is freed on return, after the copy.
  KDN_RETURN_IF_ERROR(CompactKv(cache, whole, kept, pruned));
  return kept;
}

Result<std::shared_ptr<const kvbus::Chunk>> PrunedChunkOf(
    const engine::KvCache& cache, const engine::KvSequence& pruned, const KeptTokens& kept,
    const kvbus::ChunkKey& key, const kvbus::ChunkKey& model_fingerprint, DType dtype) {
  const auto logical = static_cast<uint32_t>(kept.logical);
  if (kept.granularity == Granularity::kToken) {
    return kvbridge::PrunedChunkFromPagedKv(cache, pruned, logical, KeptOffsets(kept), key,
                                            model_fingerprint, dtype);
  }
  HeadKept hk = HeadKeptOf(kept);
  return kvbridge::HeadPrunedChunkFromPagedKv(cache, pruned, logical, std::move(hk.counts),
                                              std::move(hk.positions), key, model_fingerprint,
                                              dtype);
}

std::vector<uint32_t> KeptOffsets(const KeptTokens& kept) {
  const int32_t* of = kept.of(0, 0);
  return {of, of + kept.kept};
}

HeadKept HeadKeptOf(const KeptTokens& kept) {
  HeadKept out;
  for (int l = 0; l < kept.layers; ++l) {
    for (int h = 0; h < kept.kv_heads; ++h) {
      const int64_t n = kept.count(l, h);
      out.counts.push_back(static_cast<uint32_t>(n));
      out.positions.insert(out.positions.end(), kept.of(l, h), kept.of(l, h) + n);
    }
  }
  return out;
}

}  // namespace kdn::prune
