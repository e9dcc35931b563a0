#pragma once
// KV events: what a worker's host memory holds, as a stream any router can
// follow, in vLLM's KV-events wire format (docs/serving.md, "KV events").
//
// - KvEvent and EncodeKvEventBatch: one batch of events as vLLM's
//   ZmqEventPublisher sends its KVEventBatch in msgpack
//   (vllm/distributed/kv_events.py, vLLM 0.32): the batch an array [ts,
//   events, data_parallel_rank 0]; each event a map tagged by "type"
//   (BlockStored, BlockRemoved, AllBlocksCleared) with vLLM's field names.
//   A block is one of kdn's full prefix chunks: its hash an int, as vLLM's
//   default (BlockHash: the first 64 bits of kdn's chunk key, which is
//   content-addressed and chained over its parent), its token ids those of
//   the chunk, its block size the chunk's tokens; a field of kdn's own,
//   kdn_chunk_keys, carries the whole 16-byte keys.
// - KvEventPublisher: sends batches on a ZeroMQ PUB socket as vLLM does
//   (frames: topic, 8-byte big-endian sequence number, payload) and keeps
//   the last ones for a replay ROUTER socket (a request's 8-byte start
//   sequence number, answered with every kept batch from it, then an
//   end marker of sequence -1).
// - HostTierEvents: follows a HostTier and publishes the full prefix chunks
//   it gains (BlockStored, with their tokens and parent) and loses
//   (BlockRemoved), medium "CPU"; and, told of them (WroteShared), those
//   the worker wrote to its shared tier, medium "STORAGE" (stored only: the
//   shared tier's evictions are not its writers' to see). Tail pieces and
//   documents' segment keys are not prefix blocks and are not announced.
//
// Thread-safe: Publish and Describe may be called from any thread.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kdn/common/mutex.h"
#include "kdn/common/status.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/key.h"

namespace kdn::kvbus {

// Where the blocks of an event are kept (vLLM's `medium`).
enum class KvMedium { kGpu, kCpu, kStorage };
std::string_view MediumName(KvMedium m);  // "GPU", "CPU", "STORAGE"

struct KvEvent {
  enum class Kind { kStored, kRemoved, kCleared };
  Kind kind = Kind::kStored;
  std::vector<ChunkKey> keys;      // the blocks, in prefix order
  std::optional<ChunkKey> parent;  // kStored: the block before the first (none: it starts a prompt)
  std::vector<int32_t> tokens;     // kStored: block_size tokens per block, in order
  int block_size = 0;              // kStored
  KvMedium medium = KvMedium::kCpu;
};

// The block hash an event gives `key`: its first 64 bits (ChunkKey::hi).
uint64_t BlockHash(const ChunkKey& key);

// The msgpack bytes of vLLM's KVEventBatch(ts, events): `ts` in seconds
// since the Unix epoch.
std::string EncodeKvEventBatch(double ts, std::span<const KvEvent> events);

// Events a publisher holds for its thread at most; past them, and after
// its thread stopped on an error, Publish drops events (counted).
inline constexpr size_t kMaxQueuedEvents = 100000;

struct KvEventsOptions {
  // The PUB socket's endpoint, bound (e.g. tcp://127.0.0.1:5557;
  // tcp://127.0.0.1:0 takes a free port). Plaintext, as vLLM's: bind it
  // where only the deployment's routers reach.
  std::string endpoint;
  // The replay ROUTER socket's endpoint, bound; empty: no replay.
  std::string replay_endpoint;
  // The first frame of every message (vLLM's default: empty).
  std::string topic;
  // Batches kept for replay.
  size_t replay_batches = 10000;
  // How long events wait to go out together in one batch.
  std::chrono::milliseconds batch_window{10};
};

struct KvEventsStats {
  uint64_t batches = 0;  // sent; the next batch's sequence number
  uint64_t events = 0;
  uint64_t replays = 0;  // replay requests answered
  uint64_t dropped = 0;  // events Publish dropped (kMaxQueuedEvents, or a stopped stream)
};

class KvEventPublisher {
 public:
  // Binds the sockets and starts the publishing thread. INVALID_ARGUMENT
  // for an empty endpoint; UNAVAILABLE when a socket cannot bind. The first
  // batch (sequence 0) is an AllBlocksCleared: a consumer that follows a
  // restarted worker starts over.
  static Result<std::unique_ptr<KvEventPublisher>> Start(const KvEventsOptions& options);
  ~KvEventPublisher();
  KvEventPublisher(const KvEventPublisher&) = delete;
  KvEventPublisher& operator=(const KvEventPublisher&) = delete;

  // Queues `event` for the next batch. Quick: it never waits on a socket.
  // Dropped (KvEventsStats::dropped) when kMaxQueuedEvents wait already or
  // the stream stopped on a socket error (logged).
  void Publish(KvEvent event);
  // The bound endpoints (a port of 0 resolved).
  const std::string& endpoint() const;
  const std::string& replay_endpoint() const;
  KvEventsStats Stats() const;

  struct Impl;

 private:
  explicit KvEventPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class HostTierEvents {
 public:
  using Publish = std::function<void(KvEvent)>;
  // Follows `host` from now on (its change listener): `publish` is called
  // under the tier's lock, so it must be quick and must not call the tier
  // (KvEventPublisher::Publish is). Keeps the tokens of up to
  // `max_described` chunks described and not yet stored.
  HostTierEvents(HostTier& host, int chunk_tokens, Publish publish, size_t max_described = 4096);
  // Stops following the tier.
  ~HostTierEvents();
  HostTierEvents(const HostTierEvents&) = delete;
  HostTierEvents& operator=(const HostTierEvents&) = delete;

  // The full prefix chunks of `tokens` (`keys`: PrefixKeys of them) that
  // the tier may gain: when it does, its event carries the chunk's tokens
  // and parent. A chunk stored that was never described is not announced.
  void Describe(std::span<const int32_t> tokens, std::span<const ChunkKey> keys);
  // The chunk under `key` was written to the worker's shared tier: a
  // described full prefix chunk is announced as stored there (medium
  // STORAGE), once per key among the last kMaxSharedAnnounced. The shared
  // tier evicts on its own, unseen by its writers: no BlockRemoved follows.
  static constexpr size_t kMaxSharedAnnounced = 65536;
  void WroteShared(const ChunkKey& key);
  // Chunks announced and not yet removed.
  size_t announced() const;

 private:
  struct Described {
    std::optional<ChunkKey> parent;
    std::vector<int32_t> tokens;
    std::list<ChunkKey>::iterator age;
  };
  void OnChange(const ChunkKey& key, bool held);
  // BlockStored of a described chunk, kept in `medium`.
  KvEvent StoredEvent(const ChunkKey& key, const Described& d, KvMedium medium) const;

  HostTier& host_;
  const int chunk_tokens_;
  const Publish publish_;
  const size_t max_described_;
  mutable Mutex mu_;
  std::unordered_map<ChunkKey, Described, ChunkKeyHash> described_ KDN_GUARDED_BY(mu_);
  std::list<ChunkKey> ages_ KDN_GUARDED_BY(mu_);  // described_, newest first
  std::unordered_set<ChunkKey, ChunkKeyHash> announced_ KDN_GUARDED_BY(mu_);
  std::unordered_set<ChunkKey, ChunkKeyHash> shared_ KDN_GUARDED_BY(mu_);  // WroteShared's
  std::list<ChunkKey> shared_ages_ KDN_GUARDED_BY(mu_);                    // shared_, newest first
};

}  // namespace kdn::kvbus
