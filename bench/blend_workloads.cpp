// kdn-bench rag-blend: k documents in random order plus a question, the
// documents' KV cached as computed alone (segment keys, host tier). Time to
// first token of full prefill, of prefix caching alone (a prompt with the
// same documents in another order was cached before: its prefix keys miss),
// and of CacheBlend at several recompute ratios (with --check-layers, also
// with progressive filtering); and, beside full prefill,
// the KL divergence of the next-token distribution and the agreement of 32
// greedy tokens.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>

#include "bench_util.h"
#include "kdn/blend/blend.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/tiered_store.h"
#include "kdn/kvbridge/paged_chunks.h"

namespace kdn::bench {

namespace {

constexpr int kChunkTokens = 256;

}  // namespace

int RunRagBlend(const Common& c, int docs, int doc_tokens, int question_tokens,
                const std::vector<double>& ratios, int check_layer,
                const std::vector<int>& check_layers, const std::vector<std::string>& selections) {
  std::string what;
  const int64_t prompt_len = 1 + static_cast<int64_t>(docs) * doc_tokens + question_tokens;
  auto model_r = MakeModel(c, 4 * prompt_len + 256, &what);
  if (!model_r.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", model_r.status().ToString().c_str());
    return 1;
  }
  engine::Engine& model = **model_r;
  const model::ModelConfig& cfg = model.config();
  std::mt19937 rng(static_cast<uint32_t>(c.seed) + 17);
  auto random_tokens = [&](int n) {
    std::vector<int32_t> t(n);
    for (int32_t& x : t) x = static_cast<int32_t>(32 + rng() % 95);  // printable bytes
    return t;
  };
  std::vector<std::vector<int32_t>> documents;
  for (int i = 0; i < docs; ++i) documents.push_back(random_tokens(doc_tokens));
  const std::vector<int32_t> question = random_tokens(question_tokens);
  const int32_t bos = cfg.bos_token_id >= 0 ? cfg.bos_token_id : 0;
  auto prompt_of = [&](const std::vector<int>& order) {
    std::vector<int32_t> p{bos};
    for (int i : order) p.insert(p.end(), documents[i].begin(), documents[i].end());
    p.insert(p.end(), question.begin(), question.end());
    return p;
  };
  std::vector<int> order_a(docs), order_b(docs);
  std::iota(order_a.begin(), order_a.end(), 0);
  order_b = order_a;
  std::shuffle(order_b.begin(), order_b.end(), rng);
  if (docs > 1 && order_b[0] == order_a[0]) std::swap(order_b[0], order_b[1]);
  const std::vector<int32_t> prompt = prompt_of(order_b);

  // The KDN: each document's KV computed alone, under its segment key; and
  // the prefix chunks of the same documents in another order.
  std::vector<std::unique_ptr<kvbus::ChunkStore>> tiers;
  tiers.push_back(std::make_unique<kvbus::HostTier>(uint64_t{8} << 30));
  kvbus::TieredStore store(std::move(tiers));
  const kvbus::KeyContext ctx{{0, 42}, "", kChunkTokens};
  engine::KvCache& cache = model.kv_cache();
  const kdn::DType chunk_dtype = model.kv_dtype();  // the engine's own
  for (const auto& d : documents) {
    engine::KvSequence seq = cache.NewSequence();
    std::vector<float> logits;
    auto key = kvbus::SegmentKey(ctx, d);
    if (!model.Prefill(seq, d, {}, &logits).ok()) return 1;
    auto chunk = kvbridge::ChunkFromPagedKv(cache, seq, 0, doc_tokens, key, ctx.model_fingerprint,
                                            chunk_dtype);
    if (!chunk.ok() || !store.Put(*chunk).ok()) return 1;
  }
  {
    const std::vector<int32_t> earlier = prompt_of(order_a);
    engine::KvSequence seq = cache.NewSequence();
    std::vector<float> logits;
    if (!model.Prefill(seq, earlier, {}, &logits).ok()) return 1;
    const auto keys = kvbus::PrefixKeys(ctx, earlier);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto chunk = kvbridge::ChunkFromPagedKv(cache, seq, i * kChunkTokens, kChunkTokens, keys[i],
                                              ctx.model_fingerprint, chunk_dtype);
      if (!chunk.ok() || !store.Put(*chunk).ok()) return 1;
    }
  }

