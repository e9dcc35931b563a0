// DecodeScheduler alone: no engine, no store, no socket. Requests, free
// blocks and time go in; plans come out (decode_scheduler.h).

#include "kdn/decode_worker/decode_scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace kdn::decode_worker {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Next = DecodeScheduler::Next;
using Ids = std::vector<uint64_t>;
using Tokens = std::vector<int64_t>;

const Clock::time_point kT0 = Clock::time_point() + 1h;

SchedulerOptions Options() {
  SchedulerOptions o;
  o.max_batch = 4;
  o.prepare_timeout = 1000ms;
  o.local_prefill_step_tokens = 64;
  o.max_prefill_tokens = 100;
  o.idle_prefill_tokens = 300;
  o.admission_reserve = 0.01;
  return o;
}

// A request prepared with its load in (or none needed), started and running.
void Running(DecodeScheduler& s, uint64_t id, bool blended = false) {
  s.Prepared(id, {.blended = blended, .tokens = 40, .have = 0, .loading = false}, kT0);
  ASSERT_TRUE(s.StartCame(id));
  s.Started(id);
  ASSERT_EQ(s.Phase(id), RequestPhase::kRunning);
}

// A local prefill of `tokens` tokens, `have` of them held.
void Local(DecodeScheduler& s, uint64_t id, int64_t tokens, int64_t have = 0) {
  s.Prepared(id, {.local = true, .tokens = tokens, .have = have, .loading = false}, kT0);
}

std::vector<int64_t> Counts(const std::vector<PrefillPiece>& pieces, uint64_t id) {
  std::vector<int64_t> out;
  for (const PrefillPiece& p : pieces) {
    if (p.id == id) out.push_back(p.count);
  }
  return out;
}

TEST(DecodeScheduler, AdmitsWhileTheBatchHasRoomAndNothingPreemptedWaits) {
  DecodeScheduler s(Options());
  EXPECT_TRUE(s.CanPrepare().ok());
  Running(s, 1);
  Running(s, 2);
  s.Prepared(3, {.tokens = 10, .loading = true}, kT0);
  Local(s, 4, 10);
  // Running, prepared and local requests all take a place.
  const Status full = s.CanPrepare();
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("4 of 4"), std::string::npos) << full.ToString();
  s.Forget(3);
  s.Forget(4);
  EXPECT_TRUE(s.CanPrepare().ok());
  s.Preempted(2, 50, 4);
  const Status waiting = s.CanPrepare();
  EXPECT_EQ(waiting.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(waiting.message().find("preempted"), std::string::npos) << waiting.ToString();
  s.Forget(2);  // its client went away while it waited
  EXPECT_TRUE(s.CanPrepare().ok());
}

TEST(DecodeScheduler, ANewRequestLeavesTheReserveFreeUnlessItIsAlone) {
  DecodeScheduler s(Options());
  // Alone it may take the whole pool: the reserve is for others' growth.
  EXPECT_EQ(s.ReserveBlocks(1000), 0);
  EXPECT_TRUE(s.LeavesReserve(0, 1000).ok());
  Running(s, 1);
  EXPECT_EQ(s.ReserveBlocks(1000), 10);
  EXPECT_TRUE(s.LeavesReserve(10, 1000).ok());
  EXPECT_EQ(s.LeavesReserve(9, 1000).code(), StatusCode::kResourceExhausted);
  // A pool under 100 blocks keeps none.
  EXPECT_TRUE(s.LeavesReserve(0, 99).ok());
}

TEST(DecodeScheduler, APreparedRequestExpiresUnlessStartedRenewedOrPrefilledHere) {
  DecodeScheduler s(Options());
  s.Prepared(1, {.tokens = 10, .loading = true}, kT0);   // its load out
  s.Prepared(2, {.tokens = 10, .loading = false}, kT0);  // waiting for its Start
  s.Prepared(3, {.tokens = 10, .loading = false}, kT0);  // renewed
  Running(s, 4);
  Local(s, 5, 10);
  EXPECT_TRUE(s.Schedule(kT0 + 1000ms, 100).expire.empty());  // not past it yet
  EXPECT_TRUE(s.Renew(3, kT0 + 900ms));
  EXPECT_FALSE(s.Renew(4, kT0 + 900ms)) << "a running request is no reservation";
  const StepPlan plan = s.Schedule(kT0 + 1001ms, 100);
  EXPECT_EQ(plan.expire, (Ids{1, 2}));
  EXPECT_FALSE(s.Phase(1).has_value());
  EXPECT_FALSE(s.Renew(1, kT0 + 1001ms)) << "an expired request is gone";
  EXPECT_EQ(s.Phase(3), RequestPhase::kReady);
  EXPECT_EQ(s.Schedule(kT0 + 1901ms, 100).expire, (Ids{3}));
  EXPECT_EQ(s.Phase(4), RequestPhase::kRunning);
  EXPECT_TRUE(s.Phase(5).has_value());
}

