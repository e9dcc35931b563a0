#pragma once
// Watches the connection of one connecting ZeroMQ socket (zmq_socket_monitor,
// read through an inproc PAIR socket), so that its owner learns at once that
// its peer went away or cannot be reached, rather than after a timeout of
// silence. The tcp sender polls it beside its socket (kvbus/transport/src/sender_liveness.cpp).
//
// The libzmq 4.3 events it relies on (checked on loopback, see
// tests/kvbus/transport_failfast_test.cpp):
//   HANDSHAKE_SUCCEEDED   the ZMTP session is up: up();
//   DISCONNECTED          a session went down; after HANDSHAKE_SUCCEEDED that
//                         is a lost connection (PeerNews::lost);
//   CLOSED (not up)       a connect attempt failed: refused (nothing listens
//                         there) or unreachable; ZeroMQ emits CONNECT_DELAYED,
//                         CLOSED, CONNECT_RETRIED for each refused attempt;
//   CONNECT_RETRIED       ZeroMQ waits to try again (reconnect_ivl): down();
//   HANDSHAKE_FAILED_*    the peer answered but the handshake failed (CURVE
//                         keys, or not a ZMTP peer);
//   CONNECTED             a TCP connection is up (the handshake follows): no
//                         longer down().
// ZeroMQ keeps reconnecting on its own, so down() clears once a peer listens
// again.
//
// libzmq's I/O thread sends the events with blocking sends, so the monitor
// never lets them block it: its end of the inproc pipe has no high-water mark
// (an owner that stops reading holds a few events a second in memory, until
// it destroys the monitor), and the destructor stops the monitoring before it
// closes that end.
//
// Not thread-safe: belongs to the thread that owns the watched socket (made
// on another thread before that one starts, as ZeroMQ sockets may be).

#include <zmq.h>

#include <memory>
#include <string>
#include <zmq.hpp>

#include "kdn/common/status.h"

namespace kdn::net {

// What happened to the connection since the previous Read.
struct PeerNews {
  bool lost = false;  // an established connection (handshake done) went down
};

class PeerMonitor {
 public:
  // Starts watching `socket`, which lives in `context` and has not connected
  // yet (events of an earlier connect would be missed). Both must outlive the
  // monitor (`socket` may be closed first), and the monitor must be destroyed
  // before `context` is closed (its socket would keep zmq_ctx_term waiting).
  // Errors as ZeroMQ's.
  static Result<std::unique_ptr<PeerMonitor>> Watch(zmq::context_t& context, zmq::socket_t& socket);
  // Stops the monitoring, unless the watched socket is closed already (which
  // stops it), then closes its own socket.
  ~PeerMonitor();
  PeerMonitor(const PeerMonitor&) = delete;
  PeerMonitor& operator=(const PeerMonitor&) = delete;

  // For the owner's zmq_poll (ZMQ_POLLIN: events are waiting).
  void* handle() { return events_.handle(); }

  // Reads every waiting event without blocking and updates the state below.
  Result<PeerNews> Read();

  // The ZMTP session with the peer is up.
  bool up() const { return up_; }
  // Not connected, and the latest attempt failed or the connection was lost:
  // ZeroMQ is waiting to try again. Clears when a TCP connection is made.
  bool down() const { return down_; }
  // Why down(), for messages: "connection refused", "connection lost" or
  // "handshake failed".
  const char* why() const { return why_; }

 private:
  PeerMonitor(zmq::socket_t& watched, zmq::socket_t events)
      : watched_(watched), events_(std::move(events)) {}
  void Apply(uint16_t event, PeerNews& news);

  zmq::socket_t& watched_;
  zmq::socket_t events_;  // the PAIR that receives the watched socket's events
  bool up_ = false;
  bool down_ = false;
  const char* why_ = "connection refused";
};

}  // namespace kdn::net
