#include "kdn/kvbus/kv_events.h"

#include <zmq.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <bit>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "kdn/common/log.h"

namespace kdn::kvbus {

std::string_view MediumName(KvMedium m) {
  switch (m) {
    case KvMedium::kGpu: return "GPU";
    case KvMedium::kCpu: return "CPU";
    case KvMedium::kStorage: return "STORAGE";
  }
  return "CPU";
}

namespace {

// The msgpack forms these events use (github.com/msgpack/msgpack spec.md),
// each in its shortest encoding, as msgpack's own encoders write them.
class Msgpack {
 public:
  std::string& out() { return out_; }

  void Nil() { out_.push_back(static_cast<char>(0xc0)); }
  void Int(int64_t v) {
    if (v >= 0) return Uint(static_cast<uint64_t>(v));
    if (v >= -32) return Byte(static_cast<uint8_t>(v));  // negative fixint
    if (v >= INT8_MIN) return Head(0xd0, static_cast<uint8_t>(v), 1);
    if (v >= INT16_MIN) return Head(0xd1, static_cast<uint16_t>(v), 2);
    if (v >= INT32_MIN) return Head(0xd2, static_cast<uint32_t>(v), 4);
    Head(0xd3, static_cast<uint64_t>(v), 8);
  }
  void Uint(uint64_t v) {
    if (v < 0x80) return Byte(static_cast<uint8_t>(v));  // positive fixint
    if (v <= UINT8_MAX) return Head(0xcc, v, 1);
    if (v <= UINT16_MAX) return Head(0xcd, v, 2);
    if (v <= UINT32_MAX) return Head(0xce, v, 4);
    Head(0xcf, v, 8);
  }
  void Float64(double v) { Head(0xcb, std::bit_cast<uint64_t>(v), 8); }
  void Str(std::string_view s) {
    if (s.size() < 32) {
      Byte(static_cast<uint8_t>(0xa0 | s.size()));
    } else if (s.size() <= UINT8_MAX) {
      Head(0xd9, s.size(), 1);
    } else if (s.size() <= UINT16_MAX) {
      Head(0xda, s.size(), 2);
    } else {
      Head(0xdb, s.size(), 4);
    }
    out_.append(s);
  }
  void Bin(const uint8_t* data, size_t n) {
    if (n <= UINT8_MAX) {
      Head(0xc4, n, 1);
    } else if (n <= UINT16_MAX) {
      Head(0xc5, n, 2);
    } else {
      Head(0xc6, n, 4);
    }
    out_.append(reinterpret_cast<const char*>(data), n);
  }
  void Array(size_t n) { Container(0x90, 0xdc, n); }
  void Map(size_t n) { Container(0x80, 0xde, n); }

  // A block hash as vLLM sends it by default (an int,
  // VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): the chunk key's first 64 bits.
  void Key(const ChunkKey& k) { Uint(BlockHash(k)); }
  // kdn's own key, whole: its 16 bytes.
  void FullKey(const ChunkKey& k) {
    uint8_t b[16];
    k.ToBytes(b);
    Bin(b, sizeof(b));
  }

 private:
  void Byte(uint8_t b) { out_.push_back(static_cast<char>(b)); }
  // A type byte, then `bytes` bytes of `v`, big-endian.
  void Head(uint8_t type, uint64_t v, int bytes) {
    Byte(type);
    for (int i = bytes - 1; i >= 0; --i) Byte(static_cast<uint8_t>(v >> (8 * i)));
  }
  // fixarray/fixmap below 16 entries, else the 16- or 32-bit form.
  void Container(uint8_t fix, uint8_t head16, size_t n) {
    if (n < 16) return Byte(static_cast<uint8_t>(fix | n));
    if (n <= UINT16_MAX) return Head(head16, n, 2);
    Head(static_cast<uint8_t>(head16 + 1), n, 4);
  }

