// Placement's rules (kdn/router/placement.h) over hand-made worker views and
// ledgers: no sockets, no workers. Each rule has a test that fails when the
// rule is broken.
#include "kdn/router/placement.h"

#include <gtest/gtest.h>

namespace kdn::router {
namespace {

WorkerView Worker(Role role, std::string name) {
  WorkerView v;
  v.name = std::move(name);
  v.role = role;
  v.up = true;
  v.compatible = true;
  if (role == Role::kDecode) {
    v.free_kv_blocks = 100;
    v.total_kv_blocks = 100;
  }
  return v;
}

// Workers 0, 1 prefill; 2, 3 decode; every one answered the lookup with
// `prefix` (set per test).
class PlacementTest : public ::testing::Test {
 protected:
  PlacementTest()
      : workers_({Worker(Role::kPrefill, "p0"), Worker(Role::kPrefill, "p1"),
                  Worker(Role::kDecode, "d0"), Worker(Role::kDecode, "d1")}),
        ledger_(4) {
    for (size_t w = 0; w < 4; ++w) prefix_[w] = 0;
    in_.tokens = 64;
    in_.kv_blocks = KvBlocksFor(KvTokensAdmitted(64, 64 + 200, false));  // max_tokens 200
    in_.kv_blocks_whole = KvBlocksFor(64 + 200);
    in_.prefix = &prefix_;
    in_.segment_tokens_held = &held_;
    in_.resident = &resident_;
  }
  std::optional<size_t> Prefill() const { return PlacePrefill(workers_, ledger_, in_); }
  DecodePlacement Decode() const { return PlaceDecode(workers_, ledger_, in_); }

  WorkerViews workers_;
  Ledger ledger_;
  std::map<size_t, int64_t> prefix_, held_, resident_;
  PlacementInput in_;
};

using Verdict = DecodePlacement::Verdict;

// --- path: PrefillLocally's cost model (p0 prefill, d0 decode).

TEST_F(PlacementTest, PathFollowsTheModeAndNeverTakesBlendedOrResumedRequestsLocally) {
  prefix_[2] = 60;  // d0 lacks 4 tokens, p0 all 64: auto says local
  EXPECT_TRUE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  EXPECT_FALSE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAlways, 512));
  prefix_[2] = 0;  // auto would not; never forces it
  workers_[2].local_prefill.set_running(4);
  EXPECT_FALSE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  EXPECT_TRUE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kNever, 512));
  BlendSpec blend;
  in_.blend = &blend;
  EXPECT_FALSE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kNever, 512));
  in_.blend = nullptr;
  in_.resumed = true;
  EXPECT_FALSE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kNever, 512));
}

TEST_F(PlacementTest, AutoPrefillsLocallyWhatTheDecodeWorkerLacksUpToTheCap) {
  in_.tokens = 1000;
  prefix_[2] = 900;  // d0 lacks 100; p0 reaches as much: equal work, local saves the move
  prefix_[0] = 900;
  EXPECT_TRUE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  EXPECT_FALSE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 99));
  // p0 reaches more than d0: it computes less.
  prefix_[0] = 950;
  EXPECT_FALSE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  // ...unless tokens queue at p0.
  workers_[0].queue_tokens = 100;
  EXPECT_TRUE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  // The whole prompt held at d0 still costs its last token.
  prefix_[2] = 1000;
  prefix_[0] = 0;
  workers_[0].queue_tokens = 0;
  EXPECT_TRUE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 1));
}

