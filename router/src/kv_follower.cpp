#include "kdn/router/kv_follower.h"

#include <zmq.hpp>

#include <chrono>
#include <condition_variable>

#include <nlohmann/json.hpp>

#include "kdn/common/log.h"

namespace kdn::router {

using nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

// A block hash as the stream gives it: an int, or bytes whose first 8 are
// the hash (big-endian). Nullopt for anything else.
std::optional<uint64_t> HashOf(const json& h) {
  if (h.is_number_unsigned()) return h.get<uint64_t>();
  if (h.is_number_integer()) return static_cast<uint64_t>(h.get<int64_t>());
  if (h.is_binary() && h.get_binary().size() >= 8) {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | h.get_binary()[i];
    return v;
  }
  return std::nullopt;
}

// An event's type and block hashes, from vLLM's map form ({"type": ...,
// "block_hashes": [...]}) or its array-like form ([type, block_hashes, ...]).
bool ReadEvent(const json& e, std::string* type, const json** hashes) {
  static const json kNone = json::array();
  *hashes = &kNone;
  if (e.is_object()) {
    auto t = e.find("type");
    if (t == e.end() || !t->is_string()) return false;
    *type = t->get<std::string>();
    if (auto h = e.find("block_hashes"); h != e.end()) *hashes = &*h;
  } else if (e.is_array() && !e.empty() && e[0].is_string()) {
    *type = e[0].get<std::string>();
    if (e.size() > 1) *hashes = &e[1];
  } else {
    return false;
  }
  return (*hashes)->is_array();
}

std::string SequenceBytes(uint64_t seq) {
  std::string b(8, '\0');
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(seq >> (8 * (7 - i)));
  return b;
}

bool ReadSequence(const zmq::message_t& m, uint64_t* seq) {
  if (m.size() != 8) return false;
  *seq = 0;
  for (size_t i = 0; i < 8; ++i) *seq = (*seq << 8) | m.data<uint8_t>()[i];
  return true;
}

}  // namespace

// ------------------------------------------------------------ WorkerKvIndex

bool WorkerKvIndex::Apply(std::string_view payload) {
  const json batch = json::from_msgpack(payload.begin(), payload.end(), true, false);
  if (batch.is_discarded() || !batch.is_array() || batch.size() < 2 || !batch[1].is_array()) {
    return false;
  }
  // Checked whole before any of it is applied: a batch counts all or not.
  std::vector<std::pair<std::string, std::vector<uint64_t>>> events;
  for (const json& e : batch[1]) {
    std::string type;
    const json* hashes = nullptr;
    if (!ReadEvent(e, &type, &hashes)) return false;
    std::vector<uint64_t> hs;
    for (const json& h : *hashes) {
      auto v = HashOf(h);
      if (!v) return false;
      hs.push_back(*v);
    }
    events.emplace_back(std::move(type), std::move(hs));
  }
  for (const auto& [type, hs] : events) {
    if (type == "BlockStored") {
      held_.insert(hs.begin(), hs.end());
    } else if (type == "BlockRemoved") {
      for (uint64_t h : hs) held_.erase(h);
    } else if (type == "AllBlocksCleared") {
      held_.clear();
    }
    // Another type (a later vLLM's) says nothing of what is held.
  }
  return true;
}

WorkerKvIndex::Take WorkerKvIndex::Offer(uint64_t seq, std::string_view payload) {
  if (seq == 0) {
    held_.clear();  // the stream starts (again)
    synced_ = false;
    next_ = 0;
  } else if (!synced_ || seq > next_) {
    return Take::kGap;
  } else if (seq < next_) {
    return Take::kOld;
  }
  if (!Apply(payload)) {
    synced_ = false;
    held_.clear();
    return Take::kBad;
  }
  synced_ = true;
  next_ = seq + 1;
  return Take::kApplied;
}

void WorkerKvIndex::Reset() {
  held_.clear();
  synced_ = false;
  next_ = 0;
}

std::optional<size_t> WorkerKvIndex::Prefix(std::span<const kvbus::ChunkKey> keys) const {
  if (!synced_) return std::nullopt;
  size_t n = 0;
  while (n < keys.size() && held_.count(keys[n].hi) != 0) ++n;
  return n;
}

// ---------------------------------------------------------------- KvFollower

