#include "kdn/testing/control_peer.h"

#include <gtest/gtest.h>

namespace kdn::testing {

ControlPeer::ControlPeer(zmq::context_t& ctx, const std::string& endpoint,
                         std::chrono::milliseconds timeout)
    : sock_(ctx, zmq::socket_type::dealer) {
  sock_.set(zmq::sockopt::linger, 0);
  sock_.set(zmq::sockopt::rcvtimeo, static_cast<int>(timeout.count()));
  sock_.connect(endpoint);
}

void ControlPeer::Send(const proto::WorkerMessage& m) {
  const std::string bytes = m.SerializeAsString();
  sock_.send(zmq::buffer(bytes), zmq::send_flags::none);
}

proto::WorkerMessage ControlPeer::Receive() {
  zmq::message_t msg;
  proto::WorkerMessage m;
  if (sock_.recv(msg, zmq::recv_flags::none)) {
    EXPECT_TRUE(m.ParseFromArray(msg.data(), static_cast<int>(msg.size())));
  }
  return m;
}

}  // namespace kdn::testing
