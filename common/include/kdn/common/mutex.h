#pragma once
// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with
// Clang's thread-safety annotations (kdn/common/thread_annotations.h), which
// libstdc++'s own types lack, after leveldb's port::Mutex and util/mutexlock.h.
//
//   mutable Mutex mu_;
//   int count_ KDN_GUARDED_BY(mu_) = 0;
//   void Add() KDN_EXCLUDES(mu_) { MutexLock lock(mu_); ++count_; }
//
// A wait is a loop over the condition, written where the guarded members
// are, so that the analysis sees them read with the mutex held:
//   while (!ready_) cv_.Wait(mu_);
//
// Thread-safe, as the std types they wrap.

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "kdn/common/thread_annotations.h"

namespace kdn {

class KDN_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() KDN_ACQUIRE() { mu_.lock(); }
  void Unlock() KDN_RELEASE() { mu_.unlock(); }
  // Tells the analysis that the caller holds the mutex (it checks nothing at run time).
  void AssertHeld() const KDN_ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds `mu` for its scope.
class KDN_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) KDN_ACQUIRE(mu) : mu_(mu) { mu_.Lock(); }
  ~MutexLock() KDN_RELEASE() { mu_.Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

// A condition variable waited on with a Mutex held.
class CondVar {
 public:
  // Lets go of `mu`, waits for a Signal (or a spurious wake-up), takes `mu` again.
  void Wait(Mutex& mu) KDN_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held: the caller's
  }
  // As Wait, but returns false once `deadline` has passed.
  template <class Clock, class Duration>
  bool WaitUntil(Mutex& mu, const std::chrono::time_point<Clock, Duration>& deadline)
      KDN_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    const bool woken = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return woken;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace kdn
