// A dead receiver costs the batches sent to it, and at once: conformance
// tests (transport_conformance.h, instantiated in transport_test.cpp) for a
// refused endpoint and a lost connection, the tcp transport's recovery when a
// receiver comes back at the same endpoint, and the PeerMonitor's reading of
// libzmq's connection events. Every test sets peer_timeout to 30 s, so a
// failure within kFast can only be the connection's doing; the bounds are
// wide (the behaviour, not a benchmark).

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "kdn/net/peer_monitor.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/transport.h"
#include "kdn/testing/recording_store.h"
#include "transport_conformance.h"
#include "transport_test_util.h"

namespace kdn::kvbus {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using namespace transport_test;  // NOLINT: transport_test_util.h
using kdn::testing::RecordingStore;

constexpr auto kFast = 5s;  // "at once": well below the peer timeout
constexpr auto kPeerTimeout = 30s;

// The peer timeout far out of the way: only the connection can fail a batch fast.
SenderOptions SlowPeerTimeout() {
  SenderOptions o;
  o.peer_timeout = kPeerTimeout;
  o.heartbeat_interval = 100ms;
  return o;
}

// Every chunk failed with UNAVAILABLE, its message containing `why`.
void ExpectFailedFor(const BatchStatus& status, const std::string& why) {
  ASSERT_TRUE(status.done);
  for (const ChunkResult& c : status.chunks) {
    EXPECT_EQ(c.outcome, ChunkOutcome::kFailed);
    EXPECT_EQ(c.status.code(), StatusCode::kUnavailable) << c.status.ToString();
    EXPECT_NE(c.status.message().find(why), std::string::npos) << c.status.ToString();
  }
}

long long Ms(Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

// ---------------------------------------------------------------------------
// Conformance: every transport.

TEST_P(TransportConformance, FailsABatchToAnEndpointNobodyListensOnWellBeforeThePeerTimeout) {
  std::string endpoint;
  {
    RecordingStore sink;
    KDN_ASSERT_OK_AND_ASSIGN(auto receiver, GetParam().listen(sink, TestReceiverOptions()));
    endpoint = receiver->endpoint();
  }
  KDN_ASSERT_OK_AND_ASSIGN(auto sender, GetParam().connect(endpoint, SlowPeerTimeout()));
  const auto start = Clock::now();
  KDN_ASSERT_OK_AND_ASSIGN(uint64_t batch, sender->Submit(MakeChunks(1, 3)));
  KDN_ASSERT_OK_AND_ASSIGN(BatchStatus status, sender->Wait(batch, kNoHang));
  const auto took = Clock::now() - start;
  RecordProperty("fail_ms", static_cast<int>(Ms(took)));
  EXPECT_LT(took, kFast) << Ms(took) << " ms";
  ExpectFailedFor(status, "connection refused");
  EXPECT_NE(status.ToStatus().message().find(endpoint), std::string::npos)
      << status.ToStatus().ToString();
}

TEST_P(TransportConformance, FailsUnfinishedChunksAtOnceWhenTheConnectionIsLost) {
  RecordingStore sink;
  const auto chunks = MakeChunks(1, 10);
  const ChunkKey held_back = chunks[6]->key();
  SenderOptions so = SlowPeerTimeout();
  so.faults.withhold_data = [held_back](const ChunkKey& k) { return k == held_back; };
  KDN_ASSERT_OK_AND_ASSIGN(auto receiver, GetParam().listen(sink, TestReceiverOptions()));
  KDN_ASSERT_OK_AND_ASSIGN(auto sender, GetParam().connect(receiver->endpoint(), so));
  KDN_ASSERT_OK_AND_ASSIGN(uint64_t batch, sender->Submit(chunks));
  ASSERT_TRUE(Eventually([&] { return sink.size() == 9; }));
  const auto start = Clock::now();
  receiver.reset();  // mid-transfer: chunk 6 was granted and never came
  KDN_ASSERT_OK_AND_ASSIGN(BatchStatus status, sender->Wait(batch, kNoHang));
  const auto took = Clock::now() - start;
  RecordProperty("fail_ms", static_cast<int>(Ms(took)));
  EXPECT_LT(took, kFast) << Ms(took) << " ms";
  ASSERT_TRUE(status.done);
  EXPECT_EQ(status.chunks[6].outcome, ChunkOutcome::kFailed);
  EXPECT_EQ(status.chunks[6].status.code(), StatusCode::kUnavailable);
  EXPECT_NE(status.chunks[6].status.message().find("connection lost"), std::string::npos)
      << status.chunks[6].status.ToString();
  for (const ChunkResult& c : status.chunks) {
    // An ack on its way when the receiver went may be lost: that chunk is
    // stored yet reported failed, which a retry skips.
    if (c.outcome != ChunkOutcome::kSent) {
      EXPECT_EQ(c.status.code(), StatusCode::kUnavailable) << c.status.ToString();
    }
  }
}

// The sender's half of "not up yet gets the data once it is".
TEST_P(TransportConformance, DeliversToAReceiverThatComesUpWithinTheConnectTimeout) {
  std::string endpoint;
  {
    RecordingStore sink;
    KDN_ASSERT_OK_AND_ASSIGN(auto receiver, GetParam().listen(sink, TestReceiverOptions()));
    endpoint = receiver->endpoint();
  }
  SenderOptions so = SlowPeerTimeout();
  so.connect_timeout = 10s;
  KDN_ASSERT_OK_AND_ASSIGN(auto sender, GetParam().connect(endpoint, so));
  const auto chunks = MakeChunks(1, 3);
  KDN_ASSERT_OK_AND_ASSIGN(uint64_t batch, sender->Submit(chunks));
  std::this_thread::sleep_for(500ms);  // refused a few times meanwhile
  KDN_ASSERT_OK_AND_ASSIGN(BatchStatus early, sender->Poll(batch));
  EXPECT_FALSE(early.done);
  RecordingStore sink;
  // The factory's receivers pick a port; this one must take the old one.
  ReceiverOptions ro = TestReceiverOptions();
  if (GetParam().name.find("shm") != std::string::npos) ro.shm_landing_bytes = 1 << 20;
  KDN_ASSERT_OK_AND_ASSIGN(auto receiver, Listen(endpoint, sink, ro));
  KDN_ASSERT_OK_AND_ASSIGN(BatchStatus status, sender->Wait(batch, kNoHang));
  ASSERT_TRUE(status.done);
  EXPECT_TRUE(status.ToStatus().ok()) << status.ToStatus().ToString();
  EXPECT_EQ(sink.size(), chunks.size());
}

// ---------------------------------------------------------------------------
// tcp and shm: a receiver that comes back at the same endpoint.

TEST(TransportFailFast, ServesALaterBatchWhenAReceiverComesBackAtTheSameEndpoint) {
  for (TransportKind kind : {TransportKind::kTcp, TransportKind::kShm}) {
    SCOPED_TRACE(TransportKindName(kind));
    ReceiverOptions ro = TestReceiverOptions();
    if (kind == TransportKind::kShm) ro.shm_landing_bytes = 1 << 20;
    SenderOptions so = SlowPeerTimeout();
    so.transport = kind;
    so.faults.withhold_data = [](const ChunkKey& k) { return k.lo == 1; };

    // 1. The receiver dies with a batch unfinished: it fails at once.
    RecordingStore sink;
    KDN_ASSERT_OK_AND_ASSIGN(auto receiver, Listen("tcp://127.0.0.1:0", sink, ro));
    const std::string endpoint = receiver->endpoint();
    KDN_ASSERT_OK_AND_ASSIGN(auto sender, Connect(endpoint, so));
    KDN_ASSERT_OK_AND_ASSIGN(uint64_t first, sender->Submit({MakeChunk(1), MakeChunk(2)}));
    ASSERT_TRUE(Eventually([&] { return sink.size() == 1; }));
    receiver.reset();
    auto start = Clock::now();
    KDN_ASSERT_OK_AND_ASSIGN(BatchStatus lost, sender->Wait(first, kNoHang));
    EXPECT_LT(Clock::now() - start, kFast);
    ASSERT_TRUE(lost.done);
    EXPECT_EQ(lost.chunks[0].outcome, ChunkOutcome::kFailed);
    EXPECT_NE(lost.chunks[0].status.message().find("connection lost"), std::string::npos)
        << lost.chunks[0].status.ToString();

    // 2. Nobody listens: a batch fails within about connect_timeout.
    start = Clock::now();
    KDN_ASSERT_OK_AND_ASSIGN(uint64_t second, sender->Submit({MakeChunk(3)}));
    KDN_ASSERT_OK_AND_ASSIGN(BatchStatus refused, sender->Wait(second, kNoHang));
    EXPECT_LT(Clock::now() - start, kFast);
    ExpectFailedFor(refused, "connection refused");

    // 3. A new receiver at the same endpoint: the same sender serves it.
    RecordingStore sink2;
    KDN_ASSERT_OK_AND_ASSIGN(auto again, Listen(endpoint, sink2, ro));
    const auto chunks = MakeChunks(10, 4);
    KDN_ASSERT_OK_AND_ASSIGN(uint64_t third, sender->Submit(chunks));
    KDN_ASSERT_OK_AND_ASSIGN(BatchStatus served, sender->Wait(third, kNoHang));
    ASSERT_TRUE(served.done);
    EXPECT_TRUE(served.ToStatus().ok()) << served.ToStatus().ToString();
    EXPECT_EQ(served.Count(ChunkOutcome::kSent), chunks.size());
    for (const ChunkPtr& c : chunks) EXPECT_TRUE(sink2.Contains(c->key()));
  }
}

TEST(TransportFailFast, RefusesANegativeConnectTimeout) {
  SenderOptions so;
  so.connect_timeout = -1ms;
  EXPECT_EQ(Connect("tcp://127.0.0.1:5555", so).status().code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// The libzmq events the sender relies on, on loopback.

TEST(PeerMonitor, SeesARefusedEndpointThenAnUpConnectionThenItsLoss) {
  zmq::context_t context;
  zmq::socket_t dealer(context, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  KDN_ASSERT_OK_AND_ASSIGN(auto monitor, net::PeerMonitor::Watch(context, dealer));
  std::string endpoint;
  {
    // A context of its own: closing it waits until the port is closed (a
    // socket's close alone finishes later, on ZeroMQ's threads).
    zmq::context_t probe_context;
    zmq::socket_t probe(probe_context, zmq::socket_type::router);
    probe.set(zmq::sockopt::linger, 0);
    probe.bind("tcp://127.0.0.1:*");
    endpoint = probe.get(zmq::sockopt::last_endpoint);
  }
  bool lost = false;
  const auto read_until = [&](const std::function<bool()>& done) {
    return Eventually([&] {
      auto news = monitor->Read();
      EXPECT_TRUE(news.ok()) << news.status().ToString();
      if (news.ok()) lost |= news->lost;
      return done();
    });
  };
  dealer.connect(endpoint);
  ASSERT_TRUE(read_until([&] { return monitor->down(); })) << "no refusal seen";
  EXPECT_FALSE(monitor->up());
  EXPECT_STREQ(monitor->why(), "connection refused");
  EXPECT_FALSE(lost);  // never up: refused, not lost

  auto router = std::make_unique<zmq::socket_t>(context, zmq::socket_type::router);
  router->set(zmq::sockopt::linger, 0);
  router->bind(endpoint);
  ASSERT_TRUE(read_until([&] { return monitor->up(); })) << "no reconnect seen";
  EXPECT_FALSE(monitor->down());
  EXPECT_FALSE(lost);

  router.reset();  // closes it
  ASSERT_TRUE(read_until([&] { return lost; })) << "no loss seen";
  EXPECT_FALSE(monitor->up());
  EXPECT_TRUE(monitor->down());
  monitor.reset();  // before the context closes
}

}  // namespace
}  // namespace kdn::kvbus