TEST(DecodeScheduler, AStartBeforeTheLoadBeginsTheRequestWhenTheLoadIsIn) {
  DecodeScheduler s(Options());
  s.Prepared(1, {.tokens = 40, .loading = true}, kT0);
  EXPECT_FALSE(s.StartCame(1));
  EXPECT_EQ(s.LoadIn(1, 32), Next::kBegin);
  s.Prepared(2, {.tokens = 40, .loading = true}, kT0);
  EXPECT_EQ(s.LoadIn(2, 32), Next::kWaitForStart);
  EXPECT_TRUE(s.StartCame(2));
  EXPECT_FALSE(s.StartCame(99));
}

TEST(DecodeScheduler, ALocalPrefillRunsWholeWhenNothingRunsInPiecesTheEngineTakes) {
  DecodeScheduler s(Options());
  Local(s, 1, 250, 20);  // 20 held: 230 to compute, at most 100 a call
  Local(s, 2, 30);
  const StepPlan plan = s.Schedule(kT0, 100);
  EXPECT_EQ(Counts(plan.prefill, 1), (Tokens{100, 100, 30}));
  EXPECT_EQ(Counts(plan.prefill, 2), (Tokens{30}));
  EXPECT_EQ(plan.prefill.front().first, 20);
  EXPECT_TRUE(plan.prefill[2].last);
  EXPECT_FALSE(plan.step);
  EXPECT_EQ(s.Phase(1), RequestPhase::kFirstSent);
  // The next plan admits both, oldest first, and steps.
  const StepPlan next = s.Schedule(kT0, 100);
  EXPECT_EQ(next.admit, (Ids{1, 2}));
  EXPECT_TRUE(next.step);
  EXPECT_EQ(s.counts().running, 2);
}

// With none running, a plan takes at most idle_prefill_tokens of the queue
// (the worker answers prepares between plans: a burst of queued prompts
// computed in one plan once held them past the router's wait, a 503 each).
TEST(DecodeScheduler, AnIdlePlanTakesABoundedShareOfAQueueOfLocalPrefills) {
  DecodeScheduler s(Options());
  for (uint64_t id = 1; id <= 4; ++id) Local(s, id, 150);
  StepPlan plan = s.Schedule(kT0, 100);
  EXPECT_EQ(Counts(plan.prefill, 1), (Tokens{100, 50}));
  EXPECT_EQ(Counts(plan.prefill, 2), (Tokens{100, 50}));
  EXPECT_TRUE(Counts(plan.prefill, 3).empty()) << "past the plan's 300 tokens";
  EXPECT_EQ(s.counts().local_backlog_tokens, 300);
  EXPECT_EQ(s.Phase(3), RequestPhase::kLocal);
  // Then the two run, and the rest goes in pieces between their steps.
  plan = s.Schedule(kT0, 100);
  EXPECT_EQ(plan.admit, (Ids{1, 2}));
  EXPECT_EQ(Counts(plan.prefill, 3), (Tokens{64}));
  EXPECT_TRUE(plan.step);
}

TEST(DecodeScheduler, ALocalPrefillTakesABoundedBudgetBetweenTheRunningRequestsSteps) {
  DecodeScheduler s(Options());
  Running(s, 1);
  Local(s, 2, 100);
  Local(s, 3, 10);
  StepPlan plan = s.Schedule(kT0, 100);
  EXPECT_EQ(Counts(plan.prefill, 2), (Tokens{64}));
  EXPECT_TRUE(Counts(plan.prefill, 3).empty()) << "the oldest first";
  EXPECT_TRUE(plan.step);
  EXPECT_EQ(s.counts().local_backlog_tokens, 36 + 10);
  // 36 finish request 2, 10 finish request 3 within the same budget: both
  // first tokens go out, and the step waits for the next plan.
  plan = s.Schedule(kT0, 100);
  EXPECT_EQ(Counts(plan.prefill, 2), (Tokens{36}));
  EXPECT_EQ(Counts(plan.prefill, 3), (Tokens{10}));
  EXPECT_FALSE(plan.step);
  // Owed: the step comes first, with the admissions and no piece.
  Local(s, 4, 10);
  plan = s.Schedule(kT0, 100);
  EXPECT_EQ(plan.admit, (Ids{2, 3}));
  EXPECT_TRUE(plan.prefill.empty());
  EXPECT_TRUE(plan.step);
  plan = s.Schedule(kT0, 100);
  EXPECT_EQ(Counts(plan.prefill, 4), (Tokens{10}));
}

TEST(DecodeScheduler, TheNewestAdmittedArePreemptedFirstAndBlendedNever) {
  DecodeScheduler s(Options());
  Running(s, 1);
  Running(s, 2, /*blended=*/true);
  Running(s, 3);
  Running(s, 4);
  StepPlan plan = s.Schedule(kT0, 0);
  EXPECT_TRUE(plan.step);
  EXPECT_EQ(plan.preempt, (Ids{4, 3, 1}));
  // A resumed request keeps its place in the order.
  s.Preempted(3, 50, 4);
  plan = s.Schedule(kT0, 100);
  ASSERT_EQ(plan.resume, (Ids{3}));
  s.Resumed(3, 50, /*loading=*/false, kT0);  // all resident
  plan = s.Schedule(kT0, 100);
  ASSERT_EQ(plan.prefill.size(), 1u);
  EXPECT_EQ(plan.prefill[0].count, 0);
  EXPECT_TRUE(plan.prefill[0].last && plan.prefill[0].resume);
  EXPECT_TRUE(plan.step) << "a resume sends no first token: the step goes on";
  EXPECT_EQ(plan.preempt, (Ids{4, 3, 1}));
}

