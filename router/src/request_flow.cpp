#include "kdn/router/request_flow.h"

#include <algorithm>
#include <cstdlib>

#include "kdn/common/log.h"
#include "serving.pb.h"
#include "worker_messages.h"

namespace kdn::router {

namespace {

using Phase = RequestFlow::Phase;

const char* PhaseName(Phase p) {
  static constexpr const char* kNames[] = {"lookup", "queued", "prepare", "prefill", "decode"};
  return kNames[static_cast<int>(p)];
}

// The moves Enter allows, [from][to]. Any phase may go back to lookup (a
// resume); queued and prepare trade places (a decode worker full after all);
// a prefill is sent again in place (a retry).
constexpr bool kAllowed[5][5] = {
    //            lookup queued prepare prefill decode
    /* lookup  */ {true, true, true, false, false},
    /* queued  */ {true, true, true, false, false},
    /* prepare */ {true, true, false, true, false},
    /* prefill */ {true, false, false, true, true},
    /* decode  */ {true, false, false, false, false},
};

}  // namespace

RequestFlow::RequestFlow(const BackendOptions& options, const WorkerViews& workers,
                         const ModelIdentity& identity, Ledger& ledger, WorkerLink& link,
                         const text::Tokenizer& tokenizer, Metrics* metrics, uint64_t nonce)
    : options_(options),
      workers_(workers),
      identity_(identity),
      ledger_(ledger),
      link_(link),
      tokenizer_(tokenizer),
      metrics_(metrics),
      nonce_(nonce) {}

void RequestFlow::Enter(Request& r, Phase next) {
  if (!kAllowed[static_cast<int>(r.phase)][static_cast<int>(next)]) {
    LogError("{} cannot go from {} to {}", ReqId{r.id}, PhaseName(r.phase), PhaseName(next));
    std::abort();  // a broken invariant of the router itself
  }
  const auto now = Clock::now();
  switch (next) {
    case Phase::kLookup: r.deadline = now + options_.lookup_timeout; break;
    case Phase::kQueued:
      if (r.phase != Phase::kQueued) {  // it waits from its first parking
        r.queued_at = now;
        r.deadline = now + options_.queue_timeout;
      }
      break;
    case Phase::kPrepare: r.deadline = now + options_.prepare_timeout; break;
    case Phase::kPrefill:
    case Phase::kDecode: break;  // no deadline: their workers' liveness bounds them
  }
  r.phase = next;
}

void RequestFlow::Release(const Request& r) {
  proto::WorkerMessage cancel = CancelMessage();
  if (r.phase == Phase::kPrepare || r.phase == Phase::kPrefill || r.phase == Phase::kDecode) {
    link_.Send(r.d, r.id, cancel);
  }
  if (r.phase == Phase::kPrefill && !r.local) link_.Send(r.p, r.id, cancel);
}

void RequestFlow::End(Iter it, JobEvent ev) {
  JobCallback cb = std::move(it->second.cb);
  requests_.erase(it);
  cb(std::move(ev));
}

void RequestFlow::Fail(uint64_t id, const Status& st) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  Release(it->second);
  JobEvent ev;
  ev.kind = JobEvent::Kind::kError;
  ev.error = st;
  End(it, std::move(ev));
}

void RequestFlow::Finish(Iter it, JobEvent ev) {
  ev.kind = JobEvent::Kind::kDone;
  ev.usage = it->second.usage;
  End(it, std::move(ev));
}

bool RequestFlow::Cancel(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  // A queued one is skipped when the queue reaches its id.
  Release(it->second);
  requests_.erase(it);
  return true;
}

int RequestFlow::Waiting() const {
  // Counted from the requests, not the queue, which may still hold the ids
  // of requests cancelled or timed out while they waited.
  int waiting = 0;
  for (const auto& [id, r] : requests_) waiting += r.phase == Phase::kQueued;
  return waiting;
}

std::vector<uint64_t> RequestFlow::HeldOn(size_t worker) const {
  std::vector<uint64_t> held;
  for (const auto& [id, r] : requests_) {
    if (r.d == worker && !r.local && (r.phase == Phase::kPrepare || r.phase == Phase::kPrefill)) {
      held.push_back(id);
    }
  }
  return held;
}

bool RequestFlow::PhaseOf(uint64_t id, Phase* phase) const {
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  *phase = it->second.phase;
  return true;
}

