#pragma once
// The harnesses that speak to a server over ZeroMQ wait for its answers
// with PollIn.

#include <zmq.hpp>

#include <cerrno>
#include <chrono>

namespace kdn::fuzz {

// Whether `sock` has a message within `timeout`. Polls again when a signal
// interrupts it (libFuzzer's timer signals do).
inline bool PollIn(zmq::socket_t& sock, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    zmq::pollitem_t item{sock.handle(), 0, ZMQ_POLLIN, 0};
    try {
      return zmq::poll(&item, 1, left) > 0;
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) throw;
    }
  }
}

}  // namespace kdn::fuzz
