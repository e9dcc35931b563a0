#include "kdn/kvbus/store_service.h"

#include <zmq.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "kdn/common/log.h"
#include "kdn/common/mutex.h"
#include "kvbus_store.pb.h"
#include "kdn/net/zmq_curve.h"
#include "kdn/kvbus/zmq_chunk.h"

namespace kdn::kvbus {

namespace {

std::string KeyBytes(const ChunkKey& k) {
  uint8_t b[16];
  k.ToBytes(b);
  return std::string(reinterpret_cast<const char*>(b), 16);
}

Result<ChunkKey> ParseKey(const std::string& s) {
  if (s.size() != 16)
    return InvalidArgument("key of " + std::to_string(s.size()) + " bytes, expected 16");
  return ChunkKey::FromBytes(reinterpret_cast<const uint8_t*>(s.data()));
}

void FillStats(proto::StoreTierStats* out, const std::string& name, const TierStats& s) {
  out->set_name(name);
  out->set_chunks(s.chunks);
  out->set_bytes(s.bytes);
  out->set_capacity_bytes(s.capacity_bytes);
  out->set_hits(s.hits);
  out->set_misses(s.misses);
  out->set_puts(s.puts);
  out->set_evictions(s.evictions);
  out->set_corrupt(s.corrupt);
}

TierStats FromProto(const proto::StoreTierStats& p) {
  return TierStats{p.chunks(), p.bytes(), p.capacity_bytes(), p.hits(),
                   p.misses(), p.puts(),  p.evictions(),      p.corrupt()};
}

void SetStatus(proto::StoreReply* reply, const Status& st) {
  reply->set_code(static_cast<int32_t>(st.code()));
  reply->set_message(st.message());
}

Status ReplyStatus(const proto::StoreReply& reply) {
  if (reply.code() == 0) return Status::Ok();
  return Status(static_cast<StatusCode>(reply.code()), reply.message());
}

}  // namespace

struct StoreServer::Impl {
  ChunkStore& store;
  TierStatsFn tier_stats;
  zmq::context_t ctx{1};
  zmq::socket_t sock{ctx, zmq::socket_type::router};
  std::unique_ptr<net::CurveAuthenticator> auth;  // with CURVE; closed before sock and ctx
  std::atomic<bool> stop{false};
  std::thread thread;

  explicit Impl(ChunkStore& s, TierStatsFn t) : store(s), tier_stats(std::move(t)) {}

  // Answers one request; `payload` is the put's chunk, `reply_chunk` a hit.
  void Handle(const proto::StoreRequest& req, zmq::message_t* payload, proto::StoreReply* reply,
              std::shared_ptr<const Chunk>* reply_chunk) {
    reply->set_id(req.id());
    switch (req.op_case()) {
      case proto::StoreRequest::kLookup:
        for (const std::string& k : req.lookup().keys()) {
          auto key = ParseKey(k);
          if (!key.ok()) return SetStatus(reply, key.status());
          reply->add_present(store.Contains(*key));
        }
        return;
      case proto::StoreRequest::kGet: {
        auto key = ParseKey(req.get().key());
        if (!key.ok()) return SetStatus(reply, key.status());
        auto chunk = store.Get(*key);
        if (!chunk.ok()) return SetStatus(reply, chunk.status());
        *reply_chunk = std::move(chunk).value();
        return;
      }
      case proto::StoreRequest::kPut: {
        if (payload == nullptr)
          return SetStatus(reply, InvalidArgument("put without a chunk frame"));
        const auto* d = static_cast<const uint8_t*>(payload->data());
        auto chunk = Chunk::Parse(std::vector<uint8_t>(d, d + payload->size()));
        if (!chunk.ok()) return SetStatus(reply, chunk.status());
        return SetStatus(reply, store.Put(std::move(chunk).value()));
      }
      case proto::StoreRequest::kStats:
        FillStats(reply->add_stats(), "store", store.Stats());
        if (tier_stats) {
          for (const auto& [name, s] : tier_stats()) FillStats(reply->add_stats(), name, s);
        }
        return;
      case proto::StoreRequest::kKeep: {
        std::vector<ChunkKey> keys;
        for (const std::string& k : req.keep().keys()) {
          auto key = ParseKey(k);
          if (!key.ok()) return SetStatus(reply, key.status());
          keys.push_back(*key);
        }
        auto kept = store.Keep(keys, KeepLeaseFromWire(req.keep().lease_ms()));
        if (!kept.ok()) return SetStatus(reply, kept.status());
        reply->set_kept(*kept);
        return;
      }
      case proto::StoreRequest::OP_NOT_SET:
        return SetStatus(reply, InvalidArgument("request without an operation"));
    }
  }

