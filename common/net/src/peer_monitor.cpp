#include "kdn/net/peer_monitor.h"

#include <atomic>
#include <cstring>

#include "kdn/net/zmq_check.h"

namespace kdn::net {

namespace {

constexpr int kWatchedEvents =
    ZMQ_EVENT_CONNECTED | ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_CLOSED | ZMQ_EVENT_DISCONNECTED |
    ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
    ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;

}  // namespace

Result<std::unique_ptr<PeerMonitor>> PeerMonitor::Watch(zmq::context_t& context,
                                                        zmq::socket_t& socket) {
  // inproc names are per context; the counter keeps two monitors in one apart.
  static std::atomic<uint64_t> next_id{0};
  const std::string address = "inproc://kdn-kvbus-peer-monitor-" + std::to_string(next_id++);
  zmq::socket_t events;
  KDN_ZMQ_RETURN_IF_ERROR(events = zmq::socket_t(context, zmq::socket_type::pair));
  KDN_ZMQ_RETURN_IF_ERROR(events.set(zmq::sockopt::linger, 0));
  // No limit on the inproc pipe (a connecter's 0 makes the pair's 0): a
  // full pipe would block libzmq's I/O thread in its send of an event.
  KDN_ZMQ_RETURN_IF_ERROR(events.set(zmq::sockopt::rcvhwm, 0));
  if (zmq_socket_monitor(socket.handle(), address.c_str(), kWatchedEvents) != 0) {
    return ZmqErrorStatus(zmq_errno(), "zmq_socket_monitor");
  }
  // From here on its destructor stops the monitoring, should the connect fail.
  std::unique_ptr<PeerMonitor> monitor(new PeerMonitor(socket, std::move(events)));
  KDN_ZMQ_RETURN_IF_ERROR(monitor->events_.connect(address));
  return monitor;
}

PeerMonitor::~PeerMonitor() {
  // With this end closed, libzmq's next event would block its I/O thread.
  if (watched_.handle() != nullptr) (void)zmq_socket_monitor(watched_.handle(), nullptr, 0);
}

Result<PeerNews> PeerMonitor::Read() {
  PeerNews news;
  while (true) {
    // Each event is two frames: 2 bytes of event and 4 of value, then the
    // endpoint (one socket, one endpoint: not needed).
    zmq::message_t head;
    zmq::recv_result_t got;
    KDN_ZMQ_RETURN_IF_ERROR(got = events_.recv(head, zmq::recv_flags::dontwait));
    if (!got) return news;
    bool more = head.more();
    while (more) {
      zmq::message_t rest;
      KDN_ZMQ_RETURN_IF_ERROR(events_.recv(rest, zmq::recv_flags::none));
      more = rest.more();
    }
    if (head.size() < sizeof(uint16_t)) continue;
    uint16_t event = 0;
    std::memcpy(&event, head.data(), sizeof(event));
    Apply(event, news);
  }
}

void PeerMonitor::Apply(uint16_t event, PeerNews& news) {
  switch (event) {
    case ZMQ_EVENT_CONNECTED: down_ = false; break;
    case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
      up_ = true;
      down_ = false;
      break;
    case ZMQ_EVENT_DISCONNECTED:
      if (up_) {
        news.lost = true;
        why_ = "connection lost";
      }
      up_ = false;
      down_ = true;
      break;
    case ZMQ_EVENT_CLOSED:  // a connect attempt's socket closed before it connected
      if (!up_) {
        why_ = "connection refused";
        down_ = true;
      }
      break;
    case ZMQ_EVENT_CONNECT_RETRIED:
      if (!up_) down_ = true;
      break;
    case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
    case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
    case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
      why_ = "handshake failed";
      down_ = true;
      break;
    default: break;
  }
}

}  // namespace kdn::net