TEST(DecodeScheduler, PreemptedRequestsResumeOldestFirstWhileEachFitsWithABlockPerRunning) {
  DecodeScheduler s(Options());
  Running(s, 1);
  Running(s, 2);
  Running(s, 3);
  s.Preempted(3, 60, 5);
  s.Preempted(2, 60, 5);
  EXPECT_EQ(s.counts().resume_blocks, 10);
  // One running: 2 (older) needs 5 + 1.
  EXPECT_TRUE(s.Schedule(kT0, 5).resume.empty());
  StepPlan plan = s.Schedule(kT0, 10);
  EXPECT_EQ(plan.resume, (Ids{2})) << "5 + 1 of 10 fit, then 5 + 1 of the 5 left do not";
  // The cache could not reserve it after all: it waits on, first in line.
  s.ResumeDeferred(2);
  plan = s.Schedule(kT0, 12);
  EXPECT_EQ(plan.resume, (Ids{2, 3}));
}

TEST(DecodeScheduler, AResumeComesBackByPoolByKdnOrByRecompute) {
  DecodeScheduler s(Options());
  for (uint64_t id : {1, 2, 3}) Running(s, id);
  for (uint64_t id : {1, 2, 3}) s.Preempted(id, 80, 6);
  // All three fit in an empty pool, one after another.
  StepPlan plan = s.Schedule(kT0, 18);
  ASSERT_EQ(plan.resume, (Ids{1, 2, 3}));
  s.Resumed(1, 80, /*loading=*/false, kT0);  // the pool held it all
  s.Resumed(2, 48, /*loading=*/true, kT0);   // a load is out for the rest
  s.Resumed(3, 0, /*loading=*/true, kT0);
  EXPECT_EQ(s.LoadIn(2, 80), Next::kCompute);  // the KDN gave it all
  EXPECT_EQ(s.LoadIn(3, 50), Next::kCompute);  // 30 to recompute
  plan = s.Schedule(kT0, 0);
  EXPECT_EQ(Counts(plan.prefill, 1), (Tokens{0}));
  EXPECT_EQ(Counts(plan.prefill, 2), (Tokens{0}));
  EXPECT_EQ(Counts(plan.prefill, 3), (Tokens{30}));
  for (const PrefillPiece& p : plan.prefill) EXPECT_TRUE(p.resume && p.last);
  EXPECT_TRUE(plan.step) << "resumes send no first token";
  EXPECT_EQ(s.counts().running, 3);
  EXPECT_EQ(s.counts().preempted, 0);
  // Resumes never expire, however long their load takes.
  s.Preempted(3, 90, 6);
  ASSERT_EQ(s.Schedule(kT0, 6 + 2).resume, (Ids{3}));
  s.Resumed(3, 0, /*loading=*/true, kT0);
  EXPECT_TRUE(s.Schedule(kT0 + 1h, 0).expire.empty());
}

TEST(DecodeScheduler, ACancelledRequestLeavesEveryQueue) {
  DecodeScheduler s(Options());
  Local(s, 1, 100);
  Local(s, 2, 100);
  s.Forget(1);  // cancelled while it waited for its compute
  StepPlan plan = s.Schedule(kT0, 100);
  EXPECT_TRUE(Counts(plan.prefill, 1).empty());
  EXPECT_EQ(Counts(plan.prefill, 2), (Tokens{100}));
  s.Forget(2);  // cancelled with its first token out
  plan = s.Schedule(kT0, 100);
  EXPECT_TRUE(plan.admit.empty());
  EXPECT_FALSE(s.HasWork(100));
  EXPECT_EQ(s.counts().prepared, 0);
}

TEST(DecodeScheduler, HasWorkWhileAnythingWouldBeComputedOrAPreemptedRequestFits) {
  DecodeScheduler s(Options());
  EXPECT_FALSE(s.HasWork(100));
  s.Prepared(1, {.tokens = 10, .loading = true}, kT0);
  EXPECT_FALSE(s.HasWork(100)) << "a load out is the mailbox's to report";
  Local(s, 2, 10);
  EXPECT_TRUE(s.HasWork(0));
  (void)s.Schedule(kT0, 100);  // its first token out
  EXPECT_TRUE(s.HasWork(0));
  (void)s.Schedule(kT0, 100);  // admitted: it runs
  EXPECT_TRUE(s.HasWork(0));
  s.Preempted(2, 30, 3);
  EXPECT_FALSE(s.HasWork(2));
  EXPECT_TRUE(s.HasWork(3));
}

}  // namespace
}  // namespace kdn::decode_worker
