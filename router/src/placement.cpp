#include "kdn/router/placement.h"

#include <algorithm>
#include <climits>
#include <cmath>

namespace kdn::router {

void Ledger::Reserve(size_t prefill, size_t decode, int64_t prompt_tokens, int64_t kv_blocks) {
  ++rows_.at(decode).requests;
  rows_.at(decode).kv_blocks += kv_blocks;
  rows_.at(prefill).prefill_tokens += prompt_tokens;
}

void Ledger::ReserveLocal(size_t decode, int64_t prompt_tokens, int64_t kv_blocks) {
  ++rows_.at(decode).requests;
  rows_.at(decode).kv_blocks += kv_blocks;
  rows_.at(decode).local_tokens += prompt_tokens;
}

void Ledger::MarkFull(size_t decode, const WorkerView& reported) {
  rows_.at(decode).kv_blocks = reported.free_kv_blocks;
}

Load LoadOf(const WorkerView& reported, const Reservation& reserved) {
  return {reported.queue_depth + reserved.requests, reported.free_kv_blocks - reserved.kv_blocks,
          reported.queue_tokens + reserved.prefill_tokens};
}

namespace {

// Whether decode worker `w` has room for the request: KV for what it needs
// now and a place in its batch.
bool HasRoom(const WorkerView& v, const Load& load, int64_t kv_blocks) {
  return load.free_kv_blocks >= kv_blocks && (v.max_batch <= 0 || load.queue_depth < v.max_batch);
}

int64_t ResidentAt(const PlacementInput& in, size_t w) {
  if (in.resident == nullptr || in.blend != nullptr) return 0;
  const auto it = in.resident->find(w);
  return it == in.resident->end() ? 0 : it->second;
}

}  // namespace

std::optional<size_t> PlacePrefill(const WorkerViews& workers, const Ledger& ledger,
                                   const PlacementInput& in) {
  const int64_t n = in.tokens;
  std::optional<size_t> best;
  int64_t best_cost = INT64_MAX, best_resident = -1;
  for (const auto& [w, held_tokens] : *in.prefix) {
    if (held_tokens < 0 || !Usable(workers[w], Role::kPrefill)) continue;
    int64_t cost = 0;
    if (in.blend != nullptr) {
      // Held documents cost their recomputed share; the rest is computed.
      const auto it = in.segment_tokens_held->find(w);
      const double held =
          it == in.segment_tokens_held->end() ? 0.0 : static_cast<double>(it->second);
      cost = n - static_cast<int64_t>(held * (1.0 - in.blend->recompute_ratio));
    } else {
      cost = TokensToCompute(in, w);
    }
    cost += LoadOf(workers[w], ledger.at(w)).queue_tokens;
    const int64_t resident = ResidentAt(in, w);
    if (cost < best_cost || (cost == best_cost && resident > best_resident)) {
      best_cost = cost;
      best_resident = resident;
      best = w;
    }
  }
  return best;
}

DecodePlacement PlaceDecode(const WorkerViews& workers, const Ledger& ledger,
                            const PlacementInput& in) {
  DecodePlacement out;
  int64_t best_prefix = -1, best_resident = -1;
  int best_depth = INT32_MAX;
  bool up = false, could_hold = false, found = false;
  for (auto [w, held_tokens] : *in.prefix) {
    if (held_tokens < 0 || !Usable(workers[w], Role::kDecode)) continue;
    const WorkerView& v = workers[w];
    const Load load = LoadOf(v, ledger.at(w));
    up = true;
    // A worker that could never hold it is no reason to wait.
    could_hold |= v.total_kv_blocks <= 0 || v.total_kv_blocks >= in.kv_blocks_whole;
    if (!HasRoom(v, load, in.kv_blocks)) continue;
    if (in.blend != nullptr) held_tokens = 0;  // a blended prompt reuses nothing it holds
    const int64_t resident = ResidentAt(in, w);
    if (held_tokens > best_prefix ||
        (held_tokens == best_prefix &&
         (resident > best_resident ||
          (resident == best_resident && load.queue_depth < best_depth)))) {
      best_prefix = held_tokens;
      best_resident = resident;
      best_depth = load.queue_depth;
      out.worker = w;
      found = true;
    }
  }
  using V = DecodePlacement::Verdict;
  out.verdict = found ? V::kRoute : !up ? V::kNoneUp : could_hold ? V::kWait : V::kTooLarge;
  return out;
}

int64_t TokensToCompute(const PlacementInput& in, size_t w) {
  const auto it = in.prefix->find(w);
  const int64_t held = it == in.prefix->end() ? 0 : std::max<int64_t>(it->second, 0);
  return in.tokens - std::min(held, in.tokens - 1);
}

bool PrefillLocally(const WorkerViews& workers, const Ledger& ledger, const PlacementInput& in,
                    size_t p, size_t d, Disaggregation mode, int64_t max_local_tokens) {
  if (in.blend != nullptr || in.resumed || mode == Disaggregation::kAlways) return false;
  if (mode == Disaggregation::kNever) return true;
  const int64_t local_tokens = TokensToCompute(in, d);
  if (local_tokens > max_local_tokens) return false;
  const proto::LocalPrefill& lp = workers[d].local_prefill;
  const double backlog =
      static_cast<double>(lp.backlog_tokens() + ledger.at(d).local_tokens + local_tokens);
  double local = backlog;
  if (lp.running() > 0) {
    // Pieces of step_tokens, each after a decode step of the running batch.
    const double step_tokens = lp.step_tokens() > 0 ? lp.step_tokens() : 64;
    const double step_cost = lp.step_ms() > 0 && lp.prefill_ms_per_token() > 0
                                 ? lp.step_ms() / lp.prefill_ms_per_token()
                                 : step_tokens;
    local += std::ceil(backlog / step_tokens) * step_cost;
  }
  const double remote =
      static_cast<double>(TokensToCompute(in, p) + LoadOf(workers[p], ledger.at(p)).queue_tokens);
  return local <= remote;
}

std::optional<size_t> PlaceRetry(const WorkerViews& workers, const Ledger& ledger, size_t lost) {
  std::optional<size_t> best;
  int64_t best_tokens = 0;
  for (size_t w = 0; w < workers.size(); ++w) {
    if (w == lost || !Usable(workers[w], Role::kPrefill)) continue;
    const int64_t tokens = LoadOf(workers[w], ledger.at(w)).queue_tokens;
    if (!best || tokens < best_tokens) {
      best = w;
      best_tokens = tokens;
    }
  }
  return best;
}

std::optional<size_t> PlaceDocument(const WorkerViews& workers, const Ledger& ledger,
                                    const std::vector<int>& in_flight, int per_worker) {
  std::optional<size_t> best;
  for (size_t w = 0; w < workers.size(); ++w) {
    if (!Usable(workers[w], Role::kPrefill) || in_flight[w] >= per_worker) continue;
    if (!best || in_flight[w] < in_flight[*best] ||
        (in_flight[w] == in_flight[*best] &&
         LoadOf(workers[w], ledger.at(w)).queue_tokens <
             LoadOf(workers[*best], ledger.at(*best)).queue_tokens)) {
      best = w;
    }
  }
  return best;
}

}  // namespace kdn::router
