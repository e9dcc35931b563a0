#include "kdn/blend/blend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

namespace kdn::blend {

namespace {

// Places the cached segments' KV into a sequence layer by layer, in layer
// order, on its own thread or inline. WaitFor(l) returns once layers 0..l
// that need placing are in the cache.
class Placer {
 public:
  struct Item {
    const kvbus::Chunk* kv;
    int64_t at;  // where the segment starts in the prompt
    int64_t len;
    int64_t delta;  // at - the position its K was rotated for
  };

  Placer(engine::Engine& model, engine::KvSequence& seq, std::vector<Item> items, int first_layer,
         bool threaded)
      : model_(model), seq_(seq), items_(std::move(items)), first_layer_(first_layer) {
    placed_ = first_layer_;  // layers below first_layer_ need nothing
    if (threaded && !items_.empty()) {
      thread_ = std::thread([this] { Run(); });
    } else {
      Run();
    }
  }
  ~Placer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }

  Status WaitFor(int layer) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return placed_ > layer || !error_.ok(); });
    return placed_ > layer ? Status::Ok() : error_;
  }

 private:
  void Run() {
    const int layers = model_.config().num_layers;
    for (int l = first_layer_; l < layers && !stop_; ++l) {
      Status st;
      for (const Item& it : items_) {
        st = kvbridge::ChunkLayerToPagedKv(*it.kv, l, model_.kv_cache(), seq_, it.at);
        if (st.ok()) st = model_.RotateCachedKeys(seq_, it.at, it.len, it.delta, l);
        if (!st.ok()) break;
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (!st.ok()) {
        error_ = st;
        cv_.notify_all();
        return;
      }
      placed_ = l + 1;
      cv_.notify_all();
    }
  }

  engine::Engine& model_;
  engine::KvSequence& seq_;
  const std::vector<Item> items_;
  const int first_layer_;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  int placed_ = 0;
  Status error_;
  std::thread thread_;
};

}  // namespace