struct KvFollower::Impl {
  // What the callers asked for, and each worker's index: under `mu`.
  struct Wanted {
    std::string endpoint, replay, topic, stream;
    bool operator==(const Wanted&) const = default;
  };
  // The follower thread's alone: one worker's sockets.
  struct Link {
    Wanted wanted;
    std::unique_ptr<zmq::socket_t> sub, replay;
    bool replaying = false;
    Clock::time_point replay_deadline, next_replay;
    bool gap = false;       // a batch came after one not applied: fetch the missing
    bool progress = false;  // the replay in flight applied something
  };

  zmq::context_t ctx{1};
  mutable std::mutex mu;
  std::map<size_t, Wanted> wanted;          // guarded by mu
  std::map<size_t, WorkerKvIndex> indexes;  // guarded by mu
  KvFollowerStats stats;                    // guarded by mu
  std::atomic<bool> stop{false};
  std::map<size_t, Link> links;  // the thread's
  std::thread thread;

  static constexpr auto kReplayTimeout = std::chrono::seconds(2);
  // After a replay that filled nothing (the worker no longer keeps the
  // batches missed), the next try waits this long.
  static constexpr auto kReplayBackoff = std::chrono::seconds(5);

  void Reconcile() {
    std::map<size_t, Wanted> want;
    {
      std::lock_guard<std::mutex> lock(mu);
      want = wanted;
    }
    for (auto it = links.begin(); it != links.end();) {
      auto w = want.find(it->first);
      if (w == want.end() || !(w->second == it->second.wanted)) {
        const size_t gone = it->first;
        it = links.erase(it);
        std::lock_guard<std::mutex> lock(mu);
        indexes.erase(gone);
        continue;
      }
      ++it;
    }
    for (const auto& [w, spec] : want) {
      if (links.count(w) != 0) continue;
      Link link;
      link.wanted = spec;
      try {
        link.sub = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::sub);
        link.sub->set(zmq::sockopt::linger, 0);
        link.sub->set(zmq::sockopt::subscribe, spec.topic);
        link.sub->connect(spec.endpoint);
        if (!spec.replay.empty()) {
          link.replay = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer);
          link.replay->set(zmq::sockopt::linger, 0);
          link.replay->connect(spec.replay);
        }
      } catch (const zmq::error_t& e) {
        LogWarn("KV events of worker {} at {}: cannot follow: {}", w, spec.endpoint, e.what());
        continue;
      }
      LogInfo("following the KV events of worker {} at {}", w, spec.endpoint);
      {
        std::lock_guard<std::mutex> lock(mu);
        indexes[w] = WorkerKvIndex();
      }
      links.emplace(w, std::move(link));
    }
  }

  void Offer(size_t w, Link& link, uint64_t seq, const zmq::message_t& payload) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = indexes.find(w);
    if (it == indexes.end()) return;
    const auto take = it->second.Offer(seq, payload.to_string_view());
    switch (take) {
      case WorkerKvIndex::Take::kApplied:
        ++stats.batches;
        link.progress = true;
        break;
      case WorkerKvIndex::Take::kGap: link.gap = true; break;
      case WorkerKvIndex::Take::kBad:
        ++stats.refused;
        link.gap = true;  // lost: only a replay from 0 (or a restart) brings it back
        break;
      case WorkerKvIndex::Take::kOld: break;
    }
  }

  // Every message waiting at `sock`, its frames handed to `fn`.
  template <typename Fn>
  void Drain(zmq::socket_t& sock, Fn&& fn) {
    for (;;) {
      std::vector<zmq::message_t> frames;
      for (;;) {
        zmq::message_t f;
        if (!sock.recv(f, zmq::recv_flags::dontwait)) return;
        const bool more = f.more();
        frames.push_back(std::move(f));
        if (!more) break;
      }
      fn(frames);
    }
  }

  void Replays(Clock::time_point now) {
    for (auto& [w, link] : links) {
      if (!link.replay) continue;
      if (link.replaying && now < link.replay_deadline) continue;
      if (link.replaying) link.replaying = false;  // timed out: ask again
      uint64_t from = 0;
      bool synced = false;
      {
        std::lock_guard<std::mutex> lock(mu);
        const WorkerKvIndex& index = indexes[w];
        synced = index.synced();
        from = synced ? index.next() : 0;
      }
      if ((synced && !link.gap) || now < link.next_replay) continue;
      try {
        link.replay->send(zmq::buffer(std::string_view()), zmq::send_flags::sndmore);
        link.replay->send(zmq::buffer(SequenceBytes(from)), zmq::send_flags::dontwait);
      } catch (const zmq::error_t&) {
        continue;
      }
      link.replaying = true;
      link.gap = false;
      link.progress = false;
      link.replay_deadline = now + kReplayTimeout;
      std::lock_guard<std::mutex> lock(mu);
      ++stats.replays;
    }
  }

  void Loop() {
    while (!stop.load()) {
      Reconcile();
      std::vector<zmq::pollitem_t> items;
      std::vector<std::pair<size_t, bool>> owners;  // worker, is the replay socket
      for (auto& [w, link] : links) {
        items.push_back({link.sub->handle(), 0, ZMQ_POLLIN, 0});
        owners.emplace_back(w, false);
        if (link.replay) {
          items.push_back({link.replay->handle(), 0, ZMQ_POLLIN, 0});
          owners.emplace_back(w, true);
        }
      }
      try {
        if (items.empty()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        } else {
          zmq::poll(items.data(), items.size(), std::chrono::milliseconds(50));
        }
        for (size_t i = 0; i < items.size(); ++i) {
          if (!(items[i].revents & ZMQ_POLLIN)) continue;
          // Named, not bound: clang 14 captures no structured binding.
          const size_t w = owners[i].first;
          const bool is_replay = owners[i].second;
          Link& link = links.at(w);
          if (!is_replay) {
            Drain(*link.sub, [&](std::vector<zmq::message_t>& f) {
              uint64_t seq = 0;
              if (f.size() == 3 && ReadSequence(f[1], &seq)) Offer(w, link, seq, f[2]);
            });
            continue;
          }
          Drain(*link.replay, [&](std::vector<zmq::message_t>& f) {
            // "", topic, sequence, payload; the end: sequence -1.
            uint64_t seq = 0;
            if (f.size() != 4 || !ReadSequence(f[2], &seq)) return;
            if (seq != UINT64_MAX) return Offer(w, link, seq, f[3]);
            link.replaying = false;
            // Nothing filled: the worker keeps those batches no more.
            if (!link.progress) link.next_replay = Clock::now() + kReplayBackoff;
          });
        }
        Replays(Clock::now());
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) return;
        if (e.num() != EINTR) LogWarn("following KV events: {}", e.what());
      }
    }
  }
};