  std::printf(
      "rag-blend on %s: %d documents of %d tokens in a new order + %d-token question "
      "(%lld tokens), check layer %d, best of %d\n",
      what.c_str(), docs, doc_tokens, question_tokens, static_cast<long long>(prompt_len),
      check_layer, c.reps);
  // Full prefill: the reference for time and quality.
  std::vector<float> full_logits;
  double full_s = 1e30;
  std::vector<int32_t> full_greedy;
  for (int r = 0; r < std::max(1, c.reps); ++r) {
    engine::KvSequence seq = cache.NewSequence();
    const auto t0 = Clock::now();
    if (!model.Prefill(seq, prompt, {}, &full_logits).ok()) return 1;
    full_s = std::min(full_s, Seconds(t0, Clock::now()));
    if (r == 0) {
      auto tokens = GreedyTokens(model, seq, full_logits, 32);
      if (!tokens.ok()) {
        std::fprintf(stderr, "kdn-bench: %s\n", tokens.status().ToString().c_str());
        return 1;
      }
      full_greedy = *std::move(tokens);
    }
  }
  // Prefix caching alone.
  double prefix_s = 1e30;
  int64_t prefix_hit = 0;
  for (int r = 0; r < std::max(1, c.reps); ++r) {
    engine::KvSequence seq = cache.NewSequence();
    std::vector<float> logits;
    const auto t0 = Clock::now();
    const auto keys = kvbus::PrefixKeys(ctx, prompt);
    const size_t hits = std::min(store.LongestPrefix(keys), (prompt.size() - 1) / kChunkTokens);
    if (!cache.Reserve(seq, static_cast<int64_t>(prompt.size())).ok()) return 1;
    for (size_t i = 0; i < hits; ++i) {
      auto chunk = store.Get(keys[i]);
      if (!chunk.ok() || !kvbridge::ChunkToPagedKv(**chunk, cache, seq, i * kChunkTokens).ok())
        return 1;
    }
    cache.SetLength(seq, static_cast<int64_t>(hits) * kChunkTokens);
    if (!model.Prefill(seq, std::span(prompt).subspan(hits * kChunkTokens), {}, &logits).ok())
      return 1;
    prefix_s = std::min(prefix_s, Seconds(t0, Clock::now()));
    prefix_hit = static_cast<int64_t>(hits) * kChunkTokens;
  }