TEST_F(PlacementTest, AutoCountsTheDecodeWorkersBacklogAndItsRunningBatchesSteps) {
  in_.tokens = 1000;
  prefix_[2] = 900;  // d0 lacks 100
  prefix_[0] = 800;  // p0 lacks 200
  EXPECT_TRUE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  // Local prefills already queued there, reported or routed since.
  workers_[2].local_prefill.set_backlog_tokens(60);
  EXPECT_TRUE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  ledger_.ReserveLocal(2, 50, 1);
  EXPECT_FALSE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  ledger_.Clear(2);
  workers_[2].local_prefill.set_backlog_tokens(0);
  // Requests running there: pieces of 50 tokens, each after a step that
  // costs 20 ms, at 1 ms a token: 100 + 2 * 20 = 140 <= 200, local.
  workers_[2].local_prefill.set_running(8);
  workers_[2].local_prefill.set_step_ms(20);
  workers_[2].local_prefill.set_prefill_ms_per_token(1);
  workers_[2].local_prefill.set_step_tokens(50);
  EXPECT_TRUE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  // Steps of 60 ms: 100 + 2 * 60 = 220 > 200, the prefill worker.
  workers_[2].local_prefill.set_step_ms(60);
  EXPECT_FALSE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  // Before any measure a step counts as a piece: 100 + 2 * 50 = 200, local.
  workers_[2].local_prefill.set_step_ms(0);
  EXPECT_TRUE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  workers_[2].local_prefill.set_step_tokens(25);  // 100 + 4 * 25 = 200
  EXPECT_TRUE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
  prefix_[0] = 801;  // p0 lacks 199
  EXPECT_FALSE(PrefillLocally(workers_, ledger_, in_, 0, 2, Disaggregation::kAuto, 512));
}

TEST(KvBlocks, AreCountedInBlocksOfTheOneConstant) {
  EXPECT_EQ(kKvBlockTokens, 16);
  EXPECT_EQ(KvBlocksFor(0), 0);
  EXPECT_EQ(KvBlocksFor(1), 1);
  EXPECT_EQ(KvBlocksFor(16), 1);
  EXPECT_EQ(KvBlocksFor(17), 2);
}

TEST_F(PlacementTest, PrefillGoesWhereMoreOfThePromptIsReached) {
  prefix_[1] = 32;
  EXPECT_EQ(Prefill(), 1u);
  prefix_[0] = 48;
  EXPECT_EQ(Prefill(), 0u);
}

TEST_F(PlacementTest, PrefillAtEqualWorkPrefersThePrefixResidentInThePool) {
  prefix_[0] = prefix_[1] = 48;
  resident_[1] = 48;  // p1's pool holds it; p0 would load it from a lower tier
  EXPECT_EQ(Prefill(), 1u);
  resident_[1] = 0;
  resident_[0] = 32;
  EXPECT_EQ(Prefill(), 0u);
  // More work is not made up for by residency.
  prefix_[1] = 49;
  EXPECT_EQ(Prefill(), 1u);
}

TEST_F(PlacementTest, DecodeAtAnEqualPrefixPrefersTheOneHoldingItResident) {
  prefix_[2] = prefix_[3] = 48;
  resident_[3] = 48;
  workers_[3].queue_depth = 2;  // busier, yet its pool holds the prompt
  EXPECT_EQ(Decode().worker, 3u);
  resident_[3] = 0;
  EXPECT_EQ(Decode().worker, 2u);
  // Residency counts for nothing in a blend request.
  resident_[3] = 48;
  BlendSpec blend;
  blend.segment_tokens = {32};
  in_.blend = &blend;
  EXPECT_EQ(Decode().worker, 2u);
}

TEST_F(PlacementTest, PrefillWeighsQueuedTokensAgainstThePrefix) {
  prefix_[0] = 32;                // 32 to compute
  workers_[0].queue_tokens = 40;  // ... behind 40: 72
  EXPECT_EQ(Prefill(), 1u);       // 64 to compute, nothing queued
  workers_[0].queue_tokens = 20;  // 52
  EXPECT_EQ(Prefill(), 0u);
}

TEST_F(PlacementTest, PrefillAlwaysComputesTheLastToken) {
  prefix_[0] = 64;  // the whole prompt: still 1 to compute, + 1 queued = 2
  workers_[0].queue_tokens = 1;
  prefix_[1] = 63;  // 1 to compute
  EXPECT_EQ(Prefill(), 1u);
}

TEST_F(PlacementTest, PrefillCountsTheRouterReservationsAsQueued) {
  prefix_[0] = 32;
  ledger_.Reserve(/*prefill=*/0, /*decode=*/2, /*prompt_tokens=*/40, /*kv_blocks=*/1);
  EXPECT_EQ(Prefill(), 1u);
  ledger_.Clear(0);  // the worker reported: its report shows the 40
  EXPECT_EQ(Prefill(), 0u);
}

