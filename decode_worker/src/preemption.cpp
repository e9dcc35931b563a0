// The Decoder's preemption (docs/serving.md, "Admission and preemption"):
// the requests the scheduler names taken out of the batch when a decode step
// finds no free KV block, their KV kept in the pool and the KDN, and their
// resumes.

#include <algorithm>

#include "kdn/common/log.h"
#include "kdn/decode_worker/decoder.h"
#include "kdn/kvbus/key.h"

namespace kdn::decode_worker {

void Decoder::MakeRoomForStep(const std::vector<uint64_t>& candidates) {
  const engine::KvCache& cache = model_.kv_cache();
  for (uint64_t id : candidates) {
    if (batcher_->BlocksForStep() <= cache.free_blocks()) return;
    Preempt(id);
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
  q.resume = Resume{t.generated.back(), static_cast<int64_t>(tokens.size())};
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
  scheduler_.Preempted(id, static_cast<int64_t>(q.request.tokens.size()), ResumeBlocks(q));
  preempted_.emplace(id, std::move(q));
}

int64_t Decoder::ResumeBlocks(const Preempted& q) const {
  return KvBlocksFor(KvTokensAdmitted(q.request, model_.config().max_context));
}

bool Decoder::StartResume(uint64_t id) {
  auto it = preempted_.find(id);
  if (it == preempted_.end()) return true;  // not expected: the scheduler plans what is here
  Prepared p;
  p.request = std::move(it->second.request);
  p.resume = it->second.resume;
  p.keys = kvbus::PrefixKeys({fingerprint_, p.request.ns, options_.chunk_tokens}, p.request.tokens);
  if (options_.events != nullptr) options_.events->Describe(p.request.tokens, p.keys);
  if (Status st = ReserveKv(p); !st.ok()) {
    // Not expected (the blocks were counted free): it waits on.
    LogWarn("{} cannot resume yet: {}", ReqId{p.request.request_id}, st.ToString());
    it->second.request = std::move(p.request);
    return false;
  }
  preempted_.erase(it);
  const bool loading = p.resident_tokens < static_cast<int64_t>(p.request.tokens.size());
  if (loading) {
    PostLoad(id, p);
  } else {
    p.held_tokens = p.resident_tokens;
    QueueLocal(p);
  }
  scheduler_.Resumed(id, p.resident_tokens, loading, Now());
  prepared_.emplace(id, std::move(p));
  return true;
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
    scheduler_.Forget(id);
    out->events.push_back(Failure(id, std::move(st)));
  }
}

}  // namespace kdn::decode_worker
