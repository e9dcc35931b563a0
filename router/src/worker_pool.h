#pragma once
// WorkerPool: the router's connections to its workers and who is up
// (docs/serving.md). One DEALER per worker, and ZeroMQ's monitor of it (a
// PAIR on its inproc endpoint), so that a process that is gone is down in
// milliseconds, not after worker_timeout of silence. Pings each worker every
// ping_interval and takes each report (proto::WorkerInfo) into its view: the
// views hold only what workers reported and the pool's liveness, never the
// router's reservations (placement.h's Ledger). The first worker of the
// configured role to report fixes the model identity; one of another role,
// model or chunk size is kept but not compatible.
//
// Not thread-safe: the backend thread's alone; Backend publishes copies.

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <zmq.hpp>

#include "kdn/common/log.h"
#include "kdn/router/backend.h"
#include "kdn/router/request_flow.h"
#include "kdn/router/worker_view.h"
#include "serving.pb.h"

namespace kdn::router {

class WorkerPool : public WorkerLink {
 public:
  using Clock = std::chrono::steady_clock;

  // Connects to every worker of `options` (prefill first, then decode);
  // `tag` makes the monitors' inproc names unique in `ctx`.
  static Result<std::unique_ptr<WorkerPool>> Connect(zmq::context_t& ctx,
                                                     const BackendOptions& options,
                                                     const void* tag);

  void Send(size_t worker, uint64_t request_id, proto::WorkerMessage& m) override;

  const WorkerViews& views() const { return views_; }
  const ModelIdentity& identity() const { return identity_; }
  size_t size() const { return views_.size(); }

  // The sockets to poll: every worker's connection, then every monitor.
  void AppendPollItems(std::vector<zmq::pollitem_t>& items);
  // Reads what worker `w` sent (at most a batch), marking it heard from and
  // up; `on_message` gets each decodable message.
  void Receive(size_t w, const std::function<void(const proto::WorkerMessage&)>& on_message);
  // Whether worker `w`'s monitor saw its connection close while it was up.
  bool ConnectionClosed(size_t w);
  // Pings the workers due one, each ping naming `held(w)`: the requests
  // whose reservations on worker `w` the router still wants
  // (proto::InfoRequest); returns those silent past worker_timeout that were
  // up (the caller marks them down).
  std::vector<size_t> Ping(Clock::time_point now,
                           const std::function<std::vector<uint64_t>(size_t)>& held);
  // Worker `w`'s report.
  void TakeInfo(size_t w, const proto::WorkerInfo& info);
  // Worker `w` is down (`why`) until heard from again.
  void MarkDown(size_t w, const std::string& why);

 private:
  struct Link {
    std::unique_ptr<zmq::socket_t> sock;
    std::unique_ptr<zmq::socket_t> monitor;
    Clock::time_point last_heard{};
    Clock::time_point last_ping{};
    bool heard = false;
  };
  explicit WorkerPool(const BackendOptions& options) : options_(options) {}

  const BackendOptions options_;
  WorkerViews views_;
  std::vector<Link> links_;  // indexed like views_
  ModelIdentity identity_;
  // Failures that can repeat on every turn of the loop.
  LogLimiter send_errors_, bad_messages_;
};

}  // namespace kdn::router
