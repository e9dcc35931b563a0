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
  using Item = PlacedSegment;

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
        st = it.head_slots.empty()
                 ? kvbridge::ChunkLayerToPagedKv(*it.kv, l, model_.kv_cache(), seq_, it.at)
                 : kvbridge::HeadPrunedLayerToSlots(*it.kv, l, it.head_slots, model_.kv_cache(),
                                                    seq_, it.at);
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

int64_t SegmentSlots(const kvbus::ChunkInfo& info) {
  return info.per_head() ? static_cast<int64_t>(kvbridge::HeadPrunedSlots(info).size())
                         : static_cast<int64_t>(info.tokens);
}

Result<BlendResult> BlendPrefill(engine::Engine& model, engine::KvSequence& seq,
                                 std::span<const Segment> segments, std::span<const int32_t> suffix,
                                 const BlendOptions& options) {
  const model::ModelConfig& cfg = model.config();
  const blend::BlendSpec& spec = options.spec;
  KDN_ASSIGN_OR_RETURN(std::vector<blend::CheckStep> checks,
                       blend::CheckSchedule(spec.recompute_ratio, spec.check_layer,
                                            spec.check_layers, spec.check_ratios, cfg.num_layers));
  if (!(spec.max_kl >= 0)) return InvalidArgument("blend: max_kl may not be negative");
  if (suffix.empty()) return InvalidArgument("blend: the suffix (the question) is empty");
  if (seq.length() != 0) return InvalidArgument("blend: the sequence must start empty");
  const SelectionPolicy chooser = options.policy ? options.policy : PolicyFor(spec.selection);
  std::vector<bool> pinned;  // by slot: Segment::pinned, filled below
  // The policy's choice less the pinned rows.
  const auto policy = [&](const SelectionInput& in) {
    std::vector<int64_t> chosen = chooser(in);
    std::erase_if(chosen, [&](int64_t r) {
      return pinned[static_cast<size_t>(in.positions[static_cast<size_t>(r)])];
    });
    return chosen;
  };

  // The prompt's KV slots: each one's token, its position, whether its KV
  // comes from a cache, and where each cached segment goes. A pruned
  // segment fills a slot for each token it kept; slots and positions agree
  // up to the first one.
  engine::KvCache& cache = model.kv_cache();
  std::vector<int32_t> tokens;
  std::vector<int64_t> slot_at;
  std::vector<bool> cached;
  std::vector<Placer::Item> items;
  std::vector<DocumentSpan> documents;
  // Per-head segments' first slots and holes (kvbridge::HeadPrunedHoles).
  std::vector<std::pair<int64_t, std::vector<uint8_t>>> head_holes;
  int64_t logical = 0, dropped = 0;
  for (const Segment& s : segments) {
    const auto slot = static_cast<int64_t>(tokens.size());
    const auto len = static_cast<int64_t>(s.tokens.size());
    const kvbus::ChunkInfo* info = s.kv != nullptr ? &s.kv->info() : nullptr;
    std::vector<uint32_t> head_slots;  // a per-head segment's
    if (info != nullptr) {
      if (info->logical() != static_cast<uint32_t>(len)) {
        return InvalidArgument("blend: a segment of " + std::to_string(len) +
                               " tokens came with KV of " + std::to_string(info->logical()));
      }
      if (static_cast<int>(info->layers) != cache.num_layers() ||
          static_cast<int>(info->kv_heads) != cache.num_kv_heads() ||
          static_cast<int>(info->head_dim) != cache.head_dim()) {
        return InvalidArgument("blend: segment KV " + info->key.ToHex() +
                               " does not fit the model's cache");
      }
      if (info->per_head()) {
        if (spec.selection.query()) {
          return Unimplemented("blend: segment KV " + info->key.ToHex() +
                               " is pruned per head, which the query selections do not take");
        }
        head_slots = kvbridge::HeadPrunedSlots(*info);
        head_holes.push_back({slot, kvbridge::HeadPrunedHoles(*info, head_slots)});
      }
      const auto count = info->per_head() ? static_cast<int64_t>(head_slots.size())
                                          : static_cast<int64_t>(info->tokens);
      if (len > 0) {
        // Kept or not, each K turns by the same angle: to where the segment sits.
        documents.push_back({slot, count});
        items.push_back({s.kv.get(), slot, count, logical - info->position, head_slots});
      }
    }
    if (info != nullptr && info->per_head()) {
      for (uint32_t offset : head_slots) {
        tokens.push_back(s.tokens[offset]);
        slot_at.push_back(logical + offset);
      }
      dropped += len - static_cast<int64_t>(head_slots.size());
    } else if (info != nullptr && info->pruned()) {
      for (uint32_t offset : info->kept) {
        tokens.push_back(s.tokens[offset]);
        slot_at.push_back(logical + offset);
      }
      dropped += len - info->tokens;
    } else {
      tokens.insert(tokens.end(), s.tokens.begin(), s.tokens.end());
      for (int64_t i = 0; i < len; ++i) slot_at.push_back(logical + i);
    }
    cached.insert(cached.end(), tokens.size() - static_cast<size_t>(slot), info != nullptr);
    pinned.resize(tokens.size(), false);
    for (int64_t j : s.pinned) {
      if (info == nullptr || j < 0 || j >= static_cast<int64_t>(tokens.size()) - slot) {
        return InvalidArgument("blend: a pinned slot " + std::to_string(j) +
                               " outside the segment's cached KV");
      }
      pinned[static_cast<size_t>(slot + j)] = true;
    }
    logical += len;
  }
  tokens.insert(tokens.end(), suffix.begin(), suffix.end());
  for (size_t i = 0; i < suffix.size(); ++i) slot_at.push_back(logical + static_cast<int64_t>(i));
  cached.insert(cached.end(), suffix.size(), false);
  pinned.resize(cached.size(), false);
  logical += static_cast<int64_t>(suffix.size());
  const auto n = static_cast<int64_t>(tokens.size());
  if (logical > cfg.max_context) {
    return InvalidArgument("blend: a prompt of " + std::to_string(logical) +
                           " tokens exceeds the model's context of " +
                           std::to_string(cfg.max_context));
  }
  // The query policies' pass, before the prompt takes its blocks.
  std::vector<float> attention;
  int question_pass = 0;
  if (spec.selection.query()) {
    KDN_ASSIGN_OR_RETURN(
        attention,
        QuestionAttention(model, items, n, suffix, logical - static_cast<int64_t>(suffix.size())));
    question_pass = static_cast<int>(suffix.size());
  }
  KDN_RETURN_IF_ERROR(cache.Reserve(seq, n));
  cache.SetLength(seq, n);
  if (dropped > 0) KDN_RETURN_IF_ERROR(seq.SetNextPosition(logical));
  if (!head_holes.empty()) {
    // Up to the last per-head segment's end: [layer][kv_head][slot].
    const size_t heads = size_t(cfg.num_layers) * cfg.num_kv_heads;
    const auto& [last_at, last] = head_holes.back();
    const int64_t end = last_at + static_cast<int64_t>(last.size() / heads);
    std::vector<uint8_t> holes(heads * static_cast<size_t>(end), 0);
    for (const auto& [at, seg] : head_holes) {
      const size_t len = seg.size() / heads;
      for (size_t i = 0; i < heads; ++i) {
        std::copy_n(seg.begin() + static_cast<int64_t>(i * len), len,
                    holes.begin() + static_cast<int64_t>(i * end + at));
      }
    }
    if (Status st = seq.SetHoles(end, std::move(holes)); !st.ok()) {
      seq.Reset();
      return st;
    }
  }

  BlendResult out;
  out.recompute_ratio = spec.recompute_ratio;
  out.dropped_tokens = static_cast<int>(dropped);
  out.question_pass_tokens = question_pass;
  std::vector<int64_t> cached_rows, fresh_rows, all_rows(static_cast<size_t>(n));
  std::iota(all_rows.begin(), all_rows.end(), 0);
  for (int64_t p = 0; p < n; ++p) (cached[p] ? cached_rows : fresh_rows).push_back(p);
  out.cached_tokens = static_cast<int>(cached_rows.size());
  out.computed_tokens = static_cast<int>(fresh_rows.size());
  auto kept_of = [&](double ratio) {
    return static_cast<int64_t>(std::ceil(ratio * static_cast<double>(cached_rows.size()) - 1e-9));
  };
  // With checks (deviation, random, boundary+deviation) every row is
  // computed up to the first check layer; without (full reuse, boundary),
  // the rows the policy chose before layer 0 are all that is computed.
  const bool checked = spec.selection.checks() && kept_of(spec.recompute_ratio) > 0;
  std::vector<int64_t> rows = fresh_rows;
  if (checked) {
    rows = all_rows;
  } else if (!spec.selection.checks()) {
    // Indices into all_rows are positions. Boundary keeps its K a document
    // whatever the budget; the query policies spend the request's.
    rows = policy(
        SelectionInput{.positions = all_rows,
                       .cached = cached,
                       .documents = documents,
                       .keep = spec.selection.uses_ratio() ? kept_of(spec.recompute_ratio) : 0,
                       .seed = options.seed,
                       .attention = attention});
    out.recomputed_tokens = static_cast<int>(rows.size() - fresh_rows.size());
    out.kept_at_check.push_back(out.recomputed_tokens);
  }

  // 1. Place and rotate the cached KV, from the first layer that reads it:
  // with a check, every token is recomputed below the first check layer.
  const int first_placed = checked ? checks.front().layer : 0;
  auto run = [&]() -> Status {
    KDN_ASSIGN_OR_RETURN(auto pass,
                         model.BeginRowPass(seq, tokens, rows,
                                            dropped > 0 ? std::span<const int64_t>(slot_at)
                                                        : std::span<const int64_t>()));
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
    if (checked) {
      for (size_t i = 0; i < checks.size(); ++i) {
        while (rp.next_layer() < checks[i].layer) KDN_RETURN_IF_ERROR(run_layer(nullptr));
        std::vector<float> deviation;
        KDN_RETURN_IF_ERROR(run_layer(&deviation));
        if (i == 0) {
          // Every cached row is still here: the residual of the ratio, and
          // with a quality target the ratio it needs.
          std::vector<float> dev;
          for (size_t r = 0; r < rp.positions().size(); ++r) {
            if (cached[static_cast<size_t>(rp.positions()[r])]) dev.push_back(deviation[r]);
          }
          if (spec.max_kl > 0) {
            const double ratio =
                TargetRatio(dev, spec.recompute_ratio, spec.max_kl, options.kl_per_residual);
            if (ratio != spec.recompute_ratio) {
              KDN_ASSIGN_OR_RETURN(
                  checks, blend::CheckSchedule(ratio, spec.check_layer, spec.check_layers, {},
                                               cfg.num_layers));
              out.recompute_ratio = ratio;
            }
          }
          out.residual = ResidualShare(dev, kept_of(out.recompute_ratio));
        }
        // 3. The cached rows to go on with, among those still recomputed.
        const int64_t keep =
            std::min(kept_of(checks[i].ratio),
                     static_cast<int64_t>(rp.positions().size() - fresh_rows.size()));
        const std::vector<int64_t> chosen = policy(SelectionInput{.positions = rp.positions(),
                                                                  .cached = cached,
                                                                  .deviation = deviation,
                                                                  .documents = documents,
                                                                  .keep = keep,
                                                                  .seed = options.seed + i});
        KDN_RETURN_IF_ERROR(rp.Keep(chosen));
        out.kept_at_check.push_back(static_cast<int>(chosen.size() - fresh_rows.size()));
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

namespace {

// The current rows split: uncached ones (always kept) and cached ones.
void SplitRows(const SelectionInput& in, std::vector<int64_t>* kept,
               std::vector<int64_t>* candidates) {
  for (size_t i = 0; i < in.positions.size(); ++i) {
    (in.cached[static_cast<size_t>(in.positions[i])] ? candidates : kept)
        ->push_back(static_cast<int64_t>(i));
  }
}

// `kept` plus the first `keep` of `candidates`, ascending.
std::vector<int64_t> Take(std::vector<int64_t> kept, std::vector<int64_t> candidates,
                          int64_t keep) {
  candidates.resize(
      static_cast<size_t>(std::clamp<int64_t>(keep, 0, static_cast<int64_t>(candidates.size()))));
  kept.insert(kept.end(), candidates.begin(), candidates.end());
  std::sort(kept.begin(), kept.end());
  return kept;
}

void ByDeviation(const SelectionInput& in, std::vector<int64_t>* rows) {
  std::stable_sort(rows->begin(), rows->end(),
                   [&](int64_t a, int64_t b) { return in.deviation[a] > in.deviation[b]; });
}

// Most attended first (rows indexed as positions' slots), ties to the
// earlier row.
void ByAttention(const SelectionInput& in, std::vector<int64_t>* rows) {
  auto of = [&](int64_t r) {
    const auto p = static_cast<size_t>(in.positions[static_cast<size_t>(r)]);
    return p < in.attention.size() ? in.attention[p] : 0.0f;
  };
  std::stable_sort(rows->begin(), rows->end(), [&](int64_t a, int64_t b) { return of(a) > of(b); });
}

bool IsBoundary(const SelectionInput& in, int64_t position, int k) {
  for (const DocumentSpan& d : in.documents) {
    if (position >= d.first && position < d.first + std::min<int64_t>(k, d.count)) return true;
  }
  return false;
}

// The first K of each document always, and the rest of the budget in the
// order `order` sorts the other cached rows into.
std::vector<int64_t> BoundaryThen(const SelectionInput& in, int boundary_tokens,
                                  void (*order)(const SelectionInput&, std::vector<int64_t>*)) {
  std::vector<int64_t> kept, candidates, rest;
  SplitRows(in, &kept, &candidates);
  int64_t boundary = 0;
  for (int64_t r : candidates) {
    if (IsBoundary(in, in.positions[static_cast<size_t>(r)], boundary_tokens)) {
      kept.push_back(r);
      ++boundary;
    } else {
      rest.push_back(r);
    }
  }
  order(in, &rest);
  return Take(std::move(kept), std::move(rest), in.keep - boundary);
}

}  // namespace

std::vector<int64_t> DeviationRows(const SelectionInput& in) {
  std::vector<int64_t> kept, candidates;
  SplitRows(in, &kept, &candidates);
  ByDeviation(in, &candidates);
  return Take(std::move(kept), std::move(candidates), in.keep);
}

std::vector<int64_t> RandomRows(const SelectionInput& in) {
  std::vector<int64_t> kept, candidates;
  SplitRows(in, &kept, &candidates);
  std::mt19937_64 rng(in.seed);
  std::shuffle(candidates.begin(), candidates.end(), rng);
  return Take(std::move(kept), std::move(candidates), in.keep);
}

std::vector<int64_t> BoundaryRows(const SelectionInput& in, int boundary_tokens) {
  std::vector<int64_t> kept, candidates;
  SplitRows(in, &kept, &candidates);
  for (int64_t r : candidates) {
    if (IsBoundary(in, in.positions[static_cast<size_t>(r)], boundary_tokens)) kept.push_back(r);
  }
  std::sort(kept.begin(), kept.end());
  return kept;
}

std::vector<int64_t> BoundaryDeviationRows(const SelectionInput& in, int boundary_tokens) {
  return BoundaryThen(in, boundary_tokens, ByDeviation);
}

std::vector<int64_t> QueryRows(const SelectionInput& in) {
  std::vector<int64_t> kept, candidates;
  SplitRows(in, &kept, &candidates);
  ByAttention(in, &candidates);
  return Take(std::move(kept), std::move(candidates), in.keep);
}

std::vector<int64_t> QueryBoundaryRows(const SelectionInput& in, int boundary_tokens) {
  return BoundaryThen(in, boundary_tokens, ByAttention);
}

double ResidualShare(std::span<const float> cached_deviation, int64_t keep) {
  std::vector<float> d(cached_deviation.begin(), cached_deviation.end());
  std::sort(d.begin(), d.end(), std::greater<float>());
  double total = 0, kept = 0;
  for (size_t i = 0; i < d.size(); ++i) {
    total += d[i];
    if (static_cast<int64_t>(i) < keep) kept += d[i];
  }
  return total > 0 ? (total - kept) / total : 0;
}

double TargetRatio(std::span<const float> cached_deviation, double start, double max_kl,
                   double kl_per_residual) {
  const double n = static_cast<double>(cached_deviation.size());
  auto fits = [&](double ratio) {
    const auto keep = static_cast<int64_t>(std::ceil(ratio * n - 1e-9));
    return kl_per_residual * ResidualShare(cached_deviation, keep) <= max_kl;
  };
  if (fits(start)) return start;
  for (double r : kRatioLadder) {
    if (r > start && fits(r)) return r;
  }
  return 1.0;
}

SelectionPolicy PolicyFor(const blend::BlendSelection& s) {
  using Kind = blend::BlendSelection::Kind;
  const int k = s.boundary_tokens;
  switch (s.kind) {
    case Kind::kRandom: return RandomRows;
    case Kind::kBoundary: return [k](const SelectionInput& in) { return BoundaryRows(in, k); };
    case Kind::kBoundaryDeviation:
      return [k](const SelectionInput& in) { return BoundaryDeviationRows(in, k); };
    case Kind::kQuery: return QueryRows;
    case Kind::kQueryBoundary:
      return [k](const SelectionInput& in) { return QueryBoundaryRows(in, k); };
    case Kind::kDeviation: break;
  }
  return DeviationRows;
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