Result<BlendResult> BlendPrefill(engine::Engine& model, engine::KvSequence& seq,
                                 std::span<const Segment> segments, std::span<const int32_t> suffix,
                                 const BlendOptions& options) {
  const model::ModelConfig& cfg = model.config();
  KDN_ASSIGN_OR_RETURN(
      const std::vector<control::CheckStep> checks,
      control::CheckSchedule(options.recompute_ratio, options.check_layer, options.check_layers,
                             options.check_ratios, cfg.num_layers));
  if (suffix.empty()) return InvalidArgument("blend: the suffix (the question) is empty");
  if (seq.length() != 0) return InvalidArgument("blend: the sequence must start empty");

  // The prompt, which of its positions come from a cache, and where each
  // cached segment goes.
  engine::KvCache& cache = model.kv_cache();
  std::vector<int32_t> tokens;
  std::vector<bool> cached;
  std::vector<Placer::Item> items;
  for (const Segment& s : segments) {
    const auto at = static_cast<int64_t>(tokens.size());
    const auto len = static_cast<int64_t>(s.tokens.size());
    if (s.kv != nullptr) {
      const kvbus::ChunkInfo& info = s.kv->info();
      if (info.tokens != static_cast<uint32_t>(len)) {
        return InvalidArgument("blend: a segment of " + std::to_string(len) +
                               " tokens came with KV of " + std::to_string(info.tokens));
      }
      if (static_cast<int>(info.layers) != cache.num_layers() ||
          static_cast<int>(info.kv_heads) != cache.num_kv_heads() ||
          static_cast<int>(info.head_dim) != cache.head_dim()) {
        return InvalidArgument("blend: segment KV " + info.key.ToHex() +
                               " does not fit the model's cache");
      }
      if (len > 0) items.push_back({s.kv.get(), at, len, at - info.position});
    }
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
  KDN_RETURN_IF_ERROR(cache.Reserve(seq, n));
  cache.SetLength(seq, n);

  BlendResult out;
  std::vector<int64_t> cached_rows, fresh_rows;
  for (int64_t p = 0; p < n; ++p) (cached[p] ? cached_rows : fresh_rows).push_back(p);
  out.cached_tokens = static_cast<int>(cached_rows.size());
  out.computed_tokens = static_cast<int>(fresh_rows.size());
  auto kept_of = [&](double ratio) {
    return static_cast<int64_t>(std::ceil(ratio * static_cast<double>(cached_rows.size()) - 1e-9));
  };
  const bool reuse_only = kept_of(options.recompute_ratio) == 0;

  // 1. Place and rotate the cached KV, from the first layer that reads it:
  // with a check, every token is recomputed below the first check layer.
  const int first_placed = reuse_only ? 0 : checks.front().layer;
  auto run = [&]() -> Status {
    std::vector<int64_t> rows;
    if (reuse_only) {
      rows = fresh_rows;  // full reuse recomputes only the fresh rows
    } else {
      rows.resize(n);  // 2. every row up to the first check layer
      std::iota(rows.begin(), rows.end(), 0);
    }
    KDN_ASSIGN_OR_RETURN(auto pass, model.BeginRowPass(seq, tokens, rows));
    engine::RowPass& rp = *pass;
    // Declared after the pass, so stopped (joined) before it goes.
    Placer placer(model, seq, std::move(items), first_placed, options.overlap_load);
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    auto seconds_since = [](Clock::time_point t) {
      return std::chrono::duration<double>(Clock::now() - t).count();
    };
    auto run_layer = [&](std::vector<float>* deviation) -> Status {
      const int l = rp.next_layer();
      const auto wait = Clock::now();
      KDN_RETURN_IF_ERROR(placer.WaitFor(l));
      out.load_wait_seconds += seconds_since(wait);
      KDN_RETURN_IF_ERROR(rp.RunLayer(deviation));
      return options.on_layer ? options.on_layer(l) : Status::Ok();
    };
    if (!reuse_only) {
      for (size_t i = 0; i < checks.size(); ++i) {
        while (rp.next_layer() < checks[i].layer) KDN_RETURN_IF_ERROR(run_layer(nullptr));
        std::vector<float> deviation;
        KDN_RETURN_IF_ERROR(run_layer(&deviation));
        // 3. The cached rows to go on with, among those still recomputed.
        const int64_t keep =
            std::min(kept_of(checks[i].ratio),
                     static_cast<int64_t>(rp.positions().size() - fresh_rows.size()));
        const std::vector<int64_t> chosen = ChooseRows(rp.positions(), cached, deviation, keep,
                                                       options.selection, options.seed + i);
        KDN_RETURN_IF_ERROR(rp.Keep(chosen));
        out.kept_at_check.push_back(static_cast<int>(keep));
      }
      out.recomputed_tokens = out.kept_at_check.back();
      out.check_seconds = seconds_since(start);
    }
    // 4. The remaining layers over the fused cache.
    while (rp.next_layer() < cfg.num_layers) KDN_RETURN_IF_ERROR(run_layer(nullptr));
    return rp.Logits(&out.logits);
  };
  // The placer has stopped by now, so the blocks can go.
  if (Status st = run(); !st.ok()) {
    seq.Reset();
    return st;
  }
  return out;
}

std::vector<int64_t> ChooseRows(std::span<const int64_t> positions, const std::vector<bool>& cached,
                                std::span<const float> deviation, int64_t keep, Selection selection,
                                uint64_t seed) {
  std::vector<int64_t> out, candidates;
  for (size_t i = 0; i < positions.size(); ++i) {
    (cached[positions[i]] ? candidates : out).push_back(static_cast<int64_t>(i));
  }
  if (selection == Selection::kDeviation) {
    std::stable_sort(candidates.begin(), candidates.end(),
                     [&](int64_t a, int64_t b) { return deviation[a] > deviation[b]; });
  } else {
    std::mt19937_64 rng(seed);
    std::shuffle(candidates.begin(), candidates.end(), rng);
  }
  candidates.resize(
      static_cast<size_t>(std::clamp<int64_t>(keep, 0, static_cast<int64_t>(candidates.size()))));
  out.insert(out.end(), candidates.begin(), candidates.end());
  std::sort(out.begin(), out.end());
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