KvFollower::KvFollower() : impl_(std::make_unique<Impl>()) {
  impl_->thread = std::thread([this] { impl_->Loop(); });
}

KvFollower::~KvFollower() {
  impl_->stop = true;
  if (impl_->thread.joinable()) impl_->thread.join();
}

void KvFollower::Follow(size_t w, const std::string& endpoint, const std::string& replay,
                        const std::string& topic, const std::string& stream) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const Impl::Wanted want{endpoint, replay, topic, stream};
  auto it = impl_->wanted.find(w);
  if (it != impl_->wanted.end() && it->second == want) return;
  impl_->wanted[w] = want;
  // Another stream: what the index says is of the old one, from now on
  // (the follower thread starts the new one over).
  if (auto index = impl_->indexes.find(w); index != impl_->indexes.end()) index->second.Reset();
}

void KvFollower::Forget(size_t w) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->wanted.erase(w);
}

std::optional<size_t> KvFollower::Prefix(size_t w, std::span<const kvbus::ChunkKey> keys) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->indexes.find(w);
  if (it == impl_->indexes.end()) return std::nullopt;
  return it->second.Prefix(keys);
}

std::optional<KvFollower::Followed> KvFollower::Status(size_t w) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->indexes.find(w);
  if (it == impl_->indexes.end()) return std::nullopt;
  return Followed{it->second.synced(), it->second.blocks(), it->second.next()};
}

KvFollowerStats KvFollower::Stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

std::string ReachableEndpoint(const std::string& bound, const std::string& peer) {
  const std::string scheme = "tcp://";
  if (!bound.starts_with(scheme) || !peer.starts_with(scheme)) return bound;
  const size_t colon = bound.rfind(':');
  if (colon == std::string::npos || colon < scheme.size()) return bound;
  const std::string host = bound.substr(scheme.size(), colon - scheme.size());
  if (host != "*" && host != "0.0.0.0" && host != "[::]" && host != "::") return bound;
  const size_t peer_colon = peer.rfind(':');
  if (peer_colon == std::string::npos || peer_colon < scheme.size()) return bound;
  return scheme + peer.substr(scheme.size(), peer_colon - scheme.size()) + bound.substr(colon);
}

}  // namespace kdn::router