  std::string out_;
};

// The blocks' hashes (vLLM's block_hashes).
void BlockHashes(Msgpack& m, const KvEvent& e) {
  m.Str("block_hashes");
  m.Array(e.keys.size());
  for (const ChunkKey& k : e.keys) m.Key(k);
}

// The blocks' whole chunk keys, a field of kdn's own (vLLM's decoders skip
// fields their classes do not have).
void ChunkKeys(Msgpack& m, const KvEvent& e) {
  m.Str("kdn_chunk_keys");
  m.Array(e.keys.size());
  for (const ChunkKey& k : e.keys) m.FullKey(k);
}

// One event as a map tagged by its class name, with the fields of vLLM's
// classes that have no default (those with defaults, left at them, are
// omitted there too: omit_defaults), then kdn_chunk_keys.
void EncodeEvent(Msgpack& m, const KvEvent& e) {
  switch (e.kind) {
    case KvEvent::Kind::kStored:
      m.Map(9);
      m.Str("type");
      m.Str("BlockStored");
      BlockHashes(m, e);
      m.Str("parent_block_hash");
      if (e.parent) {
        m.Key(*e.parent);
      } else {
        m.Nil();
      }
      m.Str("token_ids");
      m.Array(e.tokens.size());
      for (int32_t t : e.tokens) m.Int(t);
      m.Str("block_size");
      m.Int(e.block_size);
      m.Str("lora_id");
      m.Nil();
      m.Str("medium");
      m.Str(MediumName(e.medium));
      m.Str("lora_name");
      m.Nil();
      ChunkKeys(m, e);
      return;
    case KvEvent::Kind::kRemoved:
      m.Map(4);
      m.Str("type");
      m.Str("BlockRemoved");
      BlockHashes(m, e);
      m.Str("medium");
      m.Str(MediumName(e.medium));
      ChunkKeys(m, e);
      return;
    case KvEvent::Kind::kCleared:
      m.Map(1);
      m.Str("type");
      m.Str("AllBlocksCleared");
      return;
  }
}

std::string SequenceBytes(int64_t seq) {
  std::string b(8, '\0');
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(static_cast<uint64_t>(seq) >> (56 - 8 * i));
  return b;
}

}  // namespace

uint64_t BlockHash(const ChunkKey& key) { return key.hi; }

std::string EncodeKvEventBatch(double ts, std::span<const KvEvent> events) {
  // An array-like struct: [ts, events, data_parallel_rank], the rank 0 as
  // vLLM's ZmqEventPublisher fills it in.
  Msgpack m;
  m.Array(3);
  m.Float64(ts);
  m.Array(events.size());
  for (const KvEvent& e : events) EncodeEvent(m, e);
  m.Uint(0);
  return std::move(m.out());
}

struct KvEventPublisher::Impl {
  KvEventsOptions options;
  std::string endpoint, replay_endpoint;
  zmq::context_t ctx{1};
  zmq::socket_t pub{ctx, zmq::socket_type::pub};
  std::optional<zmq::socket_t> replay;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<KvEvent> queued;  // guarded by mu
  bool stop = false;            // guarded by mu
  bool failed = false;          // guarded by mu: the thread stopped on an error
  uint64_t dropped = 0;         // guarded by mu

  // The publishing thread's alone.
  std::deque<std::pair<int64_t, std::string>> kept;  // (sequence, payload), oldest first
  int64_t next_seq = 0;

  std::atomic<uint64_t> batches{0}, events{0}, replays{0};
  std::thread thread;

  // One frame, sent again when a signal interrupted it (nothing of it was
  // queued then).
  static void SendFrame(zmq::socket_t& s, zmq::const_buffer b, zmq::send_flags flags) {
    for (;;) {
      try {
        s.send(b, flags);
        return;
      } catch (const zmq::error_t& e) {
        if (e.num() != EINTR) throw;
      }
    }
  }

  void Send(std::vector<KvEvent> batch) {
    const double ts =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    std::string payload = EncodeKvEventBatch(ts, batch);
    const int64_t seq = next_seq++;
    SendFrame(pub, zmq::buffer(options.topic), zmq::send_flags::sndmore);
    SendFrame(pub, zmq::buffer(SequenceBytes(seq)), zmq::send_flags::sndmore);
    SendFrame(pub, zmq::buffer(payload), zmq::send_flags::none);
    if (options.replay_batches > 0) {
      kept.emplace_back(seq, std::move(payload));
      if (kept.size() > options.replay_batches) kept.pop_front();
    }
    events += batch.size();
    ++batches;
  }