void RequestFlow::Submit(uint64_t id, Job job, JobCallback callback, Clock::time_point arrival) {
  Request& r = requests_[id];
  r.id = id;
  r.job = std::move(job);
  r.cb = std::move(callback);
  r.arrival = arrival;
  if (LogEnabled(LogLevel::kInfo)) {
    std::string blend;
    if (r.job.blend) blend = fmt::format(", {} documents", r.job.blend->segment_tokens.size());
    LogInfo("{} accepted {}: {} prompt tokens, max_tokens {}{}", ReqId{id},
            r.job.route.empty() ? "a job" : r.job.route, r.job.tokens.size(), r.job.max_tokens,
            blend);
  }
  if (Status st = StartLookup(r); !st.ok()) return Fail(id, st);
  if (r.lookups_pending == 0) Place(r);  // the KV events answered for every worker
}

// Asks every usable worker how much of `r`'s prompt it reaches (phase
// kLookup), but those whose KV events answer for them; Place takes it on
// once they have answered (the caller, when none was asked). UNAVAILABLE,
// with nothing sent, when no worker of a role is up.
Status RequestFlow::StartLookup(Request& r) {
  if (!identity_.known) return Unavailable("no worker has answered yet");
  bool any_p = false, any_d = false;
  for (size_t w = 0; w < workers_.size(); ++w) {
    any_p |= Usable(workers_[w], Role::kPrefill);
    any_d |= Usable(workers_[w], Role::kDecode) && r.lost_decode.count(w) == 0;
  }
  if (!any_p || !any_d) {
    return Unavailable(std::string("no ") + (any_p ? "decode" : "prefill") + " worker is up");
  }
  const kvbus::KeyContext kctx{identity_.fingerprint, r.job.ns, identity_.chunk_tokens};
  r.keys = kvbus::PrefixKeys(kctx, r.job.tokens);
  if (r.Resumes() == 0) KDN_RETURN_IF_ERROR(PinPrefix(r));
  r.segment_keys.clear();
  if (r.job.blend) {
    const int32_t* t = r.job.tokens.data() + r.job.blend->head_tokens;
    for (int len : r.job.blend->segment_tokens) {
      r.segment_keys.push_back(kvbus::SegmentKey(kctx, {t, static_cast<size_t>(len)}));
      t += len;
    }
  }
  // Unique per request and per sending: a resumed request's late replies
  // and slices from before are told apart.
  const uint64_t salt = nonce_ ^ (static_cast<uint64_t>(r.Resumes()) << 56);
  uint8_t tid[16];
  for (int i = 0; i < 8; ++i) {
    tid[i] = static_cast<uint8_t>(salt >> (8 * i));
    tid[8 + i] = static_cast<uint8_t>(r.id >> (8 * i));
  }
  r.transfer_id.assign(reinterpret_cast<const char*>(tid), 16);
  proto::WorkerMessage m = LookupMessage(r.job, r.keys, r.segment_keys);
  r.prefix.clear();
  r.segment_tokens_held.clear();
  r.resident.clear();
  r.local = false;
  r.lookups_pending = 0;
  int from_events = 0;
  for (size_t w = 0; w < workers_.size(); ++w) {
    if (!Usable(workers_[w], Role::kPrefill) && !Usable(workers_[w], Role::kDecode)) continue;
    if (r.lost_decode.count(w) != 0) continue;
    if (auto held = PrefixFromEvents(r, w)) {
      r.prefix[w] = *held;
      ++from_events;
      continue;
    }
    r.prefix[w] = -1;
    ++r.lookups_pending;
    link_.Send(w, r.id, m);
  }
  if (metrics_ != nullptr) metrics_->Lookups(r.lookups_pending, from_events);
  Enter(r, Phase::kLookup);
  return Status::Ok();
}

std::optional<int64_t> RequestFlow::PrefixFromEvents(const Request& r, size_t w) const {
  // A blend request asks about its documents too, which no event names.
  if (follower_ == nullptr || r.job.blend) return std::nullopt;
  // A shared tier reaches more than the worker's own host tier says.
  for (const proto::StoreTier& t : workers_[w].store_tiers) {
    if (!t.held_here()) return std::nullopt;
  }
  const auto chunks = follower_->Prefix(w, r.keys);
  if (!chunks) return std::nullopt;
  return std::min<int64_t>(static_cast<int64_t>(*chunks) * identity_.chunk_tokens,
                           static_cast<int64_t>(r.job.tokens.size()));
}

