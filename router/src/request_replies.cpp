// RequestFlow's side of the workers' replies (request_flow.h): lookup,
// prepare, prefill (the first token) and the decode worker's tokens.
#include <algorithm>

#include "kdn/common/log.h"
#include "kdn/control/convert.h"
#include "kdn/router/request_flow.h"
#include "kdn/text/output_text.h"
#include "worker_messages.h"

namespace kdn::router {

void RequestFlow::OnMessage(size_t w, const proto::WorkerMessage& m) {
  auto it = requests_.find(m.request_id());
  if (it == requests_.end()) return;  // finished or cancelled meanwhile
  switch (m.body_case()) {
    case proto::WorkerMessage::kLookupReply: return OnLookupReply(w, it->second, m);
    case proto::WorkerMessage::kPrepareReply: return OnPrepareReply(w, it->second, m);
    case proto::WorkerMessage::kPrefillReply: return OnPrefillReply(w, it, m);
    case proto::WorkerMessage::kTokens: return OnTokens(w, it, m);
    default: return;
  }
}

void RequestFlow::OnLookupReply(size_t w, Request& r, const proto::WorkerMessage& m) {
  auto pit = r.prefix.find(w);
  if (r.phase != Phase::kLookup || pit == r.prefix.end() || pit->second >= 0) return;
  pit->second = std::max(0, m.lookup_reply().prefix_tokens());
  r.resident[w] = std::clamp<int64_t>(m.lookup_reply().resident_tokens(), 0, pit->second);
  if (r.job.blend) {
    int64_t held = 0;
    const auto& flags = m.lookup_reply().segments_held();
    for (int i = 0; i < flags.size() && i < static_cast<int>(r.segment_keys.size()); ++i) {
      if (flags[i]) held += r.job.blend->segment_tokens[i];
    }
    r.segment_tokens_held[w] = held;
  }
  if (--r.lookups_pending == 0) Place(r);
}

void RequestFlow::OnPrepareReply(size_t w, Request& r, const proto::WorkerMessage& m) {
  if (r.phase != Phase::kPrepare || w != r.d) return;
  Status st = control::StatusFromProto(m.prepare_reply().error());
  if (st.code() == StatusCode::kResourceExhausted) {
    // Full after all (its report was stale): back to the head of the queue,
    // no prefill spent.
    LogDebug("{} {} is full: {}; queued again", ReqId{r.id}, workers_[w].name, st.message());
    ledger_.MarkFull(w, workers_[w]);
    return Park(r, /*front=*/true);
  }
  if (!st.ok()) return Fail(r.id, st.WithContext(workers_[w].name));
  if (workers_[r.d].kvbus_endpoint.empty()) {
    return Fail(r.id, Unavailable(workers_[r.d].name + " has not said where it takes KV"));
  }
  r.decode_held_tokens = m.prepare_reply().held_tokens();
  if (r.local) {
    // It computes the rest itself; its PrefillReply comes from it.
    LogDebug("{} prepared: {} holds {} prompt tokens and prefills the rest", ReqId{r.id},
             workers_[r.d].name, r.decode_held_tokens);
    return Enter(r, Phase::kPrefill);
  }
  LogDebug("{} prepared: {} holds {} prompt tokens; prefill to {}", ReqId{r.id}, workers_[r.d].name,
           r.decode_held_tokens, workers_[r.p].name);
  SendPrefill(r);
}

// One token of `r` goes to its client now: the time to the first token, or
// since the one before.
void RequestFlow::TokenOut(Request& r) {
  const auto now = Clock::now();
  if (metrics_) {
    if (!r.first_token_seen) {
      metrics_->Ttft(std::chrono::duration<double>(now - r.arrival).count());
    } else {
      metrics_->InterToken(std::chrono::duration<double>(now - r.last_token).count());
    }
  }
  r.first_token_seen = true;
  r.last_token = now;
}

void RequestFlow::OnPrefillReply(size_t w, Iter it, const proto::WorkerMessage& m) {
  Request& r = it->second;
  if (r.phase != Phase::kPrefill || w != r.p) return;
  const proto::PrefillReply& pr = m.prefill_reply();
  // A reply to an earlier sending of a resumed request (a worker before this
  // echo sends none).
  if (!pr.transfer_id().empty() && pr.transfer_id() != r.transfer_id) return;
  Status st = control::StatusFromProto(pr.error());
  if (!st.ok()) return Fail(r.id, st.WithContext(workers_[w].name));
  // A resumed request's prefill carries on a stream its client has; the
  // figures of its prompt are its first prefill's.
  const bool resumed = !r.streamed.empty();
  LogInfo(
      "{} prefill done by {}{}{}: {} cached ({} from tail pieces, {} blended, {} of them "
      "recomputed), {} computed, {} bytes of KV sent, {} slices skipped, {} token after "
      "{:.1f} ms",
      ReqId{r.id}, workers_[w].name, r.local ? " (local)" : "", resumed ? " (resumed)" : "",
      pr.cached_tokens(), pr.tail_tokens(), pr.blended_tokens(), pr.recomputed_tokens(),
      pr.computed_tokens(), pr.kv_bytes_sent(), pr.slices_skipped(), resumed ? "next" : "first",
      std::chrono::duration<double, std::milli>(Clock::now() - r.arrival).count());
  if (!resumed) {
    r.usage.prompt_tokens = static_cast<int>(r.job.tokens.size());
    r.usage.cached_tokens = pr.cached_tokens();
    r.usage.blended = r.job.blend.has_value();
    r.usage.blended_tokens = pr.blended_tokens();
    r.usage.recomputed_tokens = pr.recomputed_tokens();
    r.usage.question_pass_tokens = pr.question_pass_tokens();
    r.usage.pruned_tokens = pr.pruned_tokens();
    r.usage.recompute_ratio = pr.recompute_ratio();
  }
  if (metrics_) {
    if (!resumed) {
      metrics_->PromptTokens(pr.cached_tokens() - pr.blended_tokens(),
                             pr.blended_tokens() - pr.recomputed_tokens(), pr.recomputed_tokens(),
                             pr.computed_tokens(), pr.tail_tokens(), pr.pruned_tokens());
    }
    metrics_->KvMoved(pr.kv_bytes_sent(), pr.slices_skipped(), pr.slices_sourced());
    if (!resumed && r.job.blend.has_value()) metrics_->BlendRatio(pr.recompute_ratio());
  }
  // Step 5: the first token goes to the client now, shown by the decode
  // worker's own rules (text::OutputText: stop strings, partial characters),
  // so that its text and the decode worker's from the second token on join
  // up. A resumed request's token follows the ones its client has, replayed
  // first.
  text::OutputText output(tokenizer_, {r.job.max_tokens, r.job.stop_ids, r.job.stop_strings});
  const int64_t max_context = workers_[r.d].max_context;
  if (!output.Replay(r.streamed, r.PromptTokens(), max_context)) {
    return Fail(r.id, Internal("resumed after the tokens that end it"));
  }
  text::TextDelta first =
      output.Add(pr.first_token(), static_cast<int64_t>(r.job.tokens.size()), max_context);
  TokenOut(r);
  r.streamed.push_back(pr.first_token());
  r.usage.completion_tokens = static_cast<int>(r.streamed.size());
  if (metrics_) metrics_->GeneratedTokens(1);
  JobEvent ev;
  ev.tokens = 1;
  ev.text = std::move(first.text);
  Enter(r, Phase::kDecode);
  if (first.finished) {
    // Nothing left to decode: the decode worker frees what it holds.
    Release(r);
    ev.finish_reason = first.finish_reason;
    return Finish(it, std::move(ev));
  }
  r.cb(std::move(ev));
  if (r.local) return;  // it runs already, its events from the second token on
  // Over pruned documents the prompt's KV fills fewer slots than its tokens.
  const int32_t kv_tokens =
      pr.kv_tokens() > 0 && pr.kv_tokens() < static_cast<int64_t>(r.job.tokens.size())
          ? pr.kv_tokens()
          : 0;
  proto::WorkerMessage start = StartMessage(pr.first_token(), kv_tokens, pr.kv_holes());
  link_.Send(r.d, r.id, start);
}

void RequestFlow::OnTokens(size_t w, Iter it, const proto::WorkerMessage& m) {
  Request& r = it->second;
  // Before the decode phase only a failure comes: of its prepare, of its
  // local prefill, or of its reservation while a prefill worker computes
  // it (the decode worker dropped it: the prefill is let go at once rather
  // than computed for a Start that would be refused).
  if (w != r.d || r.phase == Phase::kLookup || r.phase == Phase::kQueued) return;
  const bool awaiting_prefill = r.phase == Phase::kPrefill && !r.local;
  JobEvent ev;
  bool finished = false;
  for (const proto::TokenEvent& e : m.tokens().events()) {
    Status st = control::StatusFromProto(e.error());
    if (!st.ok()) return Fail(r.id, st.WithContext(workers_[w].name));
    if (awaiting_prefill) continue;
    if (e.token() >= 0) {
      TokenOut(r);
      r.streamed.push_back(e.token());
      ++ev.tokens;
    }
    ev.text += e.text();
    if (e.finished()) {
      finished = true;
      ev.finish_reason = e.finish_reason();
    }
  }
  r.usage.completion_tokens += ev.tokens;
  if (metrics_) metrics_->GeneratedTokens(ev.tokens);
  if (finished) {
    Finish(it, std::move(ev));
  } else if (ev.tokens > 0 || !ev.text.empty()) {
    r.cb(std::move(ev));
  }
}

}  // namespace kdn::router