TEST_F(PlacementTest, PrefillCountsHeldDocumentsAtTheirRecomputeShare) {
  BlendSpec blend;
  blend.recompute_ratio = 0.25;
  in_.blend = &blend;
  held_[0] = 40;                  // saves 30 of 64: 34 to compute
  workers_[0].queue_tokens = 20;  // 54 < 64
  EXPECT_EQ(Prefill(), 0u);
  blend.recompute_ratio = 0.75;  // saves 10: 54 + 20 = 74 > 64
  EXPECT_EQ(Prefill(), 1u);
  prefix_[1] = 60;  // a blend prompt's prefix counts for nothing
  workers_[0].queue_tokens = 0;
  EXPECT_EQ(Prefill(), 0u);
}

TEST_F(PlacementTest, PrefillTakesOnlyUsableWorkersThatAnswered) {
  prefix_[0] = 32;
  prefix_[1] = -1;  // no answer
  EXPECT_EQ(Prefill(), 0u);
  workers_[0].up = false;
  EXPECT_EQ(Prefill(), std::nullopt);
  workers_[0].up = true;
  workers_[0].compatible = false;
  EXPECT_EQ(Prefill(), std::nullopt);
}

TEST_F(PlacementTest, DecodeGoesWhereMostIsHeldThenWhereLeastIsQueued) {
  prefix_[3] = 32;
  workers_[3].queue_depth = 5;
  EXPECT_EQ(Decode().verdict, Verdict::kRoute);
  EXPECT_EQ(Decode().worker, 3u);
  prefix_[3] = 0;
  EXPECT_EQ(Decode().worker, 2u);  // equal prefix: the less busy
  workers_[2].queue_depth = 6;
  EXPECT_EQ(Decode().worker, 3u);
}

TEST_F(PlacementTest, DecodeNeedsKvForPromptAndMaxTokens) {
  workers_[3].free_kv_blocks = 0;
  workers_[2].free_kv_blocks = static_cast<int>(in_.kv_blocks);  // just enough
  EXPECT_EQ(Decode().verdict, Verdict::kRoute);
  EXPECT_EQ(Decode().worker, 2u);
  workers_[2].free_kv_blocks = static_cast<int>(in_.kv_blocks) - 1;
  EXPECT_EQ(Decode().verdict, Verdict::kWait);
}

TEST_F(PlacementTest, DecodeNeedsAPlaceInTheBatch) {
  for (size_t w : {2u, 3u}) {
    workers_[w].max_batch = 2;
    workers_[w].queue_depth = 2;
  }
  EXPECT_EQ(Decode().verdict, Verdict::kWait);
  workers_[3].queue_depth = 1;
  EXPECT_EQ(Decode().verdict, Verdict::kRoute);
  EXPECT_EQ(Decode().worker, 3u);
  workers_[3].max_batch = 0;  // not said: no limit
  workers_[3].queue_depth = 50;
  EXPECT_EQ(Decode().verdict, Verdict::kRoute);
}

TEST_F(PlacementTest, DecodeAdmitsByWhatTheRequestNeedsNowNotItsWholeLength) {
  EXPECT_EQ(in_.kv_blocks, 5);  // 64 tokens and a block to grow
  for (size_t w : {2u, 3u}) workers_[w].free_kv_blocks = 5;
  EXPECT_EQ(Decode().verdict, Verdict::kRoute);  // not the 17 blocks of 64 + 200
  for (size_t w : {2u, 3u}) workers_[w].free_kv_blocks = 4;
  EXPECT_EQ(Decode().verdict, Verdict::kWait);
  // A blended prompt takes its whole length at once.
  EXPECT_EQ(KvTokensAdmitted(64, 64 + 200, true), 264);
  // A short max_tokens needs no margin past it.
  EXPECT_EQ(KvTokensAdmitted(64, 64 + 4, false), 68);
}