Status RequestFlow::PinPrefix(Request& r) {
  if (r.job.pin && pins_ == nullptr) {
    return FailedPrecondition("this router does not pin prefixes (cache_control)");
  }
  if (pins_ == nullptr) return Status::Ok();
  const auto now = Clock::now();
  auto note = [&](const PinInfo& info) {
    if (info.tokens < r.usage.pinned_tokens) return;
    r.usage.pinned_tokens = static_cast<int>(info.tokens);
    r.usage.pin_expires_at = info.expires_at;
  };
  if (auto hit = pins_->Touch(r.job.tenant, r.keys, now)) {
    for (const KeepOrder& order : hit->renew) SendKeep(order);
    note(hit->info);
  }
  if (!r.job.pin) return Status::Ok();
  // Whole chunks only: the keys of a prompt's tail are not stored apart.
  const size_t chunks = std::min<size_t>(
      r.keys.size(), static_cast<size_t>(r.job.pin->tokens / identity_.chunk_tokens));
  if (chunks == 0) return Status::Ok();  // shorter than a chunk: nothing to keep
  const int64_t tokens = static_cast<int64_t>(chunks) * identity_.chunk_tokens;
  auto grant = pins_->Pin(r.job.tenant, {r.keys.begin(), r.keys.begin() + chunks}, tokens,
                          static_cast<uint64_t>(tokens) * kv_bytes_per_token_, r.job.pin->ttl, now);
  if (!grant.ok()) return grant.status();
  if (!grant->order.keys.empty()) SendKeep(grant->order);
  note(grant->info);
  LogInfo("{} {} {} ({} tokens) for {} s", ReqId{r.id}, grant->created ? "pinned" : "refreshed",
          grant->info.id, tokens, grant->info.ttl.count());
  return Status::Ok();
}

void RequestFlow::SendKeep(const KeepOrder& order) {
  proto::WorkerMessage m = KeepMessage(order.keys, order.lease);
  for (size_t w = 0; w < workers_.size(); ++w) {
    if (Usable(workers_[w], Role::kPrefill) || Usable(workers_[w], Role::kDecode)) {
      link_.Send(w, 0, m);
    }
  }
}

PlacementInput RequestFlow::InputOf(const Request& r) const {
  PlacementInput in;
  in.tokens = static_cast<int64_t>(r.job.tokens.size());
  const int64_t whole = r.PromptTokens() + r.job.max_tokens;
  in.kv_blocks = KvBlocksFor(KvTokensAdmitted(in.tokens, whole, r.job.blend.has_value()));
  in.kv_blocks_whole = KvBlocksFor(whole);
  in.blend = r.job.blend ? &*r.job.blend : nullptr;
  in.prefix = &r.prefix;
  in.segment_tokens_held = &r.segment_tokens_held;
  in.resident = &r.resident;
  in.resumed = r.Resumes() > 0 || r.generated_tokens > 0;
  return in;
}

// Carries out placement's choice for `r`: the prepare to its decode worker,
// or a wait in the queue, or a refusal.
void RequestFlow::Place(Request& r) {
  const PlacementInput in = InputOf(r);
  const std::optional<size_t> p = PlacePrefill(workers_, ledger_, in);
  const DecodePlacement d = PlaceDecode(workers_, ledger_, in);
  using V = DecodePlacement::Verdict;
  if (!p) return Fail(r.id, Unavailable("no prefill worker answered"));
  switch (d.verdict) {
    case V::kNoneUp: return Fail(r.id, Unavailable("no decode worker is up"));
    case V::kWait:
      // A resumed request was admitted before: it waits ahead of the new.
      return Park(r, /*front=*/r.Resumes() > 0);
    case V::kTooLarge:
      return Fail(r.id,
                  InvalidArgument("no decode worker can hold " + std::to_string(r.PromptTokens()) +
                                  " + " + std::to_string(r.job.max_tokens) + " tokens of KV"));
    case V::kRoute: break;
  }
  r.p = *p;
  r.d = d.worker;
  r.local = PrefillLocally(workers_, ledger_, in, r.p, r.d,
                           r.job.disaggregation.value_or(options_.disaggregation),
                           options_.local_prefill_max_tokens);
  proto::WorkerMessage m = PrepareMessage(r.job, r.transfer_id, r.generated_tokens, r.local,
                                          std::max<int64_t>(r.prefix[r.d], 0));
  // Before the prepare goes out, so that the line comes before the decode
  // worker's about it. Counted against the workers until they next report.
  if (r.local) {
    LogInfo("{} routed: local prefill on decode {} (holds {} tokens); prefill {} reaches {}",
            ReqId{r.id}, workers_[r.d].name, r.prefix[r.d], workers_[r.p].name, r.prefix[r.p]);
    r.p = r.d;
    ledger_.ReserveLocal(r.d, TokensToCompute(in, r.d), in.kv_blocks);
  } else {
    LogInfo("{} routed: prefill {} (reaches {} tokens), decode {} (holds {} tokens)", ReqId{r.id},
            workers_[r.p].name, r.prefix[r.p], workers_[r.d].name, r.job.blend ? 0 : r.prefix[r.d]);
    ledger_.Reserve(r.p, r.d, in.tokens, in.kv_blocks);
  }
  if (metrics_) metrics_->Routed(r.local);
  link_.Send(r.d, r.id, m);
  Enter(r, Phase::kPrepare);
}

