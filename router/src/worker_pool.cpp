#include "worker_pool.h"

#include <cstdio>
#include <cstring>

#include "kdn/control/control_server.h"
#include "kdn/control/convert.h"
#include "kdn/net/zmq_check.h"
#include "kdn/net/zmq_curve.h"
#include "worker_messages.h"

namespace kdn::router {

const char* RoleName(Role role) { return role == Role::kPrefill ? "prefill" : "decode"; }

Result<std::unique_ptr<WorkerPool>> WorkerPool::Connect(zmq::context_t& ctx,
                                                        const BackendOptions& options,
                                                        const void* tag) {
  std::unique_ptr<WorkerPool> pool(new WorkerPool(options));
  auto add = [&](const std::string& ep, Role role) -> Status {
    WorkerView v;
    v.name = ep;
    v.role = role;
    v.endpoint = ep;
    Link l;
    l.sock = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer);
    KDN_RETURN_IF_ERROR(net::SecureClient(*l.sock, options.curve));
    l.sock->set(zmq::sockopt::linger, 0);
    l.sock->set(zmq::sockopt::sndhwm, 100000);
    // Read whatever the worker sent (its token events), however far behind:
    // the worker's side holds no limit either (ControlServer).
    l.sock->set(zmq::sockopt::rcvhwm, 0);
    l.sock->set(zmq::sockopt::maxmsgsize, control::kMaxControlFrameBytes);
    char mon[96];
    std::snprintf(mon, sizeof(mon), "inproc://router-backend-%p-monitor-%zu", tag,
                  pool->links_.size());
    if (zmq_socket_monitor(l.sock->handle(), mon, ZMQ_EVENT_DISCONNECTED) != 0) {
      return net::ZmqErrorStatus(zmq_errno(), "monitoring the connection to " + ep);
    }
    l.monitor = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::pair);
    l.monitor->set(zmq::sockopt::linger, 0);
    l.monitor->connect(mon);
    l.sock->connect(ep);
    pool->views_.push_back(std::move(v));
    pool->links_.push_back(std::move(l));
    return Status::Ok();
  };
  try {
    for (const std::string& ep : options.prefill_endpoints) {
      KDN_RETURN_IF_ERROR(add(ep, Role::kPrefill));
    }
    for (const std::string& ep : options.decode_endpoints) {
      KDN_RETURN_IF_ERROR(add(ep, Role::kDecode));
    }
  } catch (const zmq::error_t& e) {
    return net::ZmqErrorStatus(e.num(), "connecting to the workers");
  }
  return pool;
}

void WorkerPool::Send(size_t w, uint64_t request_id, proto::WorkerMessage& m) {
  m.set_request_id(request_id);
  std::string body = m.SerializeAsString();
  try {
    // Never block the loop: a worker that stopped reading is found out by
    // its silence.
    (void)links_[w].sock->send(zmq::buffer(body), zmq::send_flags::dontwait);
  } catch (const zmq::error_t& e) {
    send_errors_.Error("{} sending to {}: {}", ReqId{request_id}, views_[w].name, e.what());
  }
}

void WorkerPool::AppendPollItems(std::vector<zmq::pollitem_t>& items) {
  for (Link& l : links_) items.push_back({l.sock->handle(), 0, ZMQ_POLLIN, 0});
  for (Link& l : links_) items.push_back({l.monitor->handle(), 0, ZMQ_POLLIN, 0});
}

void WorkerPool::Receive(size_t w,
                         const std::function<void(const proto::WorkerMessage&)>& on_message) {
  for (int k = 0; k < 256; ++k) {
    zmq::message_t msg;
    if (!links_[w].sock->recv(msg, zmq::recv_flags::dontwait)) return;
    links_[w].last_heard = Clock::now();
    links_[w].heard = true;
    WorkerView& v = views_[w];
    if (!v.up) {
      v.up = true;
      LogInfo("{} ({}) is up", v.endpoint, RoleName(v.role));
    }
    proto::WorkerMessage wm;
    if (!wm.ParseFromArray(msg.data(), static_cast<int>(msg.size()))) {
      bad_messages_.Warn("dropping an undecodable message from {}", v.name);
      continue;
    }
    on_message(wm);
  }
}

