#pragma once
// A router stand-in for the workers' service tests: one ZeroMQ DEALER to a
// worker's control socket, sending and receiving WorkerMessages.

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <zmq.hpp>

#include "serving.pb.h"

namespace kdn::testing {

class ControlPeer {
 public:
  // `timeout`: how long Receive waits (only ever reached by a failing test).
  ControlPeer(zmq::context_t& ctx, const std::string& endpoint,
              std::chrono::milliseconds timeout = std::chrono::seconds(30))
      : sock_(ctx, zmq::socket_type::dealer) {
    sock_.set(zmq::sockopt::linger, 0);
    sock_.set(zmq::sockopt::rcvtimeo, static_cast<int>(timeout.count()));
    sock_.connect(endpoint);
  }

  void Send(const proto::WorkerMessage& m) {
    const std::string bytes = m.SerializeAsString();
    sock_.send(zmq::buffer(bytes), zmq::send_flags::none);
  }

  // The next message for this peer (an empty one after the timeout).
  proto::WorkerMessage Receive() {
    zmq::message_t msg;
    proto::WorkerMessage m;
    if (sock_.recv(msg, zmq::recv_flags::none)) {
      EXPECT_TRUE(m.ParseFromArray(msg.data(), static_cast<int>(msg.size())));
    }
    return m;
  }

 private:
  zmq::socket_t sock_;
};

}  // namespace kdn::testing
