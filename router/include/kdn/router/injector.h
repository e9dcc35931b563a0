#pragma once
// Injector: POST /v1/kdn/inject's documents to the prefill workers, to store
// their KV in the KDN ahead of any question (docs/serving.md, "Documents").
// Each document travels under an id of its own (a part id, apart from the
// request ids); placement's PlaceDocument picks its worker, at most
// kInjectPerWorker in flight per worker. A document whose worker is lost
// goes to another; with no prefill worker up, the rest fail.
//
// Not thread-safe: one thread calls everything (the Backend's), and the
// callbacks are called on it.

#include <cstdint>
#include <deque>
#include <map>
#include <string>

#include "kdn/router/backend.h"
#include "kdn/router/placement.h"
#include "kdn/router/request_flow.h"

namespace kdn::router {

// Documents in flight per prefill worker: enough to keep it busy, few enough
// that progress means something and other requests are not queued behind a
// whole batch.
inline constexpr int kInjectPerWorker = 2;

class Injector {
 public:
  // Borrowed, outliving it: `workers`, `ledger`, `link`; `metrics` may be null.
  Injector(const WorkerViews& workers, const Ledger& ledger, WorkerLink& link, Metrics* metrics)
      : workers_(workers), ledger_(ledger), link_(link), metrics_(metrics) {}

  // Starts injection `id`: `callback` gets a kProgress per document, then
  // kDone (or kError when no prefill worker is up).
  void Start(uint64_t id, InjectJob job, JobCallback callback);
  // Its client went away: documents in flight finish, their replies are
  // dropped. False: no such injection.
  bool Cancel(uint64_t id) { return injections_.erase(id) != 0; }
  // A prefill worker's InjectReply about one document.
  void OnReply(size_t worker, const proto::WorkerMessage& m);
  // Prefill worker `worker` is down: its documents go to another.
  void OnWorkerDown(size_t worker);

 private:
  struct Injection {
    InjectJob job;
    JobCallback cb;
    std::deque<size_t> todo;  // documents not yet sent (or to send again)
    int in_flight = 0;
    InjectProgress progress;
  };
  // One document of an injection at one prefill worker.
  struct Part {
    uint64_t injection = 0;
    size_t document = 0;
    size_t worker = 0;
  };

  void Pump(uint64_t id);
  // `error` empty: stored (or `held`); else it failed, with `code`.
  void DocumentDone(Injection& inj, size_t doc, const std::string& error, bool held = false,
                    int64_t stored_tokens = 0, StatusCode code = StatusCode::kUnavailable);
  void End(std::map<uint64_t, Injection>::iterator it, JobEvent ev);

  const WorkerViews& workers_;
  const Ledger& ledger_;
  WorkerLink& link_;
  Metrics* const metrics_;

  std::map<uint64_t, Injection> injections_;
  std::map<uint64_t, Part> parts_;             // by message id
  uint64_t next_part_id_ = uint64_t{1} << 62;  // apart from the jobs' ids
};

}  // namespace kdn::router
