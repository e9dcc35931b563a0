#include "kdn/control/control_server.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <thread>

#include <zmq.hpp>

#include "kdn/common/log.h"
#include "kdn/net/zmq_check.h"
#include "kdn/net/zmq_curve.h"

namespace kdn::control {

struct ControlServer::Impl {
  Handler handler;
  ControlServer* self = nullptr;
  zmq::context_t ctx{1};
  zmq::socket_t sock{ctx, zmq::socket_type::router};  // the I/O thread's alone
  zmq::socket_t inbox{ctx, zmq::socket_type::pull};   // the I/O thread's alone
  std::unique_ptr<net::CurveAuthenticator> auth;      // with CURVE
  std::string endpoint;
  std::string inbox_endpoint;
  std::atomic<bool> stop{false};
  std::thread thread;

  std::mutex mu;  // guards outbox
  zmq::socket_t outbox{ctx, zmq::socket_type::push};

  // Peers can send malformed frames without end, and the loop's errors can
  // repeat on every turn: both are rate-limited.
  LogLimiter malformed, loop_errors, send_errors;

  void Loop() {
    zmq::pollitem_t items[2] = {{sock.handle(), 0, ZMQ_POLLIN, 0},
                                {inbox.handle(), 0, ZMQ_POLLIN, 0}};
    while (!stop.load(std::memory_order_relaxed)) {
      try {
        zmq::poll(items, 2, std::chrono::milliseconds(100));
        // Replies first, so a busy request stream cannot starve them.
        for (int n = 0; n < 256 && (items[1].revents & ZMQ_POLLIN); ++n) {
          zmq::message_t peer, body;
          if (!inbox.recv(peer, zmq::recv_flags::dontwait)) break;
          (void)inbox.recv(body, zmq::recv_flags::none);
          sock.send(peer, zmq::send_flags::sndmore);
          sock.send(body, zmq::send_flags::none);
        }
        for (int n = 0; n < 256 && (items[0].revents & ZMQ_POLLIN); ++n) {
          zmq::message_t peer, body;
          if (!sock.recv(peer, zmq::recv_flags::dontwait)) break;
          bool extra = false;
          (void)sock.recv(body, zmq::recv_flags::none);
          while (body.more()) {  // a message is one frame; drain anything else
            zmq::message_t rest;
            (void)sock.recv(rest, zmq::recv_flags::none);
            extra = true;
            if (!rest.more()) break;
          }
          proto::WorkerMessage msg;
          if (extra || !msg.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
            malformed.Warn("control: dropping a malformed message of {} bytes from a peer",
                           body.size());
            continue;
          }
          handler(*self, peer.to_string(), std::move(msg));
        }
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) return;
        loop_errors.Error("control: {}", e.what());
      }
    }
  }
};

ControlServer::ControlServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<ControlServer>> ControlServer::Start(
    const std::string& endpoint, Handler handler, const std::optional<net::CurveKeys>& curve) {
  auto impl = std::make_unique<Impl>();
  impl->handler = std::move(handler);
  KDN_RETURN_IF_ERROR(
      net::SecureServer(impl->ctx, impl->sock, curve, net::CurveRole::kControl, &impl->auth));
  try {
    impl->sock.set(zmq::sockopt::linger, 0);
    impl->sock.set(zmq::sockopt::router_mandatory, 0);  // unknown peers: drop, never block
    // No high-water mark: a ROUTER drops what it sends to a peer whose queue
    // is full, and a decode worker's token events must all reach a router
    // that falls behind under load (a default of 1,000 messages lost events
    // of 64 streams mid-answer). What the router has not read yet waits
    // here; a peer that goes away takes its queue with it.
    impl->sock.set(zmq::sockopt::sndhwm, 0);
    impl->sock.set(zmq::sockopt::maxmsgsize, kMaxControlFrameBytes);
    impl->sock.bind(endpoint);
    impl->endpoint = impl->sock.get(zmq::sockopt::last_endpoint);
    char name[64];
    std::snprintf(name, sizeof(name), "inproc://control-%p", static_cast<void*>(impl.get()));
    impl->inbox_endpoint = name;
    impl->inbox.bind(impl->inbox_endpoint);
    impl->outbox.set(zmq::sockopt::linger, 0);
    impl->outbox.connect(impl->inbox_endpoint);
  } catch (const zmq::error_t& e) {
    return net::ZmqErrorStatus(e.num(), "control socket " + endpoint);
  }
  Impl* raw = impl.get();
  std::unique_ptr<ControlServer> server(new ControlServer(std::move(impl)));
  raw->self = server.get();
  raw->thread = std::thread([raw] { raw->Loop(); });
  return server;
}

ControlServer::~ControlServer() {
  impl_->stop = true;
  if (impl_->thread.joinable()) impl_->thread.join();
}

const std::string& ControlServer::endpoint() const { return impl_->endpoint; }

void ControlServer::Send(const std::string& peer, const proto::WorkerMessage& message) {
  std::string body = message.SerializeAsString();
  std::lock_guard<std::mutex> lock(impl_->mu);
  try {
    impl_->outbox.send(zmq::buffer(peer), zmq::send_flags::sndmore);
    impl_->outbox.send(zmq::buffer(body), zmq::send_flags::none);
  } catch (const zmq::error_t& e) {
    impl_->send_errors.Error("{} control: cannot queue a reply: {}", ReqId{message.request_id()},
                             e.what());
  }
}

}  // namespace kdn::control
