#include "kdn/router/backend.h"

#include <cstdio>
#include <deque>
#include <random>
#include <thread>

#include <zmq.hpp>

#include "kdn/common/log.h"
#include "kdn/common/mutex.h"
#include "kdn/net/zmq_check.h"
#include "kdn/router/injector.h"
#include "kdn/router/kv_follower.h"
#include "kdn/router/placement.h"
#include "kdn/router/request_flow.h"
#include "worker_pool.h"

namespace kdn::router {

namespace {

using Clock = std::chrono::steady_clock;

struct Command {
  enum class Kind { kSubmit, kInject, kCancel, kKeep } kind;
  uint64_t id = 0;
  KeepOrder keep;
  Job job;
  InjectJob inject;
  JobCallback cb;
  Clock::time_point arrival;
};

}  // namespace

// The loop: takes commands from the callers' threads, workers' messages and
// liveness from the pool, and hands each to the part that owns it.
struct Backend::Impl {
  zmq::context_t ctx{1};

  Mutex mu;
  std::deque<Command> commands KDN_GUARDED_BY(mu);
  zmq::socket_t wake KDN_GUARDED_BY(mu){ctx, zmq::socket_type::push};
  uint64_t next_id KDN_GUARDED_BY(mu) = 1;
  std::vector<WorkerView> snapshot KDN_GUARDED_BY(mu);

  std::atomic<bool> stop{false};
  std::thread thread;
  std::unique_ptr<PinBook> pins;         // thread-safe itself
  std::unique_ptr<KvFollower> follower;  // with lookups_from_events; thread-safe itself

  // The backend thread's alone.
  zmq::socket_t inbox{ctx, zmq::socket_type::pull};
  std::unique_ptr<WorkerPool> pool;
  Ledger ledger;
  std::unique_ptr<RequestFlow> flow;
  std::unique_ptr<Injector> injector;
  LogLimiter loop_errors;

  // Publishes what workers reported, with the router's reservations beside.
  void UpdateSnapshot() {
    std::vector<WorkerView> v = pool->views();
    for (size_t w = 0; w < v.size(); ++w) {
      v[w].reserved = ledger.at(w);
      if (!follower) continue;
      if (auto f = follower->Status(w)) {
        v[w].kv_events_followed = true;
        v[w].kv_events_synced = f->synced;
        v[w].kv_events_blocks = f->blocks;
        v[w].kv_events_next = f->next;
      }
    }
    MutexLock lock(mu);
    snapshot = std::move(v);
  }

  void OnMessage(size_t w, const proto::WorkerMessage& m) {
    const proto::WorkerInfo* info = m.body_case() == proto::WorkerMessage::kInfo ? &m.info()
                                    : m.body_case() == proto::WorkerMessage::kLookupReply
                                        ? &m.lookup_reply().info()
                                        : nullptr;
    if (info != nullptr) {
      pool->TakeInfo(w, *info);
      ledger.Clear(w);  // the report shows what was reserved
      if (follower) Follow(w);
    }
    if (m.body_case() == proto::WorkerMessage::kInfo) return flow->OnReport();
    if (m.body_case() == proto::WorkerMessage::kInjectReply) return injector->OnReply(w, m);
    flow->OnMessage(w, m);
  }

  // Follows worker `w`'s KV events where it says it publishes them (the
  // same again changes nothing).
  void Follow(size_t w) {
    const WorkerView& v = pool->views()[w];
    if (v.kv_events_endpoint.empty() || !v.compatible) return follower->Forget(w);
    follower->Follow(w, ReachableEndpoint(v.kv_events_endpoint, v.endpoint),
                     v.kv_events_replay_endpoint.empty()
                         ? std::string()
                         : ReachableEndpoint(v.kv_events_replay_endpoint, v.endpoint),
                     v.kv_events_topic, v.kv_events_stream);
  }

  // Worker `w` is down (`why`): published before its requests fail, so that
  // whoever hears of a failure (the client, /health) already sees it down.
  void MarkDown(size_t w, const std::string& why) {
    pool->MarkDown(w, why);
    UpdateSnapshot();
    flow->OnWorkerDown(w, why);
    if (pool->views()[w].role == Role::kPrefill) injector->OnWorkerDown(w);
  }

  void RunCommands() {
    std::deque<Command> todo;
    {
      MutexLock lock(mu);
      todo.swap(commands);
    }
    for (Command& c : todo) {
      if (c.kind == Command::Kind::kKeep) {
        flow->SendKeep(c.keep);
      } else if (c.kind == Command::Kind::kSubmit) {
        flow->Submit(c.id, std::move(c.job), std::move(c.cb), c.arrival);
      } else if (c.kind == Command::Kind::kInject) {
        injector->Start(c.id, std::move(c.inject), std::move(c.cb));
      } else if (!injector->Cancel(c.id)) {
        flow->Cancel(c.id);
      }
    }
  }

  void Tick() {
    const auto silent = pool->Ping(Clock::now(), [this](size_t w) { return flow->HeldOn(w); });
    for (size_t w : silent) MarkDown(w, "stopped answering");
    flow->Tick(Clock::now());
    pins->Expire(Clock::now());
    if (!silent.empty()) UpdateSnapshot();
  }