// Request `r` waits for a decode worker with room (or is refused when the
// queue is full). `front`: it had its turn and goes back to the head.
void RequestFlow::Park(Request& r, bool front) {
  if (!front && static_cast<int>(queued_.size()) >= options_.max_queued) {
    return Fail(r.id, ResourceExhausted("every decode worker is full and " +
                                        std::to_string(queued_.size()) +
                                        " requests already wait (--max-queued)"));
  }
  if (r.phase != Phase::kQueued) {
    LogDebug("{} queued: no decode worker has room for {} + {} tokens; {} waiting", ReqId{r.id},
             r.job.tokens.size(), r.job.max_tokens, queued_.size() + 1);
  }
  Enter(r, Phase::kQueued);
  if (front) {
    queued_.push_front(r.id);
  } else {
    queued_.push_back(r.id);
  }
}

// Gives waiting requests, oldest first, to decode workers with room; stops at
// the first that still finds none (arrival order is kept).
void RequestFlow::DrainQueue() {
  while (!queued_.empty()) {
    auto it = requests_.find(queued_.front());
    if (it == requests_.end() || it->second.phase != Phase::kQueued) {
      queued_.pop_front();
      continue;
    }
    Request& r = it->second;
    if (PlaceDecode(workers_, ledger_, InputOf(r)).verdict != DecodePlacement::Verdict::kRoute) {
      break;
    }
    queued_.pop_front();
    if (metrics_) {
      metrics_->QueueWait(std::chrono::duration<double>(Clock::now() - r.queued_at).count());
    }
    Place(r);
  }
}

// Sends `r`'s prefill to its prefill worker r.p, the KV to go to its decode
// worker r.d (prepared).
void RequestFlow::SendPrefill(Request& r) {
  proto::WorkerMessage m = PrefillMessage(r.job, workers_[r.d].kvbus_endpoint, r.decode_held_tokens,
                                          r.transfer_id, r.generated_tokens);
  link_.Send(r.p, r.id, m);
  Enter(r, Phase::kPrefill);
}

// `r` lost its prefill worker before its first token: another takes the
// prefill (the decode worker still holds the reservation; KV the lost worker
// already pushed is skipped). False if there is none, or the request has
// been moved twice already.
bool RequestFlow::RetryPrefill(Request& r) {
  constexpr int kMaxPrefillRetries = 2;
  if (r.prefill_retries >= kMaxPrefillRetries) return false;
  const std::optional<size_t> next = PlaceRetry(workers_, ledger_, r.p);
  if (!next) return false;
  const size_t lost = r.p;
  r.p = *next;
  ++r.prefill_retries;
  LogWarn("{} prefill worker {} lost before the first token: prefill sent again, to {}",
          ReqId{r.id}, workers_[lost].name, workers_[r.p].name);
  SendPrefill(r);
  return true;
}

