#include "kdn/common/job_thread.h"

#include <gtest/gtest.h>

#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace kdn {
namespace {

TEST(JobThread, RunsUrgentLanesFirstAndEachLaneInOrder) {
  JobThread jobs(3);
  std::mutex mu;
  std::vector<int> order;
  auto record = [&](int v) {
    return [&, v] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(v);
    };
  };
  // Hold the thread in a first job so that everything after it queues.
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  std::promise<void> started;
  jobs.Post(0, [&, open] {
    started.set_value();
    open.wait();
  });
  started.get_future().wait();
  jobs.Post(2, record(20));
  jobs.Post(1, record(10));
  jobs.Post(2, record(21));
  jobs.Post(0, record(0));
  jobs.Post(1, record(11));
  jobs.Post(7, record(22));  // beyond the last lane: the last lane
  EXPECT_EQ(jobs.pending(), 6u);
  gate.set_value();
  jobs.Drain();
  EXPECT_EQ(order, (std::vector<int>{0, 10, 11, 20, 21, 22}));
  EXPECT_EQ(jobs.pending(), 0u);
}

TEST(JobThread, StopDropsQueuedJobsAndLaterPosts) {
  JobThread jobs(1);
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  std::promise<void> started;
  int ran = 0;
  jobs.Post(0, [&, open] {
    started.set_value();
    open.wait();
  });
  jobs.Post(0, [&] { ++ran; });
  jobs.Post(0, [&] { ++ran; });
  started.get_future().wait();
  // Let the running job end only once Stop has dropped the queue.
  std::thread opener([&] {
    while (jobs.pending() != 0) std::this_thread::yield();
    gate.set_value();
  });
  EXPECT_EQ(jobs.Stop(), 2u);  // the running job finishes; the two queued do not run
  opener.join();
  jobs.Post(0, [&] { ++ran; });
  jobs.Drain();  // returns at once once stopped
  EXPECT_EQ(ran, 0);
  EXPECT_EQ(jobs.Stop(), 0u);
}

}  // namespace
}  // namespace kdn