  // A request is [client, "", start sequence (8 bytes, big-endian)]; the
  // answer every kept batch from it as [client, "", topic, seq, payload],
  // then [client, "", "", -1, ""]. A malformed request gets the end alone.
  void AnswerReplay() {
    std::vector<zmq::message_t> frames;
    for (;;) {
      zmq::message_t f;
      try {
        if (!replay->recv(f, zmq::recv_flags::dontwait)) return;
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR) continue;
        throw;
      }
      const bool more = f.more();
      frames.push_back(std::move(f));
      if (!more) break;
    }
    if (frames.size() < 2) return;
    const std::string client = frames[0].to_string();
    // Unsigned, as vLLM reads it.
    uint64_t start = UINT64_MAX;
    if (frames.size() == 3 && frames[2].size() == 8) {
      start = 0;
      for (size_t i = 0; i < 8; ++i) start = (start << 8) | frames[2].data<uint8_t>()[i];
    }
    const auto send = [&](std::string_view topic, int64_t seq, std::string_view payload) {
      SendFrame(*replay, zmq::buffer(client), zmq::send_flags::sndmore);
      SendFrame(*replay, zmq::buffer(std::string_view()), zmq::send_flags::sndmore);
      SendFrame(*replay, zmq::buffer(topic), zmq::send_flags::sndmore);
      SendFrame(*replay, zmq::buffer(SequenceBytes(seq)), zmq::send_flags::sndmore);
      SendFrame(*replay, zmq::buffer(payload), zmq::send_flags::none);
    };
    for (const auto& [seq, payload] : kept) {
      if (static_cast<uint64_t>(seq) >= start) send(options.topic, seq, payload);
    }
    ++replays;  // counted before the end goes out, for whoever it tells
    send("", -1, "");
  }

  void Loop() {
    for (;;) {
      std::vector<KvEvent> batch;
      bool stopping = false;
      {
        std::unique_lock<std::mutex> lock(mu);
        // Without replay the thread sleeps until events come; with it, it
        // also looks for requests every 50 ms at most.
        const auto wake = [&] { return stop || !queued.empty(); };
        if (replay) {
          cv.wait_for(lock,
                      std::max<std::chrono::milliseconds>(options.batch_window,
                                                          std::chrono::milliseconds(50)),
                      wake);
        } else {
          cv.wait(lock, wake);
        }
        if (!queued.empty() && !stop) {
          // Let the rest of this batch's events come.
          lock.unlock();
          std::this_thread::sleep_for(options.batch_window);
          lock.lock();
        }
        batch.swap(queued);
        stopping = stop;
      }
      try {
        if (!batch.empty()) Send(std::move(batch));
        if (replay) AnswerReplay();
      } catch (const std::exception& e) {
        // Not expected (a socket bound and working fails): the stream ends
        // here, said once, and Publish drops what comes after.
        LogError("KV events on {}: the stream stops: {}", endpoint, e.what());
        std::lock_guard<std::mutex> lock(mu);
        failed = true;
        queued.clear();
        return;
      }
      if (stopping) return;
    }
  }
};

KvEventPublisher::KvEventPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<KvEventPublisher>> KvEventPublisher::Start(const KvEventsOptions& options) {
  if (options.endpoint.empty()) return InvalidArgument("KV events: no endpoint to publish on");
  if (options.batch_window.count() <= 0) {
    return InvalidArgument("KV events: the batch window must be positive");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  try {
    impl->pub.set(zmq::sockopt::linger, 0);
    impl->pub.set(zmq::sockopt::sndhwm, 100000);
    impl->pub.bind(options.endpoint);
    impl->endpoint = impl->pub.get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    return Unavailable("KV events: cannot publish on " + options.endpoint + ": " + e.what());
  }
  if (!options.replay_endpoint.empty()) {
    try {
      impl->replay.emplace(impl->ctx, zmq::socket_type::router);
      impl->replay->set(zmq::sockopt::linger, 0);
      impl->replay->set(zmq::sockopt::router_mandatory, 0);
      // A replay of every kept batch goes out at once: none of it, the end
      // marker included, may be dropped at a high-water mark.
      impl->replay->set(zmq::sockopt::sndhwm, 0);
      impl->replay->bind(options.replay_endpoint);
      impl->replay_endpoint = impl->replay->get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return Unavailable("KV events: cannot answer replays on " + options.replay_endpoint + ": " +
                         e.what());
    }
  }
  impl->queued.push_back({.kind = KvEvent::Kind::kCleared});
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<KvEventPublisher>(new KvEventPublisher(std::move(impl)));
}

KvEventPublisher::~KvEventPublisher() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_one();
  impl_->thread.join();
}

