#include "kdn/router/injector.h"

#include "kdn/common/log.h"
#include "kdn/control/convert.h"
#include "worker_messages.h"

namespace kdn::router {

void Injector::Start(uint64_t id, InjectJob job, JobCallback callback) {
  Injection inj;
  inj.job = std::move(job);
  inj.cb = std::move(callback);
  inj.progress.total = static_cast<int>(inj.job.documents.size());
  for (size_t i = 0; i < inj.job.documents.size(); ++i) inj.todo.push_back(i);
  LogInfo("{} accepted {}: {} documents", ReqId{id},
          inj.job.steering_vector ? "/v1/kdn/steering"
          : inj.job.base_required ? "/v1/kdn/edit"
                                  : "/v1/kdn/inject",
          inj.job.documents.size());
  injections_.emplace(id, std::move(inj));
  Pump(id);
}

void Injector::End(std::map<uint64_t, Injection>::iterator it, JobEvent ev) {
  JobCallback cb = std::move(it->second.cb);
  injections_.erase(it);
  cb(std::move(ev));
}

// Sends documents to prefill workers with room; ends the injection when every
// document is done, or fails the rest when no prefill worker is up.
void Injector::Pump(uint64_t id) {
  auto it = injections_.find(id);
  if (it == injections_.end()) return;
  Injection& inj = it->second;
  std::vector<int> busy(workers_.size(), 0);
  for (const auto& [pid, part] : parts_) ++busy[part.worker];
  bool any_up = false;
  for (const WorkerView& w : workers_) any_up |= Usable(w, Role::kPrefill);
  while (!inj.todo.empty()) {
    const std::optional<size_t> best = PlaceDocument(workers_, ledger_, busy, kInjectPerWorker);
    if (!best) break;
    const size_t doc = inj.todo.front();
    inj.todo.pop_front();
    proto::WorkerMessage m = InjectMessage(inj.job, doc);
    const uint64_t part_id = next_part_id_++;
    parts_[part_id] = {id, doc, *best};
    ++busy[*best];
    ++inj.in_flight;
    // The document travels under an id of its own: the prefill worker's
    // lines about it carry that one.
    LogDebug("{} document {} ({} tokens) to {} as {}", ReqId{id}, doc,
             inj.job.documents[doc].size(), workers_[*best].name, ReqId{part_id});
    link_.Send(*best, part_id, m);
  }
  if (!inj.todo.empty() && !any_up && inj.in_flight == 0) {
    if (inj.progress.done == 0) {
      JobEvent ev;
      ev.kind = JobEvent::Kind::kError;
      ev.error = Unavailable("no prefill worker is up");
      return End(it, std::move(ev));
    }
    while (!inj.todo.empty()) {
      DocumentDone(inj, inj.todo.front(), "no prefill worker is up");
      inj.todo.pop_front();
    }
  }
  if (inj.todo.empty() && inj.in_flight == 0) {
    JobEvent ev;
    ev.kind = JobEvent::Kind::kDone;
    ev.progress = inj.progress;
    End(it, std::move(ev));
  }
}

// Counts one document; `error` empty: it is in the KDN.
void Injector::DocumentDone(Injection& inj, size_t doc, const std::string& error, bool held,
                            int64_t stored_tokens, StatusCode code) {
  ++inj.progress.done;
  inj.progress.tokens += static_cast<int64_t>(inj.job.documents[doc].size());
  inj.progress.stored_tokens += stored_tokens;
  if (!error.empty()) {
    ++inj.progress.failed;
    if (inj.progress.first_error_code == StatusCode::kOk) inj.progress.first_error_code = code;
    inj.progress.errors.emplace_back(static_cast<int>(doc), error);
  } else if (held) {
    ++inj.progress.already_held;
  } else {
    ++inj.progress.stored;
  }
  if (metrics_) {
    metrics_->Injected(error.empty() ? (held ? "already_held" : "stored") : "failed",
                       inj.job.documents[doc].size(), stored_tokens);
  }
}

void Injector::OnReply(size_t w, const proto::WorkerMessage& m) {
  auto pit = parts_.find(m.request_id());
  if (pit == parts_.end() || pit->second.worker != w) return;
  const Part part = pit->second;
  parts_.erase(pit);
  auto it = injections_.find(part.injection);
  if (it == injections_.end()) return;  // its client went away
  Injection& inj = it->second;
  --inj.in_flight;
  Status st = control::StatusFromProto(m.inject_reply().error());
  if (!st.ok()) {
    LogWarn("{} document {} failed at {} ({}): {}", ReqId{part.injection}, part.document,
            workers_[w].name, ReqId{m.request_id()}, st.ToString());
  }
  // An edit's original the KDN lacks is the client's mistake, not a failure.
  if (st.code() == StatusCode::kNotFound && inj.job.base_required) ++inj.progress.missing_base;
  DocumentDone(inj, part.document, st.ok() ? "" : st.WithContext(workers_[w].name).ToString(),
               m.inject_reply().already_held(), st.ok() ? m.inject_reply().stored_tokens() : 0,
               st.code());
  if (inj.cb) {
    JobEvent ev;
    ev.kind = JobEvent::Kind::kProgress;
    ev.progress = inj.progress;
    ev.progress.errors.clear();  // only the final event lists them
    inj.cb(std::move(ev));
  }
  Pump(part.injection);
}

void Injector::OnWorkerDown(size_t w) {
  std::vector<uint64_t> touched;
  for (auto it = parts_.begin(); it != parts_.end();) {
    if (it->second.worker != w) {
      ++it;
      continue;
    }
    auto inj = injections_.find(it->second.injection);
    if (inj != injections_.end()) {
      --inj->second.in_flight;
      inj->second.todo.push_front(it->second.document);
      touched.push_back(it->second.injection);
    }
    it = parts_.erase(it);
  }
  for (uint64_t id : touched) Pump(id);
}

}  // namespace kdn::router
