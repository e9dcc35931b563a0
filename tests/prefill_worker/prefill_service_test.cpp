// PrefillService's KV I/O lane (docs/serving.md, "Inside a worker"): a job's
// KDN reads run off the compute thread, so a job whose read is still out does
// not hold up the jobs whose reads are done. A raw ZeroMQ peer stands in for
// the router; the test waits for what the worker answers, never for a length
// of time.

#include "kdn/prefill_worker/prefill_service.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <set>
#include <zmq.hpp>

#include "kdn/testing/temp_dir.h"
#include "kdn/testing/tiny_model.h"
#include "kdn/testing/control_peer.h"
#include "kdn/kvbus/host_tier.h"
#include "serving.pb.h"

namespace kdn::prefill_worker {
namespace {

using kdn::testing::TempDir;
using namespace std::chrono_literals;

constexpr auto kNoHang = 30s;  // only ever reached by a failing test

// A shared tier whose first call (of any kind, or with `puts_only` its first
// Put) waits until Open; the rest go straight to a host tier.
class FirstCallGate final : public kvbus::ChunkStore {
 public:
  explicit FirstCallGate(bool puts_only = false) : puts_only_(puts_only) {}
  std::string name() const override { return "gate"; }
  Result<std::shared_ptr<const kvbus::Chunk>> Get(const kvbus::ChunkKey& key) override {
    if (!puts_only_) Pass();
    return tier_.Get(key);
  }
  bool Contains(const kvbus::ChunkKey& key) override {
    if (!puts_only_) Pass();
    return tier_.Contains(key);
  }
  std::vector<bool> ContainsMany(std::span<const kvbus::ChunkKey> keys) override {
    if (!puts_only_) Pass();
    return tier_.ContainsMany(keys);
  }
  Status Put(std::shared_ptr<const kvbus::Chunk> chunk) override {
    Pass();
    return tier_.Put(std::move(chunk));
  }
  kvbus::TierStats Stats() override { return tier_.Stats(); }

  // Whether the first call is held now (waiting up to kNoHang for it).
  bool Held() {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, kNoHang, [&] { return held_; });
  }
  bool HeldNow() {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  void Pass() {
    std::unique_lock<std::mutex> lock(mu_);
    if (taken_) return;
    taken_ = held_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
    held_ = false;
  }

  const bool puts_only_;
  kvbus::HostTier tier_{16u << 20};
  std::mutex mu_;
  std::condition_variable cv_;
  bool taken_ = false, held_ = false, open_ = false;
};

// A worker on the tiny model in `dir`, its KV I/O threads as given.
PrefillServiceOptions Options(const TempDir& dir, int kv_io_threads = 2) {
  return {.model_dir = dir.path(),
          .host_bytes = 16u << 20,
          .chunk_tokens = 16,
          .kv_io_threads = kv_io_threads,
          .engine = {.kv_tokens = 1024, .threads = 1}};
}

// A router stand-in that sends prefill requests.
class Peer : public testing::ControlPeer {
 public:
  using ControlPeer::ControlPeer;

