// The Decoder's preemption (decoder.h, step 3): requests taken out of the
// batch when a decode step finds no free KV block, their KV kept in the
// pool and the KDN, and their resumes.

#include <algorithm>

#include "kdn/common/log.h"
#include "kdn/decode_worker/decoder.h"
#include "kdn/kvbus/key.h"

namespace kdn::decode_worker {

void Decoder::MakeRoomForStep() {
  const engine::KvCache& cache = model_.kv_cache();
  while (batcher_->BlocksForStep() > cache.free_blocks()) {
    const Running* newest = nullptr;
    uint64_t victim = 0;
    for (const auto& [id, r] : running_) {
      if (!r.blended && (newest == nullptr || r.order > newest->order)) {
        newest = &r;
        victim = id;
      }
    }
    if (newest == nullptr) return;  // only blended requests run: they hold their blocks
    Preempt(victim);
  }
}

void Decoder::Preempt(uint64_t id) {
  auto taken = batcher_->Take(id);
  auto it = running_.find(id);
  if (!taken.ok() || it == running_.end()) return;  // not reached: running_ mirrors the batch
  Running r = std::move(it->second);
  running_.erase(it);
  Batcher::Taken& t = *taken;
  // Its KV: the prompt and every generated token but the last, whose KV
  // the next step would have written. The request goes on from that token.
  std::vector<int32_t> tokens = std::move(r.prompt);
  tokens.insert(tokens.end(), t.generated.begin(), t.generated.end() - 1);
  const int blocks = static_cast<int>(t.seq.blocks().size());
  // Ahead of the loads posted after it, its own resume's among them.
  PublishAndStore(r.request_id, t.seq, tokens, r.held_tokens, r.ns, kLoadLane);
  Preempted q;
  q.id = id;
  q.resume = Resume{t.generated.back(), r.order, static_cast<int64_t>(tokens.size())};
  q.request.tokens = std::move(tokens);
  q.request.ns = r.ns;
  q.request.request_id = r.request_id;
  q.request.local_prefill = true;  // computed here, if at all; no Start
  q.request.lookup_tokens = static_cast<int64_t>(q.request.tokens.size());
  q.request.spec = std::move(t.spec);
  q.request.spec.generated.assign(t.generated.begin(), t.generated.end() - 1);
  q.request.spec.first_token_sent = true;  // `pending` went out before
  ++preemptions_;
  LogInfo(
      "{} preempted after {} generated tokens: the KV pool is out of blocks; its KV ({} "
      "tokens) is kept in the pool and the KDN, {} blocks freed; {} wait to resume",
      ReqId{r.request_id}, t.generated.size(), q.request.tokens.size(), blocks,
      preempted_.size() + 1);
  preempted_.emplace(q.resume.order, std::move(q));
}

int64_t Decoder::ResumeBlocks(const Preempted& q) const {
  return KvBlocksFor(KvTokensAdmitted(q.request, model_.config().max_context));
}

void Decoder::ResumePreempted() {
  engine::KvCache& cache = model_.kv_cache();
  while (!preempted_.empty()) {
    auto it = preempted_.begin();
    // Room for it and for the running requests' next step, so that it is
    // not preempted again at once.
    const int64_t need = ResumeBlocks(it->second) + static_cast<int64_t>(batcher_->running());
    if (cache.free_blocks() < need) return;
    Preempted q = std::move(it->second);
    preempted_.erase(it);
    Prepared p;
    p.request = std::move(q.request);
    p.resume = q.resume;
    p.renewed = Now();
    p.keys =
        kvbus::PrefixKeys({fingerprint_, p.request.ns, options_.chunk_tokens}, p.request.tokens);
    if (Status st = ReserveKv(p); !st.ok()) {
      // Not expected (the blocks were counted free): it waits on.
      LogWarn("{} cannot resume yet: {}", ReqId{p.request.request_id}, st.ToString());
      q.request = std::move(p.request);
      preempted_.emplace(q.resume.order, std::move(q));
      return;
    }
    const uint64_t id = q.id;
    if (p.resident_tokens >= static_cast<int64_t>(p.request.tokens.size())) {
      p.held_tokens = p.resident_tokens;
      QueueLocal(id, p);
    } else {
      PostLoad(id, p);
    }
    prepared_.emplace(id, std::move(p));
  }
}

void Decoder::FinishResume(uint64_t id, DecoderOutput* out) {
  auto it = prepared_.find(id);
  if (it == prepared_.end()) return;
  Prepared p = std::move(it->second);
  prepared_.erase(it);
  const Resume r = *p.resume;
  const auto n = static_cast<int64_t>(p.request.tokens.size());
  const int64_t reused = std::max(p.held_tokens, p.resident_tokens);
  ++(reused >= r.stored_tokens ? resumed_by_load_ : resumed_by_recompute_);
  LogInfo("{} resumed: {} of its {} tokens' KV reused ({} resident), {} recomputed",
          ReqId{p.request.request_id}, reused, n, p.resident_tokens, n - reused);
  const uint64_t request_id = p.request.request_id;
  if (Status st = Admit(id, std::move(p), r.pending, out); !st.ok()) {
    LogError("{} cannot resume: {}", ReqId{request_id}, st.ToString());
    out->events.push_back(Failure(id, std::move(st)));
  }
}

}  // namespace kdn::decode_worker