  void Loop() {
    while (!stop.load()) {
      zmq::pollitem_t item{sock.handle(), 0, ZMQ_POLLIN, 0};
      try {
        zmq::poll(&item, 1, std::chrono::milliseconds(100));
        if (!(item.revents & ZMQ_POLLIN)) continue;
        std::vector<zmq::message_t> frames;
        for (;;) {
          zmq::message_t m;
          if (!sock.recv(m, zmq::recv_flags::none)) break;
          const bool more = m.more();
          frames.push_back(std::move(m));
          if (!more) break;
        }
        if (frames.size() < 2) continue;  // not a client of ours
        proto::StoreRequest req;
        proto::StoreReply reply;
        std::shared_ptr<const Chunk> reply_chunk;
        if (!req.ParseFromArray(frames[1].data(), static_cast<int>(frames[1].size()))) {
          static LogLimiter malformed;  // a client can send them without end
          malformed.Warn("kdn-store: answering a malformed request of {} bytes", frames[1].size());
          SetStatus(&reply, InvalidArgument("malformed request"));
        } else {
          Handle(req, frames.size() > 2 ? &frames[2] : nullptr, &reply, &reply_chunk);
        }
        const std::string out = reply.SerializeAsString();
        sock.send(frames[0], zmq::send_flags::sndmore);
        if (reply_chunk) {
          sock.send(zmq::buffer(out), zmq::send_flags::sndmore);
          sock.send(ChunkMessage(std::move(reply_chunk)), zmq::send_flags::none);
        } else {
          sock.send(zmq::buffer(out), zmq::send_flags::none);
        }
      } catch (const zmq::error_t& e) {
        // A client that went away mid-reply (ROUTER drops unroutable replies,
        // so this is rare); keep serving the others.
        static LogLimiter errors;
        if (e.num() != ETERM) errors.Warn("kdn-store: {}", e.what());
      }
    }
  }
};

StoreServer::StoreServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<StoreServer>> StoreServer::Start(ChunkStore& store,
                                                        const std::string& endpoint,
                                                        TierStatsFn tier_stats,
                                                        StoreServerOptions options) {
  auto impl = std::make_unique<Impl>(store, std::move(tier_stats));
  KDN_RETURN_IF_ERROR(
      net::SecureServer(impl->ctx, impl->sock, options.curve, net::CurveRole::kData, &impl->auth));
  std::string bound;
  try {
    impl->sock.set(zmq::sockopt::linger, 0);
    impl->sock.set(zmq::sockopt::maxmsgsize, options.max_frame_bytes);
    // Unroutable replies (the client is gone) are dropped, not an error.
    impl->sock.set(zmq::sockopt::router_mandatory, 0);
    impl->sock.bind(endpoint);
    bound = impl->sock.get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    return Unavailable("kdn-store: cannot listen on " + endpoint + ": " + e.what());
  }
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  std::unique_ptr<StoreServer> server(new StoreServer(std::move(impl)));
  server->endpoint_ = bound;
  return server;
}

void StoreServer::Stop() {
  if (!impl_ || !impl_->thread.joinable()) return;
  impl_->stop.store(true);
  impl_->thread.join();
}

StoreServer::~StoreServer() { Stop(); }

struct RemoteStore::Impl {
  std::string endpoint;
  RemoteStoreOptions options;
  zmq::context_t ctx{1};
  // Two connections: index-only requests (lookups, stats), which a router
  // waits on, never queue behind a chunk's transfer (a Get or a Put of
  // megabytes, such as a decode worker storing the conversation it just
  // finished while the next turn is looked up).
  struct Lane {
    // The request that holds the lane (Acquire) owns these until Release.
    std::unique_ptr<zmq::socket_t> sock;
    uint64_t next_id = 1;
    // When the request holding the connection began (steady_clock ticks),
    // 0 when none does: one that has run past lookup_timeout marks a slow
    // store, and the requests behind it give up at once instead of each
    // waiting.
    std::atomic<int64_t> busy_since{0};

