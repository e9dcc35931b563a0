#include "kdn/prune/head_budgets.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "kdn/prune/expected_attention.h"

namespace kdn::prune {

Result<HeadBudgets> MeasureHeadBudgets(std::span<const Scores> kvzip_scores, int sinks) {
  if (kvzip_scores.empty()) return InvalidArgument("head budgets: no texts to measure");
  const Scores& first = kvzip_scores.front();
  HeadBudgets b{first.layers, first.kv_heads, static_cast<int>(kvzip_scores.size()), {}};
  const int heads = b.layers * b.kv_heads;
  b.share.assign(size_t{HeadBudgets::kKeeps} * heads, 0.0);
  for (const Scores& s : kvzip_scores) {
    if (s.layers != b.layers || s.kv_heads != b.kv_heads) {
      return InvalidArgument("head budgets: texts scored by models of different shapes");
    }
    for (int k = 0; k < HeadBudgets::kKeeps; ++k) {
      KDN_ASSIGN_OR_RETURN(KeptTokens kept, SelectKept(s, double(k + 1) / HeadBudgets::kKeeps,
                                                       sinks, Granularity::kGlobal));
      const auto rest = static_cast<double>(s.tokens - sinks);
      for (int h = 0; h < heads; ++h) {
        b.share[size_t(k) * heads + h] += (kept.counts[h] - sinks) / rest / b.documents;
      }
    }
  }
  return b;
}

Result<HeadBudgets> MeasureHeadBudgets(engine::Engine& model,
                                       std::span<const std::vector<int32_t>> documents,
                                       const KvzipPrompts& prompts) {
  // Each text cut to what fits the context with its repeat pass (one
  // part), and to kMaxBudgetTextTokens.
  const auto prompt = static_cast<int64_t>(prompts.first.size() + prompts.suffix.size());
  const int64_t fit =
      std::min<int64_t>(kMaxBudgetTextTokens, (model.config().max_context - prompt) / 2);
  if (fit <= kDefaultPruneSinks) {
    return InvalidArgument("head budgets: a context of " +
                           std::to_string(model.config().max_context) +
                           " tokens holds no text with its repeat pass");
  }
  std::vector<Scores> scores;
  std::vector<float> logits;
  for (const std::vector<int32_t>& text : documents) {
    const std::span<const int32_t> doc =
        std::span(text).first(std::min<size_t>(text.size(), static_cast<size_t>(fit)));
    engine::KvSequence seq = model.kv_cache().NewSequence();
    KDN_RETURN_IF_ERROR(engine::PrefillInPieces(model, seq, doc, {}, &logits));
    KDN_ASSIGN_OR_RETURN(Scores s, KvzipScores(model, seq, doc, prompts));
    scores.push_back(std::move(s));
  }
  return MeasureHeadBudgets(scores, kDefaultPruneSinks);
}

namespace {

// How many of `rest` tokens past the sinks each head keeps: `want` scaled
// to `total` in all, none past `rest`, rounded by largest remainder (ties
// to the earlier head, so the counts never depend on a sort's order).
std::vector<int64_t> Apportion(std::vector<double> want, int64_t total, int64_t rest) {
  const auto heads = static_cast<int64_t>(want.size());
  std::vector<double> exact(heads, 0.0);
  std::vector<bool> full(heads, false);
  int64_t left = total;
  // Heads whose share would pass `rest` keep all they have; the others
  // share what is left, until none passes.
  for (bool again = true; again;) {
    again = false;
    double sum = 0.0;
    int64_t open = 0;
    for (int64_t h = 0; h < heads; ++h) {
      if (!full[h]) sum += want[h], ++open;
    }
    for (int64_t h = 0; h < heads; ++h) {
      if (full[h]) continue;
      // No measured share at all: alike.
      exact[h] = sum > 0 ? want[h] / sum * double(left) : double(left) / double(open);
      if (exact[h] > double(rest)) {
        full[h] = again = true;
        exact[h] = double(rest);
        left -= rest;
      }
    }
  }
  std::vector<int64_t> count(heads);
  int64_t given = 0;
  for (int64_t h = 0; h < heads; ++h) given += count[h] = static_cast<int64_t>(exact[h]);
  std::vector<int64_t> order(heads);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return exact[a] - double(count[a]) > exact[b] - double(count[b]);
  });
  for (int64_t i = 0; given < total; i = (i + 1) % heads) {
    if (count[order[i]] < rest) ++count[order[i]], ++given;
  }
  return count;
}

}  // namespace

Result<KeptTokens> SelectBudgeted(const Scores& s, double keep, int sinks,
                                  const HeadBudgets& budgets) {
  KDN_RETURN_IF_ERROR(CheckSelection(s, keep, sinks));
  if (budgets.layers != s.layers || budgets.kv_heads != s.kv_heads ||
      budgets.share.size() != size_t{HeadBudgets::kKeeps} * s.layers * s.kv_heads) {
    return InvalidArgument("prune: head budgets of " + std::to_string(budgets.layers) + "x" +
                           std::to_string(budgets.kv_heads) + " heads for scores of " +
                           std::to_string(s.layers) + "x" + std::to_string(s.kv_heads));
  }
  const int heads = s.layers * s.kv_heads;
  const int64_t rest = s.tokens - sinks;
  // The shares at the measured ratios around `keep` (below the first, the
  // first's, scaled down alike: only their proportions count).
  const double at = keep * HeadBudgets::kKeeps - 1.0;
  const int lo = std::clamp(static_cast<int>(std::floor(at)), 0, HeadBudgets::kKeeps - 1);
  const int hi = std::min(lo + 1, HeadBudgets::kKeeps - 1);
  const double f = std::clamp(at - lo, 0.0, 1.0);
  std::vector<double> want(heads);
  for (int h = 0; h < heads; ++h) {
    want[h] =
        (1 - f) * budgets.share[size_t(lo) * heads + h] + f * budgets.share[size_t(hi) * heads + h];
  }
  const std::vector<int64_t> count =
      Apportion(std::move(want), int64_t{heads} * (KeptCount(s.tokens, keep, sinks) - sinks), rest);

  // Those counts, sinks included; each head's best by `s` (Rerank).
  KeptTokens k{s.layers, s.kv_heads, s.tokens, 0, Granularity::kGlobal, {}, {}};
  for (const int64_t c : count) {
    k.counts.push_back(static_cast<int32_t>(c + sinks));
    k.kept = std::max(k.kept, c + sinks);
  }
  k.index.assign(size_t(heads) * k.kept, -1);
  return Rerank(k, s, sinks);
}

Result<Scores> ProfiledKvzipScores(engine::Engine& model, engine::KvSequence& seq,
                                   std::span<const int32_t> context,
                                   const engine::QueryStats& stats, const KvzipPrompts& prompts,
                                   int sinks) {
  const auto n = static_cast<int64_t>(context.size());
  KDN_ASSIGN_OR_RETURN(Scores out, ExpectedAttentionScores(model.config(), model.kv_cache(), seq, n,
                                                           stats, {.sinks = sinks}));
  KDN_ASSIGN_OR_RETURN(Scores first, KvzipScores(model, seq, context, prompts,
                                                 {.sinks = sinks, .layers = kKvzipProfiledLayers}));
  const int layers = std::min(kKvzipProfiledLayers, out.layers);
  std::copy_n(first.v.begin(), size_t(layers) * out.kv_heads * n, out.v.begin());
  return out;
}

}  // namespace kdn::prune
