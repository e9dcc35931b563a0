// DecodeService's checks on Prepare, with raw ZeroMQ peers standing in for
// routers: a peer's budget (its prepared, unstarted requests hold at most a
// share of the KV pool) and leases (a silent peer's unstarted requests are
// let go). The tests wait for what the worker reports, never for a length
// of time that a slow machine could miss.
#include "kdn/decode_worker/decode_service.h"

#include <gtest/gtest.h>
#include <zmq.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include "kdn/testing/temp_dir.h"
#include "kdn/testing/tiny_model.h"
#include "kdn/testing/control_peer.h"
#include "kdn/engine/generate.h"
#include "kdn/engine/presets.h"
#include "kdn/kvbus/chunk.h"
#include "serving.pb.h"

namespace kdn::decode_worker {
namespace {

using kdn::testing::TempDir;
using namespace std::chrono_literals;

// With max_tokens 4, a request reserves 64 tokens: 4 KV blocks of 16.
constexpr int kPromptTokens = 60;

// A router stand-in that prepares requests and asks for info.
class Peer : public testing::ControlPeer {
 public:
  using ControlPeer::ControlPeer;

  // Prepares request `id` and returns the worker's reply.
  proto::WorkerMessage Prepare(uint64_t id) {
    proto::WorkerMessage m;
    m.set_request_id(id);
    auto* p = m.mutable_prepare();
    for (int i = 0; i < kPromptTokens; ++i) p->add_tokens(1 + (i * 7 + static_cast<int>(id)) % 250);
    p->mutable_sampling()->set_top_p(1.0f);
    p->set_max_tokens(4);
    p->set_transfer_id(std::string(16, static_cast<char>('a' + id % 26)));
    Send(m);
    return Receive();
  }

  // The worker's free KV blocks, by an info request (which also keeps this
  // peer's leases alive).
  int FreeBlocks() { return Info().free_kv_blocks(); }

  // Its info (free_kv_blocks -1 when none came).
  proto::WorkerInfo Info() {
    proto::WorkerMessage m;
    m.mutable_info_request();
    Send(m);
    for (;;) {
      proto::WorkerMessage r = Receive();
      if (r.body_case() == proto::WorkerMessage::kInfo) return r.info();
      if (r.body_case() == proto::WorkerMessage::BODY_NOT_SET) {
        proto::WorkerInfo none;
        none.set_free_kv_blocks(-1);
        return none;
      }
    }
  }
};

class DecodeServiceTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(kdn::testing::WriteTinyModel(dir_.path()).ok()); }

  // A worker whose leases and timeouts run on `clock` when one is given.
  std::unique_ptr<DecodeService> Start(
      std::chrono::milliseconds lease, double share,
      std::function<std::chrono::steady_clock::time_point()> clock = {}) {
    auto d = DecodeService::Start({.model_dir = dir_.path(),
                                   .host_bytes = 16u << 20,
                                   .staging_bytes = 16u << 20,
                                   .chunk_tokens = 16,
                                   .engine = {.kv_tokens = 256, .threads = 1},
                                   .peer_lease = lease,
                                   .clock = std::move(clock),
                                   .peer_prepare_share = share});
    EXPECT_TRUE(d.ok()) << d.status().ToString();
    return d.ok() ? std::move(d).value() : nullptr;
  }

  TempDir dir_;
  zmq::context_t ctx_;
};

bool Refused(const proto::WorkerMessage& reply, StatusCode code) {
  return reply.has_prepare_reply() && reply.prepare_reply().has_error() &&
         reply.prepare_reply().error().code() == static_cast<int>(code);
}

// 256 tokens of KV are 16 blocks; a share of 0.5 lets one peer's unstarted
// requests hold 8: two prompts of 4 blocks, not a third. Another peer has a
// budget of its own.
TEST_F(DecodeServiceTest, APeersUnstartedRequestsStayWithinItsBudget) {
  auto d = Start(60s, 0.5);
  ASSERT_NE(d, nullptr);
  Peer a(ctx_, d->endpoint()), b(ctx_, d->endpoint());
  for (uint64_t id : {1, 2}) {
    const auto r = a.Prepare(id);
    ASSERT_TRUE(r.has_prepare_reply()) << r.DebugString();
    EXPECT_FALSE(r.prepare_reply().has_error()) << r.DebugString();
  }
  const auto third = a.Prepare(3);
  EXPECT_TRUE(Refused(third, StatusCode::kResourceExhausted)) << third.DebugString();
  EXPECT_NE(third.prepare_reply().error().message().find("--peer-prepare-share"),
            std::string::npos);
  const auto other = b.Prepare(4);
  EXPECT_FALSE(other.prepare_reply().has_error()) << other.DebugString();
  EXPECT_EQ(b.FreeBlocks(), 16 - 3 * 4);

  // A cancelled request leaves the budget: the peer may prepare again.
  proto::WorkerMessage cancel;
  cancel.set_request_id(1);
  cancel.mutable_cancel();
  a.Send(cancel);
  const auto cancelled = a.Receive();
  ASSERT_TRUE(cancelled.has_tokens()) << cancelled.DebugString();
  EXPECT_EQ(cancelled.tokens().events(0).finish_reason(), "cancelled");
  const auto again = a.Prepare(5);
  EXPECT_FALSE(again.prepare_reply().has_error()) << again.DebugString();
}

