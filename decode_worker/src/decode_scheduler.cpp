#include "kdn/decode_worker/decode_scheduler.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

namespace kdn::decode_worker {

DecodeScheduler::Entry* DecodeScheduler::Find(uint64_t id) {
  auto it = entries_.find(id);
  return it == entries_.end() ? nullptr : &it->second;
}

std::optional<RequestPhase> DecodeScheduler::Phase(uint64_t id) const {
  auto it = entries_.find(id);
  if (it == entries_.end()) return std::nullopt;
  return it->second.phase;
}

int DecodeScheduler::Running() const {
  int n = 0;
  for (const auto& [id, e] : entries_) n += e.phase == RequestPhase::kRunning;
  return n;
}

DecodeScheduler::Counts DecodeScheduler::counts() const {
  Counts c;
  for (const auto& [id, e] : entries_) {
    switch (e.phase) {
      case RequestPhase::kRunning: ++c.running; break;
      case RequestPhase::kPreempted:
        ++c.preempted;
        c.resume_blocks += e.resume_blocks;
        break;
      default:
        ++c.prepared;
        if (e.local) c.local_backlog_tokens += std::max<int64_t>(e.tokens - e.have, 0);
    }
  }
  return c;
}

Status DecodeScheduler::CanPrepare() const {
  const Counts c = counts();
  const int taken = c.prepared + c.running + c.preempted;
  if (taken >= options_.max_batch) {
    return ResourceExhausted("decode batch is full (" + std::to_string(taken) + " of " +
                             std::to_string(options_.max_batch) +
                             " requests running, prepared or preempted)");
  }
  if (c.preempted > 0) {
    return ResourceExhausted(std::to_string(c.preempted) +
                             " preempted requests wait for KV blocks to resume first");
  }
  return Status::Ok();
}

int64_t DecodeScheduler::ReserveBlocks(int64_t total_blocks) const {
  // Alone, a request that fits the pool is never kept out by the reserve.
  if (entries_.empty()) return 0;
  return static_cast<int64_t>(
      std::floor(static_cast<double>(total_blocks) * options_.admission_reserve));
}

Status DecodeScheduler::LeavesReserve(int64_t free_blocks, int64_t total_blocks) const {
  const int64_t reserve = ReserveBlocks(total_blocks);
  if (free_blocks >= reserve) return Status::Ok();
  return ResourceExhausted("its reservation would leave " + std::to_string(free_blocks) +
                           " KV blocks free, under the " + std::to_string(reserve) +
                           " kept for the running requests to grow into");
}

void DecodeScheduler::Prepared(uint64_t id, const PreparedInfo& info, TimePoint now) {
  Entry e;
  e.local = info.local;
  e.blended = info.blended;
  e.tokens = info.tokens;
  e.have = info.have;
  e.renewed = now;
  e.phase = info.loading ? RequestPhase::kLoading
                         : (info.local ? RequestPhase::kLocal : RequestPhase::kReady);
  entries_[id] = e;
  if (e.phase == RequestPhase::kLocal) local_queue_.push_back(id);
}

DecodeScheduler::Next DecodeScheduler::LoadIn(uint64_t id, int64_t have) {
  Entry* e = Find(id);
  if (e == nullptr || e->phase != RequestPhase::kLoading) return Next::kWaitForStart;
  e->have = std::max(e->have, have);
  if (e->local) {
    e->phase = RequestPhase::kLocal;
    local_queue_.push_back(id);
    return Next::kCompute;
  }
  e->phase = RequestPhase::kReady;
  return e->start_waiting ? Next::kBegin : Next::kWaitForStart;
}

bool DecodeScheduler::StartCame(uint64_t id) {
  Entry* e = Find(id);
  if (e == nullptr) return false;
  if (e->phase == RequestPhase::kLoading) {
    e->start_waiting = true;
    return false;
  }
  return e->phase == RequestPhase::kReady;
}

void DecodeScheduler::Run(Entry& e) {
  if (!e.resume) e.order = next_order_++;
  e.resume = false;
  e.phase = RequestPhase::kRunning;
}

void DecodeScheduler::Started(uint64_t id) {
  Entry* e = Find(id);
  if (e == nullptr) return;
  first_sent_.erase(std::remove(first_sent_.begin(), first_sent_.end(), id), first_sent_.end());
  Run(*e);
}

bool DecodeScheduler::Renew(uint64_t id, TimePoint now) {
  Entry* e = Find(id);
  if (e == nullptr || e->phase == RequestPhase::kRunning || e->phase == RequestPhase::kPreempted)
    return false;
  e->renewed = now;
  return true;
}

void DecodeScheduler::Preempted(uint64_t id, int64_t tokens, int64_t resume_blocks) {
  Entry* e = Find(id);
  if (e == nullptr || e->phase != RequestPhase::kRunning) return;
  e->phase = RequestPhase::kPreempted;
  e->tokens = tokens;
  e->have = 0;
  e->resume = true;
  e->local = true;  // it comes back by a local prefill of what was lost
  e->resume_blocks = resume_blocks;
  preempted_[e->order] = id;
}

void DecodeScheduler::Resumed(uint64_t id, int64_t have, bool loading, TimePoint now) {
  Entry* e = Find(id);
  if (e == nullptr) return;
  e->have = have;
  e->renewed = now;
  e->phase = loading ? RequestPhase::kLoading : RequestPhase::kLocal;
  if (!loading) local_queue_.push_back(id);
}

void DecodeScheduler::ResumeDeferred(uint64_t id) {
  Entry* e = Find(id);
  if (e == nullptr) return;
  e->phase = RequestPhase::kPreempted;
  preempted_[e->order] = id;
}

void DecodeScheduler::Forget(uint64_t id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  if (it->second.phase == RequestPhase::kPreempted) preempted_.erase(it->second.order);
  entries_.erase(it);
  local_queue_.erase(std::remove(local_queue_.begin(), local_queue_.end(), id), local_queue_.end());
  first_sent_.erase(std::remove(first_sent_.begin(), first_sent_.end(), id), first_sent_.end());
}

void DecodeScheduler::PlanPrefill(StepPlan& plan) {
  // None running: nobody waits on a step, so local prefills take large
  // pieces (a large batch computes faster), a bounded number of them: the
  // worker's routers wait on the plans' ends for their replies.
  int64_t budget = Running() > 0
                       ? options_.local_prefill_step_tokens
                       : std::max(options_.idle_prefill_tokens, options_.local_prefill_step_tokens);
  const int64_t most = std::max<int64_t>(options_.max_prefill_tokens, 1);
  while (budget > 0 && !local_queue_.empty()) {
    const uint64_t id = local_queue_.front();
    Entry& e = entries_.at(id);
    if (e.resume && e.have >= e.tokens) {  // nothing (left) to recompute
      plan.prefill.push_back({id, e.have, 0, true, true});
    }
    while (budget > 0 && e.have < e.tokens) {
      const int64_t take = std::min({budget, e.tokens - e.have, most});
      plan.prefill.push_back({id, e.have, take, e.have + take == e.tokens, e.resume});
      e.have += take;
      budget -= take;
    }
    if (e.have < e.tokens) break;  // its next piece after the next step
    local_queue_.pop_front();
    if (e.resume) {
      Run(e);
    } else {
      e.phase = RequestPhase::kFirstSent;
      first_sent_.push_back(id);
    }
  }
}

StepPlan DecodeScheduler::Schedule(TimePoint now, int64_t free_blocks) {
  StepPlan plan;
  for (auto it = entries_.begin(); it != entries_.end();) {
    const Entry& e = it->second;
    const bool waits_for_start =
        e.phase == RequestPhase::kLoading || e.phase == RequestPhase::kReady;
    if (waits_for_start && !e.local && now - e.renewed > options_.prepare_timeout) {
      plan.expire.push_back(it->first);
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  // Last plan's local prefills, whose first tokens are out, join the batch
  // before anything else is computed.
  while (!first_sent_.empty()) {
    const uint64_t id = first_sent_.front();
    first_sent_.pop_front();
    plan.admit.push_back(id);
    Run(entries_.at(id));
  }
  // Resumes, oldest admitted first, while each fits with a block for every
  // running request's next step (so that it is not preempted again at once).
  const int running = Running();
  while (!preempted_.empty()) {
    const auto [order, id] = *preempted_.begin();
    Entry& e = entries_.at(id);
    if (free_blocks < e.resume_blocks + running) break;
    free_blocks -= e.resume_blocks;
    preempted_.erase(preempted_.begin());
    e.phase = RequestPhase::kLoading;  // Resumed or ResumeDeferred says what became of it
    plan.resume.push_back(id);
  }
  // Between two of the running requests' steps at most one budget of
  // pieces: a step this plan owes goes first.
  if (!step_owed_) PlanPrefill(plan);
  step_owed_ = false;
  const bool first_token_out =
      std::any_of(plan.prefill.begin(), plan.prefill.end(),
                  [](const PrefillPiece& p) { return p.last && !p.resume; });
  const int running_now = Running();
  if (first_token_out) {
    step_owed_ = running_now > 0;
    return plan;
  }
  plan.step = running_now > 0;
  if (!plan.step) return plan;
  std::map<uint64_t, uint64_t, std::greater<>> newest;  // order -> id
  for (const auto& [id, e] : entries_) {
    if (e.phase == RequestPhase::kRunning && !e.blended) newest.emplace(e.order, id);
  }
  for (const auto& [order, id] : newest) plan.preempt.push_back(id);
  return plan;
}

bool DecodeScheduler::HasWork(int64_t free_blocks) const {
  if (Running() > 0 || !first_sent_.empty() || !local_queue_.empty()) return true;
  if (preempted_.empty()) return false;
  return free_blocks >= entries_.at(preempted_.begin()->second).resume_blocks;
}

}  // namespace kdn::decode_worker
