#pragma once
// ChunkStore: one place KV chunks are kept (a tier: host memory, disk, a
// remote kdn-store, a Redis Cluster), and the counters every tier reports.
//
// Implementations are thread-safe: workers' threads and a kdn-store's server
// loop call into one store concurrently.

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/key.h"

namespace kdn::kvbus {

struct TierStats {
  uint64_t chunks = 0;          // held now
  uint64_t bytes = 0;           // held now (serialized size)
  uint64_t capacity_bytes = 0;  // 0: unbounded
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t puts = 0;
  uint64_t evictions = 0;
  uint64_t corrupt = 0;  // chunks found damaged, dropped and never served
  // Requests a remote tier could not get answered (down, timed out, failing
  // over): each a miss for a read, a dropped chunk for a put. 0 for local
  // tiers.
  uint64_t unreachable = 0;
};

// A keep's lease as the wire carries it (KeepRequest, StoreKeep: unsigned
// milliseconds), capped at a year: past that it means "until let go", and
// no lease overflows the conversion.
inline std::chrono::milliseconds KeepLeaseFromWire(uint64_t lease_ms) {
  constexpr uint64_t kYearMs = uint64_t{365} * 86400000;
  return std::chrono::milliseconds(static_cast<int64_t>(lease_ms < kYearMs ? lease_ms : kYearMs));
}

class ChunkStore {
 public:
  virtual ~ChunkStore() = default;
  virtual std::string name() const = 0;  // "host", "disk", "remote tcp://..."
  // The chunk, or NOT_FOUND on a miss (a damaged chunk is a miss too).
  // UNAVAILABLE when a remote store cannot be reached.
  virtual Result<std::shared_ptr<const Chunk>> Get(const ChunkKey& key) = 0;
  // Whether the store holds `key`, without reading it or counting a hit.
  virtual bool Contains(const ChunkKey& key) = 0;
  // Contains for each key, in order: one round trip for a remote tier
  // (by default, Contains key by key). A key a remote tier could not be
  // asked about is not held.
  virtual std::vector<bool> ContainsMany(std::span<const ChunkKey> keys) {
    std::vector<bool> held(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) held[i] = Contains(keys[i]);
    return held;
  }
  // Stores a chunk (a key already held is kept as it is: chunks are immutable
  // and content-addressed). RESOURCE_EXHAUSTED when it cannot be made to fit.
  virtual Status Put(std::shared_ptr<const Chunk> chunk) = 0;
  virtual TierStats Stats() = 0;
  // What this process counted itself, without a round trip: a remote tier's
  // client-side figures (its `unreachable` and `corrupt` above all); a local
  // tier's Stats(). Cheap enough for every worker status reply.
  virtual TierStats LocalStats() { return Stats(); }

  // Keeps the chunks under `keys` from eviction for `lease` from now,
  // whether held yet or not: a chunk put later under a kept key is kept from
  // its arrival (a prompt prefix pinned before its KV is computed;
  // docs/serving.md, "Pinning a prefix"). A key kept again keeps the later
  // of its two deadlines; a zero lease lets the keys go now. Returns how
  // many keys this store keeps: 0 for a tier that cannot keep (the
  // default: a disk tier, Redis, whose own eviction policy rules).
  // INVALID_ARGUMENT for a negative lease; RESOURCE_EXHAUSTED when a tier's
  // bound on kept keys would be passed (nothing is kept then).
  virtual Result<size_t> Keep(std::span<const ChunkKey> keys, std::chrono::milliseconds lease) {
    (void)keys;
    (void)lease;
    return size_t{0};
  }
};

}  // namespace kdn::kvbus