  std::printf("%-30s %10s %9s %12s %10s %12s %9s %9s\n", "mode", "TTFT ms", "vs full", "recomputed",
              "KL", "greedy agree", "check ms", "wait ms");
  std::printf("%-30s %10.1f %8.2fx %12lld %10s %12s\n", "full prefill", full_s * 1e3, 1.0,
              static_cast<long long>(prompt_len), "0", "32/32");
  std::printf("%-30s %10.1f %8.2fx %12lld %10s %12s\n", "prefix caching", prefix_s * 1e3,
              full_s / prefix_s, static_cast<long long>(prompt_len - prefix_hit), "0", "32/32");
  json rows = json::array();
  rows.push_back({{"mode", "full"}, {"ttft_s", full_s}});
  rows.push_back({{"mode", "prefix"},
                  {"ttft_s", prefix_s},
                  {"speedup", full_s / prefix_s},
                  {"cached_tokens", prefix_hit}});
  double speedup_015 = 0;
  // Each ratio with the cached KV placed on the loader thread, overlapping
  // the layers' compute (the serving path); 0.15 also placed serially first.
  // With check_layers, each partial ratio also with progressive filtering.
  struct Mode {
    double ratio;
    bool overlap;
    bool progressive = false;
    blend::BlendSelection selection;
  };
  std::vector<Mode> modes;
  for (const std::string& name : selections) {
    auto sel = blend::ParseBlendSelection(name);
    if (!sel.ok()) {
      std::fprintf(stderr, "kdn-bench rag-blend: %s\n", sel.status().message().c_str());
      return 2;
    }
    if (!sel->uses_ratio()) {
      modes.push_back({0, true, false, *sel});
      continue;
    }
    const bool first = name == selections.front();
    for (double ratio : ratios) {
      // 0 and 1 are full reuse and full prefill whatever the selection.
      if (!first && (ratio <= 0 || ratio >= 1)) continue;
      if (first && std::abs(ratio - 0.15) < 1e-9) modes.push_back({ratio, false, false, *sel});
      modes.push_back({ratio, true, false, *sel});
      if (!check_layers.empty() && ratio > 0 && ratio < 1 && sel->checks()) {
        modes.push_back({ratio, true, true, *sel});
      }
    }
  }
  double serial_015 = 0;
  for (const Mode& mode : modes) {
    const double ratio = mode.ratio;
    double best = 1e30;
    blend::BlendResult res;
    std::vector<int32_t> greedy;
    for (int r = 0; r < std::max(1, c.reps); ++r) {
      engine::KvSequence seq = cache.NewSequence();
      const auto t0 = Clock::now();
      std::vector<blend::Segment> segments;
      segments.push_back({{bos}, nullptr});
      for (int i : order_b) {
        auto chunk = store.Get(kvbus::SegmentKey(ctx, documents[i]));
        segments.push_back({documents[i], chunk.ok() ? *chunk : nullptr});
      }
      auto out = blend::BlendPrefill(
          model, seq, segments, question,
          {.spec = {.recompute_ratio = ratio,
                    .check_layer = check_layer,
                    .check_layers = mode.progressive ? check_layers : std::vector<int>{},
                    .selection = mode.selection},
           .overlap_load = mode.overlap});
      if (!out.ok()) {
        std::fprintf(stderr, "kdn-bench: %s\n", out.status().ToString().c_str());
        return 1;
      }
      best = std::min(best, Seconds(t0, Clock::now()));
      res = *std::move(out);
      if (r == 0) {
        auto tokens = GreedyTokens(model, seq, res.logits, 32);
        if (!tokens.ok()) {
          std::fprintf(stderr, "kdn-bench: %s\n", tokens.status().ToString().c_str());
          return 1;
        }
        greedy = *std::move(tokens);
      }
    }
    int agree = 0;
    for (size_t i = 0; i < greedy.size() && i < full_greedy.size(); ++i) {
      agree += greedy[i] == full_greedy[i];
    }
    const double kl = blend::KlDivergence(full_logits, res.logits);
    const std::string sel = blend::BlendSelectionName(mode.selection);
    const bool deviation = mode.selection == blend::BlendSelection{};
    char name[64];
    if (!mode.selection.uses_ratio()) {
      std::snprintf(name, sizeof(name), "%s", sel.c_str());
    } else {
      std::snprintf(name, sizeof(name), "%s %.2f%s", deviation ? "blend" : sel.c_str(), ratio,
                    mode.progressive ? " progressive"
                    : mode.overlap   ? ""
                                     : " serial load");
    }
    std::printf("%-30s %10.1f %8.2fx %12d %10.3g %9d/32 %9.1f %9.1f\n", name, best * 1e3,
                full_s / best,
                res.recomputed_tokens + res.computed_tokens + res.question_pass_tokens, kl, agree,
                res.check_seconds * 1e3, res.load_wait_seconds * 1e3);
    if (deviation && std::abs(ratio - 0.15) < 1e-9 && !mode.progressive) {
      (mode.overlap ? speedup_015 : serial_015) = full_s / best;
    }
    rows.push_back({{"mode", mode.progressive ? "blend-progressive"
                             : mode.overlap   ? "blend"
                                              : "blend-serial-load"},
                    {"selection", sel},
                    {"ratio", mode.selection.uses_ratio() ? json(ratio) : json(nullptr)},
                    {"ttft_s", best},
                    {"speedup", full_s / best},
                    {"recomputed_tokens", res.recomputed_tokens},
                    {"question_pass_tokens", res.question_pass_tokens},
                    {"kl", kl},
                    {"greedy_agreement", agree / 32.0},
                    {"check_s", res.check_seconds},
                    {"load_wait_s", res.load_wait_seconds}});
  }
  if (speedup_015 > 0) {
    std::printf("blend at 0.15 vs full prefill: %.2fx lower TTFT (aim: at least 3x)", speedup_015);
    if (serial_015 > 0) {
      std::printf("; %.2fx with the KV placed before the compute instead of beside it", serial_015);
    }
    std::printf("\n");
  }
  Emit(c, {{"workload", "rag-blend"},
           {"model", what},
           {"documents", docs},
           {"doc_tokens", doc_tokens},
           {"question_tokens", question_tokens},
           {"check_layer", check_layer},
           {"check_layers", check_layers},
           {"rows", rows},
           {"blend_015_speedup", speedup_015},
           {"machine", Machine(c)}});
  return 0;
}

}  // namespace kdn::bench