// A peer that goes silent loses its unstarted requests after the lease
// (they end "cancelled", their blocks free); a peer that keeps talking keeps
// its own. The leases run on a clock the test moves, so that a slow machine
// cannot make the live peer look silent.
TEST_F(DecodeServiceTest, ASilentPeersUnstartedRequestsAreLetGo) {
  std::atomic<std::chrono::steady_clock::time_point> now{std::chrono::steady_clock::time_point{} +
                                                         1h};
  auto d = Start(300ms, 1.0, [&now] { return now.load(); });
  ASSERT_NE(d, nullptr);
  Peer silent(ctx_, d->endpoint()), live(ctx_, d->endpoint());
  for (uint64_t id : {1, 2}) EXPECT_FALSE(silent.Prepare(id).prepare_reply().has_error());
  EXPECT_FALSE(live.Prepare(3).prepare_reply().has_error());
  EXPECT_EQ(live.FreeBlocks(), 16 - 3 * 4);
  // Reported for /metrics (kdn_worker_leased_kv_blocks), with the figures
  // of the step that prepared them.
  EXPECT_EQ(live.Info().leased_kv_blocks(), 3 * 4);
  // 200 ms on, the live peer pings (as a router does every 250 ms); 200 ms
  // later the silent peer has been quiet past the lease, the live one not.
  now = now.load() + 200ms;
  EXPECT_EQ(live.FreeBlocks(), 16 - 3 * 4) << "nobody is past the lease yet";
  now = now.load() + 200ms;
  // The live peer asks until the silent peer's two requests are gone (the
  // worker looks at its leases at least once a second).
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  int free = 0;
  while ((free = live.FreeBlocks()) != 16 - 4 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_EQ(free, 16 - 4) << "the silent peer's reservations were never let go";
  EXPECT_EQ(live.Info().leased_kv_blocks(), 4);
  for (int i = 0; i < 2; ++i) {
    const auto ev = silent.Receive();
    ASSERT_TRUE(ev.has_tokens()) << ev.DebugString();
    EXPECT_EQ(ev.tokens().events(0).finish_reason(), "cancelled");
  }
  // The live peer's request is still there to start: it fails only for the
  // KV that no prefill worker sent (UNAVAILABLE), where a lapsed one would
  // not be found.
  proto::WorkerMessage start;
  start.set_request_id(3);
  start.mutable_start()->set_first_token(5);
  live.Send(start);
  for (;;) {
    const auto ev = live.Receive();
    if (ev.body_case() == proto::WorkerMessage::kInfo) continue;
    ASSERT_TRUE(ev.has_tokens()) << ev.DebugString();
    ASSERT_GT(ev.tokens().events_size(), 0);
    EXPECT_EQ(ev.tokens().events(0).error().code(), static_cast<int>(StatusCode::kUnavailable))
        << ev.DebugString();
    break;
  }
}

TEST_F(DecodeServiceTest, BadBudgetAndLeaseAreRefusedAtStart) {
  for (double share : {0.0, 1.5}) {
    auto d = DecodeService::Start({.model_dir = dir_.path(), .peer_prepare_share = share});
    EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << share;
  }
  auto d = DecodeService::Start({.model_dir = dir_.path(), .peer_lease = 0ms});
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
}

TEST(StagingBytesFor, IsTheKvOfMaxBatchLongestPromptsAtMostThePools) {
  auto llama = engine::FindPreset("llama3-8b");
  ASSERT_TRUE(llama.ok());
  const model::ModelConfig& c = llama->config;  // 128 KiB of bf16 KV a token, 131072 of context
  const uint64_t token = 2 * 32 * 1024 * 2;
  const uint64_t header = kvbus::Chunk::kHeaderBytes;
  // A pool of 300000 tokens is less than 32 prompts of the whole context: the pool.
  EXPECT_EQ(StagingBytesFor(c, engine::DType::kBF16, 300000, 32, 256),
            300000 * token + (300000 / 256 + 32) * 32 * header);
  // A pool that outgrows 2 prompts of the whole context: those prompts.
  EXPECT_EQ(StagingBytesFor(c, engine::DType::kBF16, 1000000, 2, 256),
            2 * 131072 * token + (2 * 131072 / 256 + 2) * 32 * header);
  // A pool shorter than the context holds one prompt of the pool's length at most.
  EXPECT_EQ(StagingBytesFor(c, engine::DType::kF32, 4096, 1, 256),
            4096 * 2 * token + (4096 / 256 + 1) * 32 * header);
}

TEST_F(DecodeServiceTest, StagingIsSizedFromTheModelUnlessSet) {
  auto sized = DecodeService::Start({.model_dir = dir_.path(),
                                     .host_bytes = 16u << 20,
                                     .chunk_tokens = 16,
                                     .engine = {.kv_tokens = 256, .threads = 1},
                                     .max_batch = 4});
  ASSERT_TRUE(sized.ok()) << sized.status().ToString();
  auto preset = engine::FindPreset("tiny");
  ASSERT_TRUE(preset.ok());
  // The CPU engine's fp32 KV of its 256-token pool: 4 prompts of 256 tokens
  // would be more.
  EXPECT_EQ((*sized)->staging_bytes(),
            StagingBytesFor(preset->config, engine::DType::kF32, 256, 4, 16));
  EXPECT_EQ((*sized)->staging_bytes(),
            256u * 2 * 2 * 32 * 4 + (256 / 16 + 4) * 2 * kvbus::Chunk::kHeaderBytes);
  sized->reset();
  auto set = Start(60s, 1.0);
  ASSERT_NE(set, nullptr);
  EXPECT_EQ(set->staging_bytes(), 16u << 20);
}

}  // namespace
}  // namespace kdn::decode_worker
