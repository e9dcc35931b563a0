#pragma once
// The router as a consumer of the workers' KV events (docs/serving.md,
// "Lookups from the event stream"): each worker that publishes them
// (kdn-prefill/kdn-decode --kv-events) is followed on its PUB socket, its
// missed batches fetched from its replay socket, and what its host tier
// holds is kept here as the block hashes its events name. Where a worker's
// stream is followed without a gap from its first batch, the router takes a
// prompt's prefix at that worker from here instead of asking it; any
// router over the same workers builds the same index from the same stream.
//
// - WorkerKvIndex: one worker's index, fed batches in sequence order (pure,
//   no sockets: tests/router/kv_follower_test.cpp).
// - KvFollower: one thread that owns the sockets and feeds the indexes. A
//   worker names each stream it starts (WorkerInfo's kv_events_stream): a
//   restarted worker's new name starts its index over, from the new
//   stream's batch 0, whatever the sequence numbers say.
//
// The stream is vLLM's wire format (kdn/kvbus/kv_events.h): frames (topic,
// 8-byte big-endian sequence number, msgpack KVEventBatch); a block hash an
// int (vLLM's default; kdn's: the chunk key's first 64 bits) or bytes (the
// first 8 of them, big-endian). BlockStored adds blocks, BlockRemoved
// drops them, AllBlocksCleared drops all, whatever their medium.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_set>
#include <vector>

#include "kdn/kvbus/key.h"

namespace kdn::router {

class WorkerKvIndex {
 public:
  enum class Take {
    kApplied,  // the next batch, applied
    kOld,      // a batch applied already: ignored
    kGap,      // batches are missing before it: not applied (replay them)
    kBad,      // not a batch of KV events: not applied; the index is lost
  };
  // Batch `seq` (msgpack `payload`). Batch 0 starts a stream (a worker
  // starting, or restarting: what was held is forgotten) and is always
  // applied; after it, each batch in turn.
  Take Offer(uint64_t seq, std::string_view payload);
  // Forgets everything: unsynced until batch 0 comes again.
  void Reset();

  // Every batch from 0 up to next() - 1 applied, none refused: the index
  // says what the worker holds, as of its last batch.
  bool synced() const { return synced_; }
  uint64_t next() const { return next_; }
  size_t blocks() const { return held_.size(); }
  // How many leading `keys` (a prompt's chained chunk keys) the worker
  // holds; nullopt unless synced.
  std::optional<size_t> Prefix(std::span<const kvbus::ChunkKey> keys) const;

 private:
  bool Apply(std::string_view payload);

  bool synced_ = false;
  uint64_t next_ = 0;
  std::unordered_set<uint64_t> held_;  // block hashes
};

struct KvFollowerStats {
  uint64_t batches = 0;  // applied
  uint64_t replays = 0;  // replay requests sent
  uint64_t refused = 0;  // batches that were not KV events
};

class KvFollower {
 public:
  KvFollower();
  ~KvFollower();
  KvFollower(const KvFollower&) = delete;
  KvFollower& operator=(const KvFollower&) = delete;

  // Follows worker `w`'s stream named `stream` at `endpoint` (its batches
  // missed, at `replay`; empty: none, so the stream is followed only if its
  // first batch arrives live) with `topic`. The same again changes nothing;
  // anything else (another stream: the worker restarted) starts its index
  // over at once. Thread-safe.
  void Follow(size_t w, const std::string& endpoint, const std::string& replay,
              const std::string& topic, const std::string& stream);
  // Stops following worker `w` (its index is dropped).
  void Forget(size_t w);
  // WorkerKvIndex::Prefix of worker `w`; nullopt when it is not followed or
  // its index is not synced. Thread-safe.
  std::optional<size_t> Prefix(size_t w, std::span<const kvbus::ChunkKey> keys) const;
  KvFollowerStats Stats() const;
  // Worker `w`'s index as of now; nullopt when it is not followed.
  struct Followed {
    bool synced = false;
    size_t blocks = 0;
    uint64_t next = 0;  // the batch it waits for
  };
  std::optional<Followed> Status(size_t w) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A bound endpoint as another host reaches it: a wildcard host ("*",
// 0.0.0.0, [::]) becomes the host of `peer` (the worker's control endpoint,
// tcp://HOST:PORT); anything else is kept.
std::string ReachableEndpoint(const std::string& bound, const std::string& peer);

}  // namespace kdn::router