void KvEventPublisher::Publish(KvEvent event) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    // A stream that stopped, or a thread that cannot keep up: dropped, and
    // counted, rather than held without bound.
    if (impl_->failed || impl_->queued.size() >= kMaxQueuedEvents) {
      ++impl_->dropped;
      return;
    }
    impl_->queued.push_back(std::move(event));
  }
  impl_->cv.notify_one();
}

const std::string& KvEventPublisher::endpoint() const { return impl_->endpoint; }
const std::string& KvEventPublisher::replay_endpoint() const { return impl_->replay_endpoint; }

KvEventsStats KvEventPublisher::Stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return {impl_->batches.load(), impl_->events.load(), impl_->replays.load(), impl_->dropped};
}

HostTierEvents::HostTierEvents(HostTier& host, int chunk_tokens, Publish publish,
                               size_t max_described)
    : host_(host),
      chunk_tokens_(chunk_tokens),
      publish_(std::move(publish)),
      max_described_(max_described) {
  host_.SetChangeListener([this](const ChunkKey& key, bool held) { OnChange(key, held); });
}

HostTierEvents::~HostTierEvents() { host_.SetChangeListener(nullptr); }

void HostTierEvents::Describe(std::span<const int32_t> tokens, std::span<const ChunkKey> keys) {
  MutexLock lock(mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    const size_t first = i * static_cast<size_t>(chunk_tokens_);
    if (first + chunk_tokens_ > tokens.size()) break;
    auto it = described_.find(keys[i]);
    if (it != described_.end()) {
      ages_.splice(ages_.begin(), ages_, it->second.age);
      continue;
    }
    ages_.push_front(keys[i]);
    Described d{
        i == 0 ? std::nullopt : std::optional<ChunkKey>(keys[i - 1]),
        std::vector<int32_t>(tokens.begin() + first, tokens.begin() + first + chunk_tokens_),
        ages_.begin()};
    described_.emplace(keys[i], std::move(d));
    while (described_.size() > max_described_) {
      described_.erase(ages_.back());
      ages_.pop_back();
    }
  }
}

KvEvent HostTierEvents::StoredEvent(const ChunkKey& key, const Described& d,
                                    KvMedium medium) const {
  return {.kind = KvEvent::Kind::kStored,
          .keys = {key},
          .parent = d.parent,
          .tokens = d.tokens,
          .block_size = chunk_tokens_,
          .medium = medium};
}

void HostTierEvents::WroteShared(const ChunkKey& key) {
  MutexLock lock(mu_);
  auto it = described_.find(key);
  if (it == described_.end() || !shared_.insert(key).second) return;
  shared_ages_.push_front(key);
  while (shared_ages_.size() > kMaxSharedAnnounced) {
    shared_.erase(shared_ages_.back());
    shared_ages_.pop_back();
  }
  publish_(StoredEvent(key, it->second, KvMedium::kStorage));
}

size_t HostTierEvents::announced() const {
  MutexLock lock(mu_);
  return announced_.size();
}

void HostTierEvents::OnChange(const ChunkKey& key, bool held) {
  MutexLock lock(mu_);
  if (!held) {
    if (announced_.erase(key) != 0) {
      publish_({.kind = KvEvent::Kind::kRemoved, .keys = {key}, .medium = KvMedium::kCpu});
    }
    return;
  }
  auto it = described_.find(key);
  if (it == described_.end() || !announced_.insert(key).second) return;
  publish_(StoredEvent(key, it->second, KvMedium::kCpu));
}

}  // namespace kdn::kvbus