  void Loop() {
    std::vector<zmq::pollitem_t> items;
    items.push_back({inbox.handle(), 0, ZMQ_POLLIN, 0});
    pool->AppendPollItems(items);
    const size_t n = pool->size();
    auto last_snapshot = Clock::now();
    while (!stop.load(std::memory_order_relaxed)) {
      try {
        zmq::poll(items.data(), items.size(), std::chrono::milliseconds(50));
        if (items[0].revents & ZMQ_POLLIN) {
          zmq::message_t m;
          while (inbox.recv(m, zmq::recv_flags::dontwait)) {
          }
          RunCommands();
        }
        for (size_t w = 0; w < n; ++w) {
          if (!(items[w + 1].revents & ZMQ_POLLIN)) continue;
          pool->Receive(w, [&](const proto::WorkerMessage& wm) { OnMessage(w, wm); });
        }
        for (size_t w = 0; w < n; ++w) {
          if ((items[1 + n + w].revents & ZMQ_POLLIN) && pool->ConnectionClosed(w)) {
            MarkDown(w, "closed its connection");
            UpdateSnapshot();
          }
        }
        Tick();
        if (Clock::now() - last_snapshot > std::chrono::milliseconds(100)) {
          UpdateSnapshot();
          last_snapshot = Clock::now();
        }
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) return;
        loop_errors.Error("backend: {}", e.what());
      }
    }
  }
};

Backend::Backend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Backend>> Backend::Start(const BackendOptions& options,
                                                const text::Tokenizer& tokenizer,
                                                Metrics* metrics) {
  if (options.prefill_endpoints.empty()) return InvalidArgument("no prefill worker given");
  if (options.decode_endpoints.empty()) return InvalidArgument("no decode worker given");
  auto impl = std::make_unique<Impl>();
  std::random_device rd;
  const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                         static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  // Request ids count up from a random point, so that two runs of a router
  // almost never share one in their logs: 30 random bits above a 32-bit
  // count, below the injection parts' ids (1 << 62).
  {
    MutexLock lock(impl->mu);  // nothing shares impl yet: uncontended
    impl->next_id = ((nonce >> 7) & 0x3fffffff) << 32 | 1;
    try {
      char name[64];
      std::snprintf(name, sizeof(name), "inproc://router-backend-%p",
                    static_cast<void*>(impl.get()));
      impl->inbox.bind(name);
      impl->wake.set(zmq::sockopt::linger, 0);
      impl->wake.connect(name);
    } catch (const zmq::error_t& e) {
      return net::ZmqErrorStatus(e.num(), "connecting to the workers");
    }
  }
  KDN_ASSIGN_OR_RETURN(impl->pool, WorkerPool::Connect(impl->ctx, options, impl.get()));
  impl->ledger = Ledger(impl->pool->size());
  impl->flow = std::make_unique<RequestFlow>(options, impl->pool->views(), impl->pool->identity(),
                                             impl->ledger, *impl->pool, tokenizer, metrics, nonce);
  impl->pins = std::make_unique<PinBook>(options.max_pinned_bytes_per_tenant);
  impl->flow->SetPins(impl->pins.get(), options.kv_bytes_per_token);
  if (options.lookups_from_events) {
    impl->follower = std::make_unique<KvFollower>();
    impl->flow->SetFollower(impl->follower.get());
  }
  impl->injector =
      std::make_unique<Injector>(impl->pool->views(), impl->ledger, *impl->pool, metrics);
  impl->UpdateSnapshot();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<Backend>(new Backend(std::move(impl)));
}

Backend::~Backend() {
  impl_->stop = true;
  if (impl_->thread.joinable()) impl_->thread.join();
}

uint64_t Backend::Submit(Job job, JobCallback callback) {
  MutexLock lock(impl_->mu);
  const uint64_t id = impl_->next_id++;
  impl_->commands.push_back(
      {Command::Kind::kSubmit, id, {}, std::move(job), {}, std::move(callback), Clock::now()});
  (void)impl_->wake.send(zmq::str_buffer("s"), zmq::send_flags::dontwait);
  return id;
}

uint64_t Backend::Inject(InjectJob job, JobCallback callback) {
  MutexLock lock(impl_->mu);
  const uint64_t id = impl_->next_id++;
  Command c{Command::Kind::kInject, id, {}, {}, std::move(job), std::move(callback), Clock::now()};
  impl_->commands.push_back(std::move(c));
  (void)impl_->wake.send(zmq::str_buffer("i"), zmq::send_flags::dontwait);
  return id;
}

void Backend::Cancel(uint64_t id) {
  MutexLock lock(impl_->mu);
  impl_->commands.push_back({Command::Kind::kCancel, id, {}, {}, {}, {}, Clock::now()});
  (void)impl_->wake.send(zmq::str_buffer("c"), zmq::send_flags::dontwait);
}

std::vector<PinInfo> Backend::Pins(const std::string& tenant) const {
  return impl_->pins->List(tenant, Clock::now());
}

Status Backend::Unpin(const std::string& tenant, const std::string& id) {
  KDN_ASSIGN_OR_RETURN(KeepOrder order, impl_->pins->Drop(tenant, id, Clock::now()));
  if (order.keys.empty()) return Status::Ok();
  MutexLock lock(impl_->mu);
  impl_->commands.push_back({Command::Kind::kKeep, 0, std::move(order), {}, {}, {}, Clock::now()});
  (void)impl_->wake.send(zmq::str_buffer("k"), zmq::send_flags::dontwait);
  return Status::Ok();
}

PinBook::Totals Backend::PinTotals() const { return impl_->pins->totals(); }

std::vector<WorkerView> Backend::Workers() const {
  MutexLock lock(impl_->mu);
  return impl_->snapshot;
}

}  // namespace kdn::router