    // One request at a time over the socket. A flag under a Mutex, not a
    // std::timed_mutex: GCC 12's ThreadSanitizer does not intercept the
    // pthread_mutex_clocklock under try_lock_for, and so reports each unlock
    // as one of a mutex nobody locked.
    Mutex mu;
    CondVar released;
    bool held KDN_GUARDED_BY(mu) = false;

    // Takes the lane, waiting up to `wait` for the request that holds it;
    // false if that one still does.
    bool Acquire(std::chrono::milliseconds wait) KDN_EXCLUDES(mu) {
      const auto deadline = std::chrono::steady_clock::now() + wait;
      MutexLock lock(mu);
      while (held && released.WaitUntil(mu, deadline)) {
      }
      if (held) return false;
      held = true;
      return true;
    }
    void Release() KDN_EXCLUDES(mu) {
      {
        MutexLock lock(mu);
        held = false;
      }
      released.Signal();
    }
  };
  Lane bulk, index;
  std::atomic<uint64_t> corrupt{0};
  std::atomic<uint64_t> unreachable{0};
  std::atomic<uint64_t> hits{0};    // this client's Gets answered with the chunk
  std::atomic<uint64_t> misses{0};  // and those that were not (not held, damaged, no answer)
  // The store is held to be down until down_until, after `failures`
  // requests in a row went unanswered.
  Mutex down_mu;
  std::chrono::steady_clock::time_point down_until KDN_GUARDED_BY(down_mu){};
  int failures KDN_GUARDED_BY(down_mu) = 0;

  // A request went unanswered: fail fast for a backoff that doubles with
  // each failure in a row.
  void MarkDown() {
    MutexLock lock(down_mu);
    ++unreachable;
    ++failures;
    auto backoff = options.backoff;
    for (int i = 1; i < failures && backoff < options.max_backoff; ++i) backoff *= 2;
    down_until = std::chrono::steady_clock::now() + std::min(backoff, options.max_backoff);
    static LogLimiter limiter;
    limiter.Warn("kdn-store {} does not answer: its requests fail at once (cache misses) for {} ms",
                 endpoint, std::min(backoff, options.max_backoff).count());
  }

  Status Reconnect(Lane& lane) {
    std::unique_ptr<zmq::socket_t>& sock = lane.sock;
    try {
      sock = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer);
      KDN_RETURN_IF_ERROR(net::SecureClient(*sock, options.curve));
      sock->set(zmq::sockopt::linger, 0);
      sock->set(zmq::sockopt::maxmsgsize, options.max_frame_bytes);
      sock->connect(endpoint);
    } catch (const zmq::error_t& e) {
      return Unavailable("kdn-store " + endpoint + ": " + e.what());
    }
    return Status::Ok();
  }