  // Prefill request `id`: a prompt of its own, its KV pushed nowhere.
  void Prefill(uint64_t id) {
    proto::WorkerMessage m;
    m.set_request_id(id);
    auto* p = m.mutable_prefill();
    for (int i = 0; i < 40; ++i) p->add_tokens(1 + (i * 7 + static_cast<int>(id) * 13) % 250);
    p->mutable_sampling()->set_top_p(1.0f);
    p->set_transfer_id(std::string(16, static_cast<char>('a' + id % 26)));
    Send(m);
  }
  // Inject request `id`: a document of its own.
  void Inject(uint64_t id) {
    proto::WorkerMessage m;
    m.set_request_id(id);
    auto* d = m.mutable_inject();
    for (int i = 0; i < 40; ++i) d->add_tokens(1 + (i * 11 + static_cast<int>(id) * 17) % 250);
    Send(m);
  }
};

TEST(PrefillService, ComputesAJobWhoseKdnReadIsDoneWhileAnotherJobsReadIsOut) {
  TempDir dir;
  ASSERT_TRUE(kdn::testing::WriteTinyModel(dir.path()).ok());
  auto gate = std::make_shared<FirstCallGate>();
  PrefillServiceOptions options = Options(dir);
  options.shared_store = gate;
  auto service = PrefillService::Start(options);
  ASSERT_TRUE(service.ok()) << service.status().ToString();
  zmq::context_t ctx;
  Peer peer(ctx, (*service)->endpoint(), kNoHang);
  peer.Prefill(1);
  peer.Prefill(2);
  // One job's read of the shared tier is held; the other's is not, and that
  // job is computed and answered while the first read is still out.
  ASSERT_TRUE(gate->Held());
  const proto::WorkerMessage first = peer.Receive();
  ASSERT_EQ(first.body_case(), proto::WorkerMessage::kPrefillReply) << "no reply while held";
  EXPECT_FALSE(first.prefill_reply().has_error()) << first.prefill_reply().error().message();
  EXPECT_TRUE(gate->HeldNow()) << "answered only once the held read was let go";
  gate->Open();
  const proto::WorkerMessage second = peer.Receive();
  ASSERT_EQ(second.body_case(), proto::WorkerMessage::kPrefillReply);
  EXPECT_FALSE(second.prefill_reply().has_error()) << second.prefill_reply().error().message();
  EXPECT_EQ(std::set<uint64_t>({first.request_id(), second.request_id()}),
            std::set<uint64_t>({1, 2}));
}

TEST(PrefillService, AnswersAnInjectionOnceStoredAndComputesOnWhileItsStoreIsOut) {
  TempDir dir;
  ASSERT_TRUE(kdn::testing::WriteTinyModel(dir.path()).ok());
  auto gate = std::make_shared<FirstCallGate>(/*puts_only=*/true);
  PrefillServiceOptions options = Options(dir);
  options.shared_store = gate;
  auto service = PrefillService::Start(options);
  ASSERT_TRUE(service.ok()) << service.status().ToString();
  zmq::context_t ctx;
  Peer peer(ctx, (*service)->endpoint(), kNoHang);
  peer.Inject(1);
  // The document is computed; its put into the shared tier is held.
  ASSERT_TRUE(gate->Held());
  peer.Prefill(2);
  const proto::WorkerMessage first = peer.Receive();
  ASSERT_EQ(first.body_case(), proto::WorkerMessage::kPrefillReply) << "no reply while held";
  EXPECT_EQ(first.request_id(), 2u);
  EXPECT_FALSE(first.prefill_reply().has_error()) << first.prefill_reply().error().message();
  EXPECT_TRUE(gate->HeldNow()) << "answered only once the held put was let go";
  gate->Open();
  const proto::WorkerMessage second = peer.Receive();
  ASSERT_EQ(second.body_case(), proto::WorkerMessage::kInjectReply);
  EXPECT_EQ(second.request_id(), 1u);
  EXPECT_FALSE(second.inject_reply().has_error()) << second.inject_reply().error().message();
  EXPECT_FALSE(second.inject_reply().already_held());
  EXPECT_EQ(second.inject_reply().stored_tokens(), 40);
}

TEST(PrefillService, WithNoKvIoThreadsTheComputeThreadReadsAndServesEveryJob) {
  TempDir dir;
  ASSERT_TRUE(kdn::testing::WriteTinyModel(dir.path()).ok());
  auto service = PrefillService::Start(Options(dir, /*kv_io_threads=*/0));
  ASSERT_TRUE(service.ok()) << service.status().ToString();
  zmq::context_t ctx;
  Peer peer(ctx, (*service)->endpoint(), kNoHang);
  peer.Prefill(1);
  peer.Prefill(2);
  for (uint64_t id : {1, 2}) {
    const proto::WorkerMessage r = peer.Receive();
    ASSERT_EQ(r.body_case(), proto::WorkerMessage::kPrefillReply) << "request " << id;
    EXPECT_EQ(r.request_id(), id) << "in the order queued";
    EXPECT_FALSE(r.prefill_reply().has_error()) << r.prefill_reply().error().message();
  }
}

TEST(PrefillService, RefusesASharedTierNamedAndGivenAsAnObject) {
  TempDir dir;
  ASSERT_TRUE(kdn::testing::WriteTinyModel(dir.path()).ok());
  PrefillServiceOptions options = Options(dir);
  options.shared_tier = "tcp://127.0.0.1:1";
  options.shared_store = std::make_shared<FirstCallGate>();
  auto service = PrefillService::Start(options);
  EXPECT_EQ(service.status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kdn::prefill_worker