TEST_F(PlacementTest, DecodeWaitsWhenOneCouldHoldItAndRefusesWhenNoneEver) {
  for (size_t w : {2u, 3u}) workers_[w].free_kv_blocks = 1;
  EXPECT_EQ(Decode().verdict, Verdict::kWait);
  workers_[2].total_kv_blocks = static_cast<int>(in_.kv_blocks_whole) - 1;
  EXPECT_EQ(Decode().verdict, Verdict::kWait);  // worker 3 could
  workers_[3].total_kv_blocks = static_cast<int>(in_.kv_blocks_whole) - 1;
  EXPECT_EQ(Decode().verdict, Verdict::kTooLarge);
  workers_[3].total_kv_blocks = static_cast<int>(in_.kv_blocks_whole);  // just big enough, one day
  EXPECT_EQ(Decode().verdict, Verdict::kWait);
  workers_[3].total_kv_blocks = 0;  // not said: it might
  EXPECT_EQ(Decode().verdict, Verdict::kWait);
  workers_[2].up = false;
  prefix_[3] = -1;
  EXPECT_EQ(Decode().verdict, Verdict::kNoneUp);
}

TEST_F(PlacementTest, DecodeCountsTheRouterReservations) {
  workers_[3].free_kv_blocks = 0;
  ledger_.Reserve(0, 2, 64, 100 - in_.kv_blocks + 1);
  EXPECT_EQ(Decode().verdict, Verdict::kWait);
  ledger_.Clear(2);
  EXPECT_EQ(Decode().verdict, Verdict::kRoute);
  ledger_.MarkFull(2, workers_[2]);  // it refused a prepare for want of KV
  EXPECT_EQ(Decode().verdict, Verdict::kWait);
  ledger_.Clear(2);
  workers_[2].max_batch = 1;
  ledger_.Reserve(0, 2, 64, 1);  // one place taken
  EXPECT_EQ(Decode().verdict, Verdict::kWait);
}

TEST_F(PlacementTest, DecodeForABlendRequestCountsNoHeldPrefix) {
  BlendSpec blend;
  in_.blend = &blend;
  prefix_[2] = 48;
  workers_[2].queue_depth = 3;
  EXPECT_EQ(Decode().worker, 3u);
  in_.blend = nullptr;
  EXPECT_EQ(Decode().worker, 2u);
}

TEST_F(PlacementTest, RetryGoesToTheOtherPrefillWorkerWithFewestQueuedTokens) {
  workers_.push_back(Worker(Role::kPrefill, "p2"));
  ledger_ = Ledger(5);
  workers_[1].queue_tokens = 10;
  workers_[4].queue_tokens = 5;
  EXPECT_EQ(PlaceRetry(workers_, ledger_, 0), 4u);
  ledger_.Reserve(4, 2, 10, 1);
  EXPECT_EQ(PlaceRetry(workers_, ledger_, 0), 1u);
  EXPECT_EQ(PlaceRetry(workers_, ledger_, 1), 0u);  // never the lost one
  workers_[0].up = false;
  workers_[4].up = false;
  EXPECT_EQ(PlaceRetry(workers_, ledger_, 1), std::nullopt);
}

TEST_F(PlacementTest, DocumentsGoToFewestInFlightThenFewestQueuedBelowTheCap) {
  std::vector<int> in_flight = {1, 0, 0, 0};
  EXPECT_EQ(PlaceDocument(workers_, ledger_, in_flight, 2), 1u);
  in_flight = {1, 1, 0, 0};
  workers_[0].queue_tokens = 9;
  EXPECT_EQ(PlaceDocument(workers_, ledger_, in_flight, 2), 1u);
  ledger_.Reserve(1, 2, 10, 1);
  EXPECT_EQ(PlaceDocument(workers_, ledger_, in_flight, 2), 0u);
  in_flight = {2, 2, 0, 0};
  EXPECT_EQ(PlaceDocument(workers_, ledger_, in_flight, 2), std::nullopt);
  in_flight = {0, 0, 0, 0};
  workers_[0].up = false;
  workers_[1].compatible = false;
  EXPECT_EQ(PlaceDocument(workers_, ledger_, in_flight, 2), std::nullopt);  // never a decode worker
}

}  // namespace
}  // namespace kdn::router