// `r` lost its decode worker (`why`): it starts over from the lookup, never
// to that worker again, with the tokens its client has as the tail of its
// prompt (docs/serving.md, "A decode worker lost"). False, with nothing
// changed, when resuming is off or spent, or no decode worker is left.
bool RequestFlow::Resume(Request& r, const std::string& why) {
  if (!options_.resume || r.Resumes() >= options_.max_resumes) return false;
  bool other = false;
  for (size_t x = 0; x < workers_.size(); ++x) {
    other |= x != r.d && r.lost_decode.count(x) == 0 && Usable(workers_[x], Role::kDecode);
  }
  if (!other) return false;
  // Should the decode worker only have gone quiet, it stops for good.
  Release(r);
  r.lost_decode.insert(r.d);
  const int64_t carried = static_cast<int64_t>(r.streamed.size()) - r.generated_tokens;
  r.job.tokens.insert(r.job.tokens.end(), r.streamed.end() - carried, r.streamed.end());
  r.generated_tokens = static_cast<int64_t>(r.streamed.size());
  r.decode_held_tokens = 0;
  r.prefill_retries = 0;
  LogWarn("{} decode worker {} {} after {} tokens: resuming elsewhere ({} of {})", ReqId{r.id},
          workers_[r.d].name, why, r.streamed.size(), r.Resumes(), options_.max_resumes);
  if (metrics_) metrics_->Resumed(static_cast<int>(r.streamed.size()));
  if (Status st = StartLookup(r); !st.ok()) {
    Fail(r.id, st);  // not reached: a decode worker is up
  } else if (r.lookups_pending == 0) {
    Place(r);  // the KV events answered for every worker
  }
  return true;
}

void RequestFlow::OnWorkerDown(size_t w, const std::string& why) {
  std::vector<uint64_t> doomed, to_place, to_resume;
  for (auto& [id, r] : requests_) {
    const bool uses_d = r.phase != Phase::kLookup && r.phase != Phase::kQueued && r.d == w;
    const bool uses_p = r.phase == Phase::kPrefill && r.p == w;
    // Before the first token nothing has reached the client: another prefill
    // worker can take the request over.
    if (uses_p && !uses_d && RetryPrefill(r)) continue;
    if (uses_d) {
      to_resume.push_back(id);  // after this loop: Resume may fail it
    } else if (uses_p) {
      doomed.push_back(id);
    }
    auto pit = r.prefix.find(w);
    if (r.phase == Phase::kLookup && pit != r.prefix.end() && pit->second < 0) {
      r.prefix.erase(pit);
      if (--r.lookups_pending == 0) to_place.push_back(id);
    }
  }
  const WorkerView& wk = workers_[w];
  const Status lost =
      Unavailable(std::string(RoleName(wk.role)) + " worker " + wk.name + " " + why);
  for (uint64_t id : to_resume) {
    auto it = requests_.find(id);
    if (it != requests_.end() && !Resume(it->second, why)) doomed.push_back(id);
  }
  for (uint64_t id : doomed) Fail(id, lost);
  for (uint64_t id : to_place) {
    auto it = requests_.find(id);
    if (it != requests_.end()) Place(it->second);
  }
}

void RequestFlow::Tick(Clock::time_point now) {
  std::vector<uint64_t> late_lookup, late_prepare, late_queued;
  for (auto& [id, r] : requests_) {
    if (now < r.deadline) continue;
    if (r.phase == Phase::kLookup) late_lookup.push_back(id);
    if (r.phase == Phase::kPrepare) late_prepare.push_back(id);
    if (r.phase == Phase::kQueued) late_queued.push_back(id);
  }
  for (uint64_t id : late_queued) {
    Fail(id, Unavailable("no decode worker had room within " +
                         std::to_string(options_.queue_timeout.count() / 1000) +
                         " s (--queue-timeout-ms)"));
  }
  DrainQueue();
  if (metrics_) metrics_->QueueDepth(Waiting());
  // Lookups go ahead with the answers they have. A worker that has not
  // answered yet is live by its pings (on two busy cores an answer once
  // took 3 s to arrive): it counts as holding none of the prompt, and may
  // still take the request. One that is down by then is left out.
  for (uint64_t id : late_lookup) {
    auto it = requests_.find(id);
    if (it == requests_.end()) continue;
    Request& r = it->second;
    int silent = 0;
    for (auto& [w, held] : r.prefix) {
      if (held >= 0 ||
          !(Usable(workers_[w], Role::kPrefill) || Usable(workers_[w], Role::kDecode))) {
        continue;
      }
      held = 0;
      ++silent;
    }
    if (silent > 0) {
      LogWarn(
          "{} lookup: {} worker(s) did not answer within {} ms; counted as holding none of "
          "the prompt",
          ReqId{r.id}, silent, options_.lookup_timeout.count());
    }
    r.lookups_pending = 0;
    Place(r);
  }
  for (uint64_t id : late_prepare)
    Fail(id, Unavailable("the decode worker did not answer in time"));
}

}  // namespace kdn::router
