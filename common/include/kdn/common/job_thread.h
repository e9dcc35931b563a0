#pragma once
// JobThread: one background thread that runs queued jobs, for blocking I/O
// that must stay off a compute loop and off a socket's I/O thread (a worker's
// round trips to kdn-store: lookups, loads, stores).
//
// Jobs run one at a time. A JobThread has a fixed number of lanes; a queued
// job of lane 0 runs before any of lane 1, and so on; within a lane, jobs run
// in the order they were posted. A job already running is never interrupted,
// so an urgent job waits at most for the one running.
//
// Thread-safe: Post, Drain, pending() and Stop from any thread. A job may
// Post, but must not Drain or Stop its own JobThread. Jobs must not throw.
// Whatever a job borrows must outlive the JobThread (or its Stop).

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "kdn/common/mutex.h"

namespace kdn {

class JobThread {
 public:
  using Job = std::function<void()>;

  // Starts the thread. `lanes` is at least 1.
  explicit JobThread(int lanes = 1);
  // Stop().
  ~JobThread();
  JobThread(const JobThread&) = delete;
  JobThread& operator=(const JobThread&) = delete;

  // Queues `job` in `lane` (clamped to the lanes there are). After Stop the
  // job is dropped unrun.
  void Post(int lane, Job job) KDN_EXCLUDES(mu_);

  // Blocks until no job is queued or running (or the thread has stopped).
  // For owners that must know their jobs are done, such as tests.
  void Drain() KDN_EXCLUDES(mu_);

  // Jobs queued and not yet started.
  size_t pending() const KDN_EXCLUDES(mu_);

  // Lets the running job finish, drops the queued ones unrun, and joins the
  // thread. Posts after it are dropped. Idempotent. Returns how many queued
  // jobs were dropped.
  size_t Stop() KDN_EXCLUDES(mu_);

 private:
  void Loop() KDN_EXCLUDES(mu_);

  mutable Mutex mu_;
  CondVar wake_;  // a job was posted, or stop_
  CondVar idle_;  // the queue ran dry
  std::vector<std::deque<Job>> lanes_ KDN_GUARDED_BY(mu_);
  size_t queued_ KDN_GUARDED_BY(mu_) = 0;
  bool running_ KDN_GUARDED_BY(mu_) = false;  // a job is running now
  bool stop_ KDN_GUARDED_BY(mu_) = false;

  std::thread thread_;  // last: started after everything above exists
};

}  // namespace kdn
