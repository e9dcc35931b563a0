#pragma once
// A router stand-in for the workers' service tests: one ZeroMQ DEALER to a
// worker's control socket, sending and receiving WorkerMessages.

#include <chrono>
#include <string>
#include <zmq.hpp>

#include "serving.pb.h"

namespace kdn::testing {

class ControlPeer {
 public:
  // `timeout`: how long Receive waits (only ever reached by a failing test).
  ControlPeer(zmq::context_t& ctx, const std::string& endpoint,
              std::chrono::milliseconds timeout = std::chrono::seconds(30));

  void Send(const proto::WorkerMessage& m);
  // The next message for this peer (an empty one after the timeout).
  proto::WorkerMessage Receive();

 private:
  zmq::socket_t sock_;
};

}  // namespace kdn::testing
