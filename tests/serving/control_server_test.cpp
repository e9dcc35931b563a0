// ControlServer: a frame over kMaxControlFrameBytes is never buffered nor
// handed to the handler (ZeroMQ drops the connection that sends it), and the
// server goes on answering its other peers.
#include "kdn/control/control_server.h"

#include "kdn/kvbus/zmq_curve.h"

#include <gtest/gtest.h>
#include <zmq.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

namespace kdn::control {
namespace {

TEST(ControlServer, AFrameOverTheLimitIsDroppedAndOthersAreServed) {
  std::atomic<int> handled{0};
  auto server = ControlServer::Start(
      "tcp://127.0.0.1:0", [&](ControlServer& srv, const std::string& peer, proto::WorkerMessage m) {
        ++handled;
        proto::WorkerMessage reply;
        reply.set_request_id(m.request_id());
        reply.mutable_info();
        srv.Send(peer, reply);
      });
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

// With CURVE, a peer without the deployment's key reaches no handler: its
// Prepare (which would reserve a decode worker's KV) and garbage alike are
// refused at the handshake, and a router that holds the key is answered.
TEST(ControlServer, WithCurveOnlyAHolderOfTheKeyIsHeard) {
  const kvbus::CurveKeys keys = kvbus::GenerateCurveKeys().value();
  std::atomic<int> handled{0};
  auto server = ControlServer::Start(
      "tcp://127.0.0.1:0",
      [&](ControlServer& srv, const std::string& peer, proto::WorkerMessage m) {
        ++handled;
        proto::WorkerMessage reply;
        reply.set_request_id(m.request_id());
        reply.mutable_info();
        srv.Send(peer, reply);
      },
      keys);
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  proto::WorkerMessage prepare;
  prepare.set_request_id(7);
  prepare.mutable_prepare()->add_tokens(1);
  prepare.mutable_prepare()->set_max_tokens(100000);
  const std::string bytes = prepare.SerializeAsString();
  zmq::context_t ctx;
  const kvbus::CurveKeys other = kvbus::GenerateCurveKeys().value();
  for (int kind = 0; kind < 2; ++kind) {  // plaintext; a keypair of its own
    zmq::socket_t s(ctx, zmq::socket_type::dealer);
    s.set(zmq::sockopt::linger, 0);
    if (kind == 1) {
      s.set(zmq::sockopt::curve_serverkey, keys.public_key);
      s.set(zmq::sockopt::curve_publickey, other.public_key);
      s.set(zmq::sockopt::curve_secretkey, other.secret_key);
    }
    s.connect((*server)->endpoint());
    for (int i = 0; i < 40; ++i) s.send(zmq::buffer(bytes), zmq::send_flags::dontwait);
    s.send(zmq::str_buffer("\xff\x00garbage"), zmq::send_flags::dontwait);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  EXPECT_EQ(handled.load(), 0);

  zmq::socket_t member(ctx, zmq::socket_type::dealer);
  member.set(zmq::sockopt::linger, 0);
  member.set(zmq::sockopt::rcvtimeo, 5000);
  ASSERT_TRUE(kvbus::SecureClient(member, keys).ok());
  member.connect((*server)->endpoint());
  member.send(zmq::buffer(bytes), zmq::send_flags::none);
  zmq::message_t reply;
  ASSERT_TRUE(member.recv(reply, zmq::recv_flags::none).has_value()) << "no answer";
  EXPECT_EQ(handled.load(), 1);
}

}  // namespace
}  // namespace kdn::control
