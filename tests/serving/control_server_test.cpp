// ControlServer: a frame over kMaxControlFrameBytes is never buffered nor
// handed to the handler (ZeroMQ drops the connection that sends it), and the
// server goes on answering its other peers.
#include "kdn/control/control_server.h"

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

}  // namespace
}  // namespace kdn::control