  // Sends `req` (and `chunk` as a second frame) and waits for its reply, on
  // the index connection when neither carries a chunk. `timeout`:
  // options.timeout or, for index-only requests, lookup_timeout.
  Status Call(proto::StoreRequest& req, const std::shared_ptr<const Chunk>& chunk,
              proto::StoreReply* reply, std::vector<uint8_t>* reply_payload,
              std::chrono::milliseconds timeout) {
    Lane& lane = chunk == nullptr && reply_payload == nullptr ? index : bulk;
    std::unique_ptr<zmq::socket_t>& sock = lane.sock;
    std::atomic<int64_t>& busy_since = lane.busy_since;
    const auto wait = std::min(timeout, options.lookup_timeout);
    const int64_t since = busy_since.load();
    if ((since != 0 &&
         std::chrono::steady_clock::now().time_since_epoch().count() - since >
             std::chrono::duration_cast<std::chrono::steady_clock::duration>(wait).count()) ||
        !lane.Acquire(wait)) {
      // Another thread's request holds the connection (a large Put, or a
      // server that stopped answering it): not worth waiting for.
      ++unreachable;
      return Unavailable("kdn-store " + endpoint + ": busy with another request");
    }
    struct Hold {
      Lane& lane;
      ~Hold() { lane.Release(); }
    } hold{lane};
    busy_since.store(std::chrono::steady_clock::now().time_since_epoch().count());
    struct Idle {
      std::atomic<int64_t>& since;
      ~Idle() { since.store(0); }
    } idle{busy_since};
    {
      MutexLock down(down_mu);
      if (std::chrono::steady_clock::now() < down_until) {
        ++unreachable;
        return Unavailable("kdn-store " + endpoint + ": not answering; retried after a backoff");
      }
    }
    if (!sock) KDN_RETURN_IF_ERROR(Reconnect(lane));
    req.set_id(lane.next_id++);
    const std::string out = req.SerializeAsString();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    try {
      if (chunk) {
        sock->send(zmq::buffer(out), zmq::send_flags::sndmore);
        sock->send(ChunkMessage(chunk), zmq::send_flags::none);
      } else {
        sock->send(zmq::buffer(out), zmq::send_flags::none);
      }
      for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        zmq::pollitem_t item{sock->handle(), 0, ZMQ_POLLIN, 0};
        if (left.count() <= 0 || zmq::poll(&item, 1, left) == 0) {
          // Drop the connection: a late reply must not be read as the next one's.
          sock.reset();
          MarkDown();
          return Unavailable("kdn-store " + endpoint + ": no reply within " +
                             std::to_string(timeout.count()) + " ms");
        }
        zmq::message_t head, body;
        (void)sock->recv(head, zmq::recv_flags::none);
        const bool more = head.more();
        if (more) (void)sock->recv(body, zmq::recv_flags::none);
        while (sock->get(zmq::sockopt::rcvmore)) {
          zmq::message_t extra;
          (void)sock->recv(extra, zmq::recv_flags::none);
        }
        if (!reply->ParseFromArray(head.data(), static_cast<int>(head.size()))) {
          return Corruption("kdn-store " + endpoint + ": malformed reply");
        }
        if (reply->id() != req.id()) continue;  // a stale answer to an earlier, timed-out call
        if (more && reply_payload != nullptr) {
          const auto* d = static_cast<const uint8_t*>(body.data());
          reply_payload->assign(d, d + body.size());
        }
        {
          MutexLock down(down_mu);
          failures = 0;
        }
        return Status::Ok();
      }
    } catch (const zmq::error_t& e) {
      sock.reset();
      MarkDown();
      return Unavailable("kdn-store " + endpoint + ": " + e.what());
    }
  }
};

RemoteStore::RemoteStore(std::string endpoint, std::unique_ptr<Impl> impl)
    : endpoint_(std::move(endpoint)), impl_(std::move(impl)) {}

RemoteStore::~RemoteStore() = default;

Result<std::unique_ptr<RemoteStore>> RemoteStore::Connect(const std::string& endpoint,
                                                          RemoteStoreOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->endpoint = endpoint;
  impl->options = options;
  KDN_RETURN_IF_ERROR(impl->Reconnect(impl->bulk));
  KDN_RETURN_IF_ERROR(impl->Reconnect(impl->index));
  return std::unique_ptr<RemoteStore>(new RemoteStore(endpoint, std::move(impl)));
}

Result<std::shared_ptr<const Chunk>> RemoteStore::Get(const ChunkKey& key) {
  auto got = [&]() -> Result<std::shared_ptr<const Chunk>> {
    proto::StoreRequest req;
    req.mutable_get()->set_key(KeyBytes(key));
    proto::StoreReply reply;
    std::vector<uint8_t> payload;
    KDN_RETURN_IF_ERROR(impl_->Call(req, nullptr, &reply, &payload, impl_->options.timeout));
    KDN_RETURN_IF_ERROR(ReplyStatus(reply));
    auto chunk = Chunk::Parse(std::move(payload));
    if (!chunk.ok() || (*chunk)->key() != key) {
      ++impl_->corrupt;
      return NotFound("kdn-store " + endpoint_ + ": chunk " + key.ToHex() + " arrived damaged (" +
                      (chunk.ok() ? std::string("wrong key") : chunk.status().message()) + ")");
    }
    return chunk;
  }();
  ++(got.ok() ? impl_->hits : impl_->misses);
  return got;
}

