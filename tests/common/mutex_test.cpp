#include "kdn/common/mutex.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

namespace kdn {
namespace {

// A counter whose every access the analysis checks (in the clang build).
class Counter {
 public:
  void Add() KDN_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    ++n_;
    cv_.SignalAll();
  }
  // Waits until the count reaches `n`; false if `deadline` comes first.
  bool WaitFor(int n, std::chrono::steady_clock::time_point deadline) KDN_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    while (n_ < n) {
      if (!cv_.WaitUntil(mu_, deadline)) return n_ >= n;
    }
    return true;
  }
  int value() const KDN_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return n_;
  }

 private:
  mutable Mutex mu_;
  CondVar cv_;
  int n_ KDN_GUARDED_BY(mu_) = 0;
};

TEST(Mutex, MutexLockMakesIncrementsFromManyThreadsExact) {
  Counter c;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) c.Add();
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c.value(), 40000);
}

TEST(CondVar, WaitUntilWakesOnASignalBeforeTheDeadline) {
  Counter c;
  std::thread adder([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    c.Add();
  });
  EXPECT_TRUE(c.WaitFor(1, std::chrono::steady_clock::now() + std::chrono::seconds(30)));
  adder.join();
}

TEST(CondVar, WaitUntilReturnsFalseOnceTheDeadlinePasses) {
  Counter c;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(c.WaitFor(1, start + std::chrono::milliseconds(50)));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(50));
  EXPECT_EQ(c.value(), 0);
}

}  // namespace
}  // namespace kdn
