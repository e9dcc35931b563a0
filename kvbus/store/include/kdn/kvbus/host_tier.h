#pragma once
// HostTier: KV chunks kept in host memory, bounded in bytes, evicted LRU.
//
// A chunk being read or sent is pinned so that eviction cannot take it; every
// pin carries a lease, and a pin whose lease has run out is dropped, so a
// holder that crashes or forgets to unpin leaks nothing (docs/design.md,
// "Tiers"). Leases are checked lazily at the start of every call and by
// ExpirePins(); time comes from an injectable clock so tests need no sleeps.
// A key may also be kept (Keep: a pinned prompt prefix), held yet or not: its
// chunk is pinned while the keep lasts, from whenever it arrives.
//
// Evicted chunks are handed to an optional eviction handler (a TieredStore
// uses it to demote them to the next tier). Until the handler returns, a
// chunk being demoted still answers Get and Contains, so a reader racing with
// the demotion finds the chunk in one tier or the other, never in neither.
//
// Thread-safe: one mutex guards all state; the eviction handler runs outside
// it, on the thread of the call that evicted.

#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kdn/common/mutex.h"
#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/key.h"

namespace kdn::kvbus {

class HostTier : public ChunkStore {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  using Clock = std::function<TimePoint()>;
  // Receives each evicted chunk. Must not throw. It may call back into this
  // tier (no lock is held while it runs).
  using EvictionHandler = std::function<void(std::shared_ptr<const Chunk>)>;

  // `capacity_bytes` bounds the sum of the chunks' serialized sizes; 0 means
  // unbounded. `clock` defaults to std::chrono::steady_clock::now.
  explicit HostTier(uint64_t capacity_bytes, Clock clock = nullptr);
  ~HostTier() override = default;

  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  std::string name() const override { return "host"; }

  // A hit refreshes the chunk's recency. NOT_FOUND on a miss.
  Result<std::shared_ptr<const Chunk>> Get(const ChunkKey& key) override;
  bool Contains(const ChunkKey& key) override;
  // Stores `chunk`, evicting the least recently used unpinned chunks to make
  // room. A key already held is kept as it is and becomes most recent.
  // RESOURCE_EXHAUSTED, with nothing changed, when the chunk is larger than
  // the capacity or when the pinned chunks leave too little room for it.
  // INVALID_ARGUMENT for a null chunk.
  Status Put(std::shared_ptr<const Chunk> chunk) override;
  // `puts` counts chunks newly stored; `corrupt` is always 0 (memory is not
  // re-verified).
  TierStats Stats() override;

  // Pins the chunk under `key` for `lease` and returns the pin's id (never 0,
  // never reused). A chunk may carry several pins; it is evictable again when
  // all of them are unpinned or expired. Refreshes the chunk's recency.
  // NOT_FOUND if the chunk is not held (or is being evicted);
  // INVALID_ARGUMENT if `lease` is not positive.
  Result<uint64_t> Pin(const ChunkKey& key, std::chrono::milliseconds lease);
  // Sets the pin's lease to run out `lease` from now (not added to what is
  // left). NOT_FOUND if the pin is unknown or already expired;
  // INVALID_ARGUMENT if `lease` is not positive.
  Status Renew(uint64_t pin, std::chrono::milliseconds lease);
  // Drops the pin. NOT_FOUND if it is unknown or already expired.
  Status Unpin(uint64_t pin);
  // Drops every pin whose lease has run out (deadline <= now); returns how
  // many. Every other call does the same first, so calling this is only
  // needed to release memory-holding pins on an otherwise idle tier.
  size_t ExpirePins();
  // Live pins now (after expiring lapsed ones).
  size_t PinCount();

  // ChunkStore::Keep. A kept chunk counts as pinned (it is never evicted
  // and its bytes leave less room for others) until its deadline passes.
  // At most kMaxKeptKeys keys are kept at once.
  static constexpr size_t kMaxKeptKeys = size_t{1} << 20;
  Result<size_t> Keep(std::span<const ChunkKey> keys, std::chrono::milliseconds lease) override;
  // Keys kept now (held or not), after expiring lapsed ones.
  size_t KeptCount();

