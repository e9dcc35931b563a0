// ControlServer: a frame over kMaxControlFrameBytes is never buffered nor
// handed to the handler (ZeroMQ drops the connection that sends it), and the
// server goes on answering its other peers. Malformed frames are dropped with
// a rate-limited log line, however many peers send them. A peer that reads
// late loses no reply.
#include "kdn/control/control_server.h"

#include "kdn/net/zmq_curve.h"
#include "proto_log.h"

#include <gtest/gtest.h>
#include <zmq.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kdn/common/log.h"

namespace kdn::control {
namespace {

// A handler that answers every message with an info reply, counting them
// in `handled`.
ControlServer::Handler AnswerEach(std::atomic<int>* handled) {
  return [handled](ControlServer& srv, const std::string& peer, proto::WorkerMessage m) {
    ++*handled;
    proto::WorkerMessage reply;
    reply.set_request_id(m.request_id());
    reply.mutable_info();
    srv.Send(peer, reply);
  };
}

TEST(ControlServer, AFrameOverTheLimitIsDroppedAndOthersAreServed) {
  std::atomic<int> handled{0};
  auto server = ControlServer::Start("tcp://127.0.0.1:0", AnswerEach(&handled));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  zmq::context_t ctx;
  {
    zmq::socket_t big(ctx, zmq::socket_type::dealer);
    big.set(zmq::sockopt::linger, 0);
    big.connect((*server)->endpoint());
    // A well-formed message, padded past the limit with a field the worker
    // would otherwise parse.
    proto::WorkerMessage m;
    m.set_request_id(1);
    m.mutable_lookup()->set_ns(std::string(kMaxControlFrameBytes + 1, 'n'));
    const std::string bytes = m.SerializeAsString();
    big.send(zmq::buffer(bytes), zmq::send_flags::none);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  EXPECT_EQ(handled.load(), 0);
  zmq::socket_t ok(ctx, zmq::socket_type::dealer);
  ok.set(zmq::sockopt::linger, 0);
  ok.set(zmq::sockopt::rcvtimeo, 5000);
  ok.connect((*server)->endpoint());
  proto::WorkerMessage ping;
  ping.set_request_id(2);
  ping.mutable_info_request();
  const std::string bytes = ping.SerializeAsString();
  ok.send(zmq::buffer(bytes), zmq::send_flags::none);
  zmq::message_t reply;
  ASSERT_TRUE(ok.recv(reply, zmq::recv_flags::none).has_value()) << "no answer";
  proto::WorkerMessage parsed;
  ASSERT_TRUE(parsed.ParseFromArray(reply.data(), static_cast<int>(reply.size())));
  EXPECT_EQ(parsed.request_id(), 2u);
  EXPECT_EQ(handled.load(), 1);
}

// A peer that reads nothing for a while gets every reply sent meanwhile,
// in order: far more than ZeroMQ's default high-water mark of 1,000
// messages (at which a ROUTER drops what it sends: token events lost under
// load), each large enough that the connection's buffers hold few of them.
TEST(ControlServer, APeerThatFallsBehindGetsEveryReplyInOrder) {
  constexpr int kReplies = 3000;
  std::atomic<bool> sent{false};
  // The replies come from another thread, as a worker's do (the I/O
  // thread that runs the handler is the one that forwards them).
  std::thread sender;
  auto server = ControlServer::Start(
      "tcp://127.0.0.1:0", [&](ControlServer& srv, const std::string& peer, proto::WorkerMessage) {
        sender = std::thread([&srv, &sent, peer] {
          for (int i = 0; i < kReplies; ++i) {
            proto::WorkerMessage reply;
            reply.set_request_id(static_cast<uint64_t>(i));
            reply.mutable_lookup()->set_ns(std::string(10000, 'x'));
            srv.Send(peer, reply);
          }
          sent = true;
        });
      });
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  zmq::context_t ctx;
  zmq::socket_t sock(ctx, zmq::socket_type::dealer);
  sock.set(zmq::sockopt::linger, 0);
  sock.set(zmq::sockopt::rcvhwm, 10);
  sock.set(zmq::sockopt::rcvtimeo, 10000);
  sock.connect((*server)->endpoint());
  proto::WorkerMessage go;
  go.set_request_id(1);
  go.mutable_info_request();
  const std::string bytes = go.SerializeAsString();
  sock.send(zmq::buffer(bytes), zmq::send_flags::none);
  while (!sent) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  // The server's I/O thread forwards the queued replies meanwhile (a
  // limited queue would drop most of them now).
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  std::vector<uint64_t> got;
  for (int i = 0; i < kReplies; ++i) {
    zmq::message_t reply;
    if (!sock.recv(reply, zmq::recv_flags::none).has_value()) break;  // 10 s: lost
    proto::WorkerMessage parsed;
    if (!parsed.ParseFromArray(reply.data(), static_cast<int>(reply.size()))) break;
    got.push_back(parsed.request_id());
  }
  sender.join();
  ASSERT_EQ(got.size(), static_cast<size_t>(kReplies)) << "replies lost";
  for (int i = 0; i < kReplies; ++i) ASSERT_EQ(got[i], static_cast<uint64_t>(i)) << "out of order";
}

// Sends an info request on `sock` and waits for its answer: every frame
// `sock` sent before has been handled (one connection keeps its order).
void Ping(zmq::socket_t& sock, uint64_t id) {
  proto::WorkerMessage ping;
  ping.set_request_id(id);
  ping.mutable_info_request();
  const std::string bytes = ping.SerializeAsString();
  sock.send(zmq::buffer(bytes), zmq::send_flags::none);
  zmq::message_t reply;
  ASSERT_TRUE(sock.recv(reply, zmq::recv_flags::none).has_value()) << "no answer to " << id;
}

// Runs `flood` with stderr captured at level info, and checks that what it
// logged is a few lines saying `what`: at most 5 a second (and one
// "suppressed" line before each window's first), not one per message.
void ExpectFewLines(const std::function<void()>& flood, const std::string& what) {
  const LogLevel saved = GetLogLevel();
  SetLogLevel(LogLevel::kInfo);
  testing::internal::CaptureStderr();
  const auto t0 = std::chrono::steady_clock::now();
  flood();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string text = testing::internal::GetCapturedStderr();
  SetLogLevel(saved);
  const auto lines = std::count(text.begin(), text.end(), '\n');
  EXPECT_GE(lines, 1);
  EXPECT_LE(lines, 6 * static_cast<long>(std::ceil(seconds) + 1)) << text;
  EXPECT_NE(text.find(what), std::string::npos) << text;
}

TEST(ControlServer, AFloodOfMalformedFramesFromManyPeersLogsAFewLines) {
  std::atomic<int> handled{0};
  auto server = ControlServer::Start("tcp://127.0.0.1:0", AnswerEach(&handled));
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  zmq::context_t ctx;
  std::vector<std::unique_ptr<zmq::socket_t>> peers;
  for (int i = 0; i < 20; ++i) {
    auto s = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer);
    s->set(zmq::sockopt::linger, 0);
    s->set(zmq::sockopt::rcvtimeo, 10000);
    s->connect((*server)->endpoint());
    peers.push_back(std::move(s));
  }
  // Field 0 is no protobuf field: the frame does not parse. 2000 of them
  // from 20 peers.
  const std::string garbage("\xff\xff\xff\xff", 4);
  ExpectFewLines(
      [&] {
        for (int k = 0; k < 100; ++k) {
          for (auto& s : peers) s->send(zmq::buffer(garbage), zmq::send_flags::none);
        }
        for (size_t i = 0; i < peers.size(); ++i) Ping(*peers[i], i + 1);
      },
      "dropping a malformed message");
}

// Protobuf logs an error for each string field that is not UTF-8; routed
// through kdn's log, a peer sending such messages in a loop gets a few
// lines, not one per message.
TEST(ControlServer, ProtobufsComplaintsAreRateLimited) {
  proto::RouteProtobufLogs();
  proto::WorkerMessage bad;
  bad.mutable_lookup()->set_ns(std::string("\xff\xfe", 2));
  const std::string bytes = bad.SerializeAsString();
  ExpectFewLines(
      [&] {
        for (int i = 0; i < 2000; ++i) {
          proto::WorkerMessage m;
          (void)m.ParseFromString(bytes);
        }
      },
      "protobuf");
}

// With CURVE, only the router's key reaches the handler: a Prepare (which
// would reserve a decode worker's KV) and garbage alike from a peer with no
// key, a keypair of its own, or the members' key (a worker's) are refused at
// the handshake, and the router is answered.
TEST(ControlServer, WithCurveOnlyTheRouterIsHeard) {
  const auto [keys, router] = net::GenerateDeploymentKeys().value();
  std::atomic<int> handled{0};
  auto server = ControlServer::Start("tcp://127.0.0.1:0", AnswerEach(&handled), keys);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  proto::WorkerMessage prepare;
  prepare.set_request_id(7);
  prepare.mutable_prepare()->add_tokens(1);
  prepare.mutable_prepare()->set_max_tokens(100000);
  const std::string bytes = prepare.SerializeAsString();
  zmq::context_t ctx;
  const net::CurveKeys other = net::GenerateCurveKeys().value();
  for (const net::CurveKeys* client :
       {static_cast<const net::CurveKeys*>(nullptr), &other, &keys}) {
    zmq::socket_t s(ctx, zmq::socket_type::dealer);
    s.set(zmq::sockopt::linger, 0);
    if (client != nullptr) {
      s.set(zmq::sockopt::curve_serverkey, keys.public_key);
      s.set(zmq::sockopt::curve_publickey, client->public_key);
      s.set(zmq::sockopt::curve_secretkey, client->secret_key);
    }
    s.connect((*server)->endpoint());
    for (int i = 0; i < 40; ++i) s.send(zmq::buffer(bytes), zmq::send_flags::dontwait);
    s.send(zmq::str_buffer("\xff\x00garbage"), zmq::send_flags::dontwait);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  EXPECT_EQ(handled.load(), 0);

  zmq::socket_t router_peer(ctx, zmq::socket_type::dealer);
  router_peer.set(zmq::sockopt::linger, 0);
  router_peer.set(zmq::sockopt::rcvtimeo, 5000);
  ASSERT_TRUE(net::SecureClient(router_peer, router).ok());
  router_peer.connect((*server)->endpoint());
  router_peer.send(zmq::buffer(bytes), zmq::send_flags::none);
  zmq::message_t reply;
  ASSERT_TRUE(router_peer.recv(reply, zmq::recv_flags::none).has_value()) << "no answer";
  EXPECT_EQ(handled.load(), 1);
}

}  // namespace
}  // namespace kdn::control