bool WorkerPool::ConnectionClosed(size_t w) {
  bool closed = false;
  for (;;) {
    zmq::message_t event, endpoint;
    if (!links_[w].monitor->recv(event, zmq::recv_flags::dontwait)) return closed;
    if (event.more()) (void)links_[w].monitor->recv(endpoint, zmq::recv_flags::none);
    uint16_t id = 0;
    if (event.size() >= sizeof(id)) std::memcpy(&id, event.data(), sizeof(id));
    closed |= id == ZMQ_EVENT_DISCONNECTED && views_[w].up;
  }
}

std::vector<size_t> WorkerPool::Ping(Clock::time_point now,
                                     const std::function<std::vector<uint64_t>(size_t)>& held) {
  std::vector<size_t> silent;
  for (size_t w = 0; w < links_.size(); ++w) {
    Link& l = links_[w];
    if (now - l.last_ping >= options_.ping_interval) {
      proto::WorkerMessage m = PingMessage();
      for (uint64_t id : held(w)) m.mutable_info_request()->add_held_requests(id);
      Send(w, 0, m);
      l.last_ping = now;
    }
    // Silent means nothing arrived, not nothing read yet: after a stall of
    // the router's own loop its workers' replies may wait in the socket.
    if (views_[w].up && (!l.heard || now - l.last_heard > options_.worker_timeout) &&
        (l.sock->get(zmq::sockopt::events) & ZMQ_POLLIN) == 0) {
      silent.push_back(w);
    }
  }
  return silent;
}

void WorkerPool::MarkDown(size_t w, const std::string& why) {
  views_[w].up = false;
  links_[w].heard = false;
  LogWarn("{} ({}) {}", views_[w].name, views_[w].endpoint, why);
}

void WorkerPool::TakeInfo(size_t w, const proto::WorkerInfo& info) {
  WorkerView& v = views_[w];
  if (!info.name().empty()) v.name = info.name();
  v.queue_depth = info.queue_depth();
  v.max_batch = info.max_batch();
  v.queue_tokens = info.queue_tokens();
  v.free_kv_blocks = info.free_kv_blocks();
  v.total_kv_blocks = info.total_kv_blocks();
  v.max_context = info.max_context();
  v.health = info.health().code() != 0 ? info.health().message() : "";
  v.host_id = info.host_id();
  v.device = info.device();
  v.kv_transport = info.kv_transport();
  v.kv_transports.assign(info.kv_transports().begin(), info.kv_transports().end());
  v.kv_codec = info.kv_codec();
  v.store_unreachable = info.store_unreachable();
  v.leased_kv_blocks = info.leased_kv_blocks();
  v.kvbus_leased_bytes = info.kvbus_leased_bytes();
  v.resident = info.resident();
  v.local_prefill = info.local_prefill();
  v.pushed_kv = info.pushed_kv();
  v.preemption = info.preemption();
  v.store_tiers.assign(info.store_tiers().begin(), info.store_tiers().end());
  v.kv_events_endpoint = info.kv_events_endpoint();
  v.kv_events_replay_endpoint = info.kv_events_replay_endpoint();
  v.kv_events_topic = info.kv_events_topic();
  v.kv_events_stream = info.kv_events_stream();
  if (info.role() != RoleName(v.role)) {
    if (v.compatible) {
      LogError("{} is a {} worker, not {}; not using it", v.endpoint, info.role(),
               RoleName(v.role));
    }
    v.compatible = false;
    return;
  }
  if (!info.kvbus_endpoint().empty()) v.kvbus_endpoint = info.kvbus_endpoint();
  auto fp = control::KeyFromBytes(info.model_fingerprint());
  if (!fp.ok()) return;
  if (!identity_.known) {
    identity_ = {true, *fp, info.chunk_tokens()};
    LogInfo("model {}, chunks of {} tokens (from {})", fp->ToHex(), identity_.chunk_tokens, v.name);
  }
  const bool ok = *fp == identity_.fingerprint && info.chunk_tokens() == identity_.chunk_tokens;
  if (!ok && v.compatible) {
    LogError(
        "{} serves another model or chunk size ({}, {}) than the others ({}, {}); not "
        "using it",
        v.name, fp->ToHex(), info.chunk_tokens(), identity_.fingerprint.ToHex(),
        identity_.chunk_tokens);
  }
  v.compatible = ok;
}

}  // namespace kdn::router