Result<std::vector<bool>> RemoteStore::Lookup(std::span<const ChunkKey> keys) {
  proto::StoreRequest req;
  for (const ChunkKey& k : keys) req.mutable_lookup()->add_keys(KeyBytes(k));
  proto::StoreReply reply;
  KDN_RETURN_IF_ERROR(impl_->Call(req, nullptr, &reply, nullptr, impl_->options.lookup_timeout));
  KDN_RETURN_IF_ERROR(ReplyStatus(reply));
  if (static_cast<size_t>(reply.present_size()) != keys.size()) {
    return Corruption("kdn-store " + endpoint_ + ": lookup answered " +
                      std::to_string(reply.present_size()) + " of " + std::to_string(keys.size()) +
                      " keys");
  }
  return std::vector<bool>(reply.present().begin(), reply.present().end());
}

bool RemoteStore::Contains(const ChunkKey& key) {
  auto r = Lookup(std::span<const ChunkKey>(&key, 1));
  return r.ok() && (*r)[0];
}

std::vector<bool> RemoteStore::ContainsMany(std::span<const ChunkKey> keys) {
  if (keys.empty()) return {};
  auto r = Lookup(keys);
  return r.ok() ? *std::move(r) : std::vector<bool>(keys.size(), false);
}

Status RemoteStore::Put(std::shared_ptr<const Chunk> chunk) {
  if (chunk != nullptr && static_cast<int64_t>(chunk->size()) > impl_->options.max_frame_bytes) {
    return InvalidArgument("kdn-store " + endpoint_ + ": chunk " + chunk->key().ToHex() + " of " +
                           std::to_string(chunk->size() >> 20) + " MiB is over the " +
                           std::to_string(impl_->options.max_frame_bytes >> 20) +
                           " MiB a store message may hold");
  }
  proto::StoreRequest req;
  req.mutable_put();
  proto::StoreReply reply;
  KDN_RETURN_IF_ERROR(impl_->Call(req, chunk, &reply, nullptr, impl_->options.timeout));
  return ReplyStatus(reply);
}

Result<size_t> RemoteStore::Keep(std::span<const ChunkKey> keys, std::chrono::milliseconds lease) {
  if (lease.count() < 0) {
    return InvalidArgument("kdn-store " + endpoint_ + ": keep lease of " +
                           std::to_string(lease.count()) + " ms");
  }
  proto::StoreRequest req;
  for (const ChunkKey& k : keys) req.mutable_keep()->add_keys(KeyBytes(k));
  req.mutable_keep()->set_lease_ms(static_cast<uint64_t>(lease.count()));
  proto::StoreReply reply;
  KDN_RETURN_IF_ERROR(impl_->Call(req, nullptr, &reply, nullptr, impl_->options.lookup_timeout));
  KDN_RETURN_IF_ERROR(ReplyStatus(reply));
  return static_cast<size_t>(reply.kept());
}

Result<std::vector<std::pair<std::string, TierStats>>> RemoteStore::RemoteStats() {
  proto::StoreRequest req;
  req.mutable_stats();
  proto::StoreReply reply;
  KDN_RETURN_IF_ERROR(impl_->Call(req, nullptr, &reply, nullptr, impl_->options.lookup_timeout));
  KDN_RETURN_IF_ERROR(ReplyStatus(reply));
  std::vector<std::pair<std::string, TierStats>> out;
  for (const auto& s : reply.stats()) out.emplace_back(s.name(), FromProto(s));
  return out;
}

uint64_t RemoteStore::unreachable() const { return impl_->unreachable.load(); }

TierStats RemoteStore::LocalStats() {
  TierStats s;
  s.hits = impl_->hits.load();
  s.misses = impl_->misses.load();
  s.corrupt = impl_->corrupt.load();
  s.unreachable = impl_->unreachable.load();
  return s;
}

TierStats RemoteStore::Stats() {
  TierStats s;
  auto r = RemoteStats();
  if (r.ok() && !r->empty()) s = r->front().second;
  s.corrupt += impl_->corrupt.load();
  s.unreachable = impl_->unreachable.load();
  return s;
}

}  // namespace kdn::kvbus
