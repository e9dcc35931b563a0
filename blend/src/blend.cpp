#include "kdn/blend/blend.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace kdn::blend {

Result<BlendResult> BlendPrefill(engine::Model& model, engine::KvSequence& seq,
                                 std::span<const Segment> segments,
                                 std::span<const int32_t> suffix, const BlendOptions& options) {
  const engine::ModelConfig& cfg = model.config();
  if (!(options.recompute_ratio >= 0.0 && options.recompute_ratio <= 1.0)) {
    return InvalidArgument("recompute_ratio must be in [0, 1]");
  }
  if (options.check_layer < 0 || options.check_layer >= cfg.num_layers) {
    return InvalidArgument("check_layer must be in [0, " + std::to_string(cfg.num_layers) + ")");
  }
  if (suffix.empty()) return InvalidArgument("blend: the suffix (the question) is empty");
  if (seq.length() != 0) return InvalidArgument("blend: the sequence must start empty");

  // The prompt, and which of its positions come from a cache.
  std::vector<int32_t> tokens;
  std::vector<bool> cached;
  for (const Segment& s : segments) {
    tokens.insert(tokens.end(), s.tokens.begin(), s.tokens.end());
    cached.insert(cached.end(), s.tokens.size(), s.kv != nullptr);
  }
  tokens.insert(tokens.end(), suffix.begin(), suffix.end());
  cached.insert(cached.end(), suffix.size(), false);
  const auto n = static_cast<int64_t>(tokens.size());
  if (n > cfg.max_context) {
    return InvalidArgument("blend: a prompt of " + std::to_string(n) +
                           " tokens exceeds the model's context of " +
                           std::to_string(cfg.max_context));
  }

  // 1. Place and rotate the cached KV.
  engine::PagedKvCache& cache = model.kv_cache();
  KDN_RETURN_IF_ERROR(cache.Reserve(seq, n));
  cache.SetLength(seq, n);
  int64_t at = 0;
  for (const Segment& s : segments) {
    const auto len = static_cast<int64_t>(s.tokens.size());
    if (s.kv != nullptr) {
      if (s.kv->info().tokens != static_cast<uint32_t>(len)) {
        seq.Reset();
        return InvalidArgument("blend: a segment of " + std::to_string(len) +
                               " tokens came with KV of " + std::to_string(s.kv->info().tokens));
      }
      Status st = kvbus::ChunkToPagedKv(*s.kv, cache, seq, at);
      if (st.ok()) st = model.RotateCachedKeys(seq, at, len, at - s.kv->info().position);
      if (!st.ok()) {
        seq.Reset();
        return st;
      }
    }
    at += len;
  }

  BlendResult out;
  std::vector<int64_t> cached_rows, fresh_rows;
  for (int64_t p = 0; p < n; ++p) (cached[p] ? cached_rows : fresh_rows).push_back(p);
  out.cached_tokens = static_cast<int>(cached_rows.size());
  out.computed_tokens = static_cast<int>(fresh_rows.size());
  const auto keep_cached = static_cast<int64_t>(
      std::ceil(options.recompute_ratio * static_cast<double>(cached_rows.size()) - 1e-9));

  // 2. Full reuse recomputes only the fresh rows; otherwise every row up to
  // the check layer.
  std::vector<int64_t> rows;
  if (keep_cached == 0) {
    rows = fresh_rows;
  } else {
    rows.resize(n);
    std::iota(rows.begin(), rows.end(), 0);
  }
  auto pass = model.BeginRowPass(seq, tokens, rows);
  if (!pass.ok()) {
    seq.Reset();
    return pass.status();
  }
  engine::Model::RowPass& rp = **pass;
  auto fail = [&](const Status& st) {
    seq.Reset();
    return st;
  };
  if (keep_cached > 0) {
    for (int l = 0; l < options.check_layer; ++l) {
      if (Status st = rp.RunLayer(); !st.ok()) return fail(st);
    }
    std::vector<float> deviation;
    if (Status st = rp.RunLayer(&deviation); !st.ok()) return fail(st);
    // 3. The cached rows to go on with.
    std::vector<int64_t> order = cached_rows;  // positions = row indices here
    if (options.selection == Selection::kDeviation) {
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return deviation[a] > deviation[b]; });
    } else {
      std::mt19937_64 rng(options.seed);
      std::shuffle(order.begin(), order.end(), rng);
    }
    order.resize(static_cast<size_t>(keep_cached));
    std::vector<int64_t> keep = fresh_rows;
    keep.insert(keep.end(), order.begin(), order.end());
    std::sort(keep.begin(), keep.end());
    if (Status st = rp.Keep(keep); !st.ok()) return fail(st);
    out.recomputed_tokens = static_cast<int>(keep_cached);
  }
  // 4. The remaining layers over the fused cache.
  while (rp.next_layer() < cfg.num_layers) {
    if (Status st = rp.RunLayer(); !st.ok()) return fail(st);
  }
  if (Status st = rp.Logits(&out.logits); !st.ok()) return fail(st);
  return out;
}

double KlDivergence(std::span<const float> p_logits, std::span<const float> q_logits) {
  auto log_softmax = [](std::span<const float> l) {
    const double m = *std::max_element(l.begin(), l.end());
    double z = 0;
    for (float v : l) z += std::exp(v - m);
    const double log_z = std::log(z);
    std::vector<double> out(l.size());
    for (size_t i = 0; i < l.size(); ++i) out[i] = l[i] - m - log_z;
    return out;
  };
  const auto lp = log_softmax(p_logits), lq = log_softmax(q_logits);
  double kl = 0;
  for (size_t i = 0; i < lp.size() && i < lq.size(); ++i) kl += std::exp(lp[i]) * (lp[i] - lq[i]);
  return kl;
}

}  // namespace kdn::blend
