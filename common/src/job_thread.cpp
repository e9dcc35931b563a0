#include "kdn/common/job_thread.h"

#include <algorithm>

namespace kdn {

JobThread::JobThread(int lanes) {
  {
    MutexLock lock(mu_);
    lanes_.resize(static_cast<size_t>(std::max(lanes, 1)));
  }
  thread_ = std::thread([this] { Loop(); });
}

JobThread::~JobThread() { (void)Stop(); }

void JobThread::Post(int lane, Job job) {
  {
    MutexLock lock(mu_);
    if (stop_) return;
    const auto i =
        static_cast<size_t>(std::clamp<int>(lane, 0, static_cast<int>(lanes_.size()) - 1));
    lanes_[i].push_back(std::move(job));
    ++queued_;
  }
  wake_.Signal();
}

void JobThread::Drain() {
  MutexLock lock(mu_);
  while (!stop_ && (queued_ > 0 || running_)) idle_.Wait(mu_);
}

size_t JobThread::pending() const {
  MutexLock lock(mu_);
  return queued_;
}

size_t JobThread::Stop() {
  std::vector<std::deque<Job>> dropped;
  size_t count = 0;
  {
    MutexLock lock(mu_);
    stop_ = true;
    count = queued_;
    queued_ = 0;
    for (auto& lane : lanes_) dropped.push_back(std::move(lane));
  }
  wake_.SignalAll();
  idle_.SignalAll();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  return count;  // `dropped` goes here, outside the lock: closures may own heavy state
}

void JobThread::Loop() {
  for (;;) {
    Job job;
    {
      MutexLock lock(mu_);
      running_ = false;
      if (queued_ == 0) idle_.SignalAll();
      while (!stop_ && queued_ == 0) wake_.Wait(mu_);
      if (stop_) return;
      for (auto& lane : lanes_) {
        if (lane.empty()) continue;
        job = std::move(lane.front());
        lane.pop_front();
        break;
      }
      --queued_;
      running_ = true;
    }
    job();
  }
}

}  // namespace kdn