  // Drops the chunk under `key` now, without handing it to the eviction
  // handler (its holder knows it is needed no more, e.g. a request's staged
  // KV once assembled). False if it is not held or is pinned (it stays).
  bool Erase(const ChunkKey& key);

  // Replaces the eviction handler (nullptr: evicted chunks are just
  // dropped). Takes effect for evictions that start after it returns.
  void SetEvictionHandler(EvictionHandler handler);

  // Receives each key the tier gains (held: a chunk newly put, or promoted
  // into it) and loses (not held: evicted or erased), in the order the
  // tier's state changed. It runs under the tier's lock: it must be quick
  // and must not call this tier. nullptr: none.
  using ChangeListener = std::function<void(const ChunkKey& key, bool held)>;
  void SetChangeListener(ChangeListener listener);

 private:
  struct Entry {
    std::shared_ptr<const Chunk> chunk;
    std::list<ChunkKey>::iterator lru;  // position in lru_
    int pins = 0;                       // pin records, and one more while its key is kept
    bool kept = false;                  // its key is in keeps_
  };
  struct PinRecord {
    ChunkKey key;
    TimePoint deadline;
  };
  struct Demoting {
    std::shared_ptr<const Chunk> chunk;
    int count = 0;  // evictions of this key whose handler has not returned
  };

  TimePoint Now() const { return clock_(); }
  static TimePoint DeadlineAfter(TimePoint now, std::chrono::milliseconds lease);
  // Drops lapsed pins and keeps; returns how many pins.
  size_t ExpireLocked(TimePoint now) KDN_REQUIRES(mu_);
  // Holds (kept) or lets go (!kept) an entry for its key's keep.
  void SetKeptLocked(Entry& e, bool kept) KDN_REQUIRES(mu_);
  void UnkeepLocked(ChunkKey key) KDN_REQUIRES(mu_);  // by value: callers pass keys it erases
  // One hold more (a pin, or its key kept) or less on an entry: an entry
  // with any is pinned, its bytes in pinned_bytes_.
  void HoldLocked(Entry& e) KDN_REQUIRES(mu_);
  void UnholdLocked(Entry& e) KDN_REQUIRES(mu_);
  // Removes one pin's hold on its entry.
  void ReleaseLocked(const PinRecord& pin) KDN_REQUIRES(mu_);
  void TouchLocked(Entry& e) KDN_REQUIRES(mu_);
  // Hands `evicted` to `handler` one at a time, then forgets them as
  // demoting. Must be called without mu_.
  void Demote(const EvictionHandler& handler, std::vector<std::shared_ptr<const Chunk>> evicted)
      KDN_EXCLUDES(mu_);

  // Constant after construction.
  const uint64_t capacity_;
  const Clock clock_;

  Mutex mu_;
  std::unordered_map<ChunkKey, Entry, ChunkKeyHash> index_ KDN_GUARDED_BY(mu_);
  std::list<ChunkKey> lru_ KDN_GUARDED_BY(mu_);  // most recently used first
  std::unordered_map<uint64_t, PinRecord> pins_ KDN_GUARDED_BY(mu_);
  std::set<std::pair<TimePoint, uint64_t>> deadlines_ KDN_GUARDED_BY(mu_);  // (deadline, pin id)
  std::unordered_map<ChunkKey, Demoting, ChunkKeyHash> demoting_ KDN_GUARDED_BY(mu_);
  std::unordered_map<ChunkKey, TimePoint, ChunkKeyHash> keeps_ KDN_GUARDED_BY(mu_);
  std::set<std::pair<TimePoint, ChunkKey>> keep_deadlines_ KDN_GUARDED_BY(mu_);
  EvictionHandler handler_ KDN_GUARDED_BY(mu_);
  ChangeListener listener_ KDN_GUARDED_BY(mu_);
  uint64_t next_pin_ KDN_GUARDED_BY(mu_) = 1;
  uint64_t bytes_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t pinned_bytes_ KDN_GUARDED_BY(mu_) = 0;  // bytes of entries with pins > 0
  uint64_t hits_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t misses_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t puts_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t evictions_ KDN_GUARDED_BY(mu_) = 0;
};

}  // namespace kdn::kvbus
