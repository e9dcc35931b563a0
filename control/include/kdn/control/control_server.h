#pragma once
// ControlServer: a worker's control socket (docs/serving.md). A ZeroMQ ROUTER
// socket bound at the worker's endpoint; every frame from a router (a DEALER)
// is one proto::WorkerMessage, handed to the handler together with the
// peer's identity, and replies go back to that identity with Send.
//
// Thread-safe: Send may be called from any thread (workers answer from their
// compute loops). One background I/O thread receives, calls the handler
// (which must be quick: queue work, answer lookups) and sends what Send
// queued. The destructor stops the thread and closes the socket.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "kdn/common/status.h"
#include "kdn/net/curve.h"
#include "serving.pb.h"

namespace kdn::control {

// The largest control message either end takes (a prompt of 128K tokens is
// under 1 MiB). A peer that sends a bigger one is disconnected before it is
// buffered, so no peer can make a worker or the router hold an unbounded
// frame.
inline constexpr int64_t kMaxControlFrameBytes = int64_t{16} << 20;

class ControlServer {
 public:
  // Called on the I/O thread for each well-formed message, with the server
  // to answer through (valid even before Start has returned); malformed
  // frames are dropped (logged, rate-limited: kdn::LogLimiter).
  using Handler = std::function<void(ControlServer& server, const std::string& peer,
                                     proto::WorkerMessage message)>;

  // Binds `endpoint` ("tcp://127.0.0.1:0" picks a port). UNAVAILABLE if it
  // cannot be bound, INVALID_ARGUMENT if malformed. With `curve` (the
  // members' keys) set the socket runs CURVE and admits only the router's
  // key (net::CurveRole::kControl).
  static Result<std::unique_ptr<ControlServer>> Start(
      const std::string& endpoint, Handler handler,
      const std::optional<net::CurveKeys>& curve = std::nullopt);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  // The bound endpoint with its real port.
  const std::string& endpoint() const;

  // Queues `message` for `peer`. A peer that has gone away loses it
  // silently (its router notices by its own timeouts).
  void Send(const std::string& peer, const proto::WorkerMessage& message);

 private:
  struct Impl;
  explicit ControlServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kdn::control
