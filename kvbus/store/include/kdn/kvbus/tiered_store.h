#pragma once
// TieredStore: one ChunkStore over an ordered list of tiers, fastest first
// (host memory, then disk, then a remote kdn-store; docs/design.md, "Tiers").
//
// - Get looks in each tier in order; a hit in a slower tier is promoted
//   (copied) into every faster tier.
// - Put stores into the first tier; with `write_through`, into every tier.
// - When the first tier is a HostTier and a second tier exists, chunks the
//   host evicts are demoted into the second tier unless it already holds
//   them. HostTier keeps a chunk visible while it is being demoted, so a
//   reader never finds it in neither tier.
// - LongestPrefix and ContainsMany answer "what is cached" without reading
//   chunks (prefix-cache and segment lookups), one batch per tier: a remote
//   tier is asked once, about the keys the faster tiers lack.
//
// Thread-safe: the list of tiers is fixed at construction and every tier is
// thread-safe; the store adds only atomic counters.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/disk_tier.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/key.h"

namespace kdn::kvbus {

struct TieredStoreOptions {
  // Put stores into every tier, not just the first, so a chunk survives a
  // restart (disk) or is shared with other workers (remote) at once.
  bool write_through = false;
};

class TieredStore : public ChunkStore {
 public:
  // Takes ownership of `tiers`, fastest first; null entries are skipped.
  // With no tiers, every Get misses and every Put fails FAILED_PRECONDITION.
  explicit TieredStore(std::vector<std::unique_ptr<ChunkStore>> tiers,
                       TieredStoreOptions options = {});
  // Host memory over an optional disk (`disk` may be null).
  TieredStore(std::unique_ptr<HostTier> host, std::unique_ptr<DiskTier> disk,
              TieredStoreOptions options = {});
  // Unhooks the host tier's eviction handler. Callers must have stopped
  // using the store.
  ~TieredStore() override;

  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  std::string name() const override { return "tiered"; }

  // The chunk from the fastest tier holding it, promoted into the faster
  // tiers (best effort: a tier that cannot take it, e.g. because it is all
  // pinned, is skipped). NOT_FOUND when no tier holds it; if a tier failed
  // (UNAVAILABLE, IO_ERROR) and none had the chunk, that tier's Status.
  // Either way the caller recomputes.
  Result<std::shared_ptr<const Chunk>> Get(const ChunkKey& key) override;
  // Whether some tier holds `key` (no tier counts a hit).
  bool Contains(const ChunkKey& key) override;
  // For each key, whether some tier holds it: each tier is asked, in one
  // ContainsMany, about the keys the tiers before it lack. The lookup for
  // segment keys, which do not depend on one another.
  std::vector<bool> ContainsMany(std::span<const ChunkKey> keys) override;
  // Into the first tier; if it has no room (RESOURCE_EXHAUSTED), into the
  // next tier that takes it. With write_through, into every tier. OK when
  // at least one tier stored the chunk; otherwise the first tier's Status.
  Status Put(std::shared_ptr<const Chunk> chunk) override;
  // Tier counters summed (`unreachable` too; a chunk held by two tiers counts twice in
  // `chunks` and `bytes`; `capacity_bytes` is 0 if any tier is unbounded),
  // except `hits` and `misses`, which count this store's Gets: a Get that
  // misses the host and hits the disk is one hit.
  TierStats Stats() override;
  // The tiers' LocalStats summed as Stats() sums theirs (no round trip).
  TierStats LocalStats() override;
  // Every tier that can keeps them; returns the most any tier keeps. A tier
  // that fails (a remote store down) is passed over; the first failure is
  // returned only when no tier kept any.
  Result<size_t> Keep(std::span<const ChunkKey> keys, std::chrono::milliseconds lease) override;

  // How many leading keys some tier holds, stopping at the first key no
  // tier holds: the prefix-cache lookup over PrefixKeys() (ContainsMany).
  size_t LongestPrefix(std::span<const ChunkKey> keys);
  // Each tier's name() and Stats(), fastest first.
  std::vector<std::pair<std::string, TierStats>> TierBreakdown();

  size_t tier_count() const { return tiers_.size(); }
  // Borrowed; valid while the store lives. `i` < tier_count().
  ChunkStore& tier(size_t i) { return *tiers_[i]; }
  // The first tier if it is a HostTier (for pinning), else nullptr.
  HostTier* host() { return host_; }

  // Receives, after each chunk Put or a demotion stored into a tier past
  // the first, that tier's index and the chunk's key (a worker's KV events
  // announce what it wrote to its shared tier). It runs on the thread that
  // stored, outside any lock of this store. nullptr: none. Thread-safe.
  using PutListener = std::function<void(size_t tier, const ChunkKey& key)>;
  void SetPutListener(PutListener listener);

 private:
  void WireDemotion();
  TierStats Sum(TierStats (ChunkStore::*stats)());
  void Demote(std::shared_ptr<const Chunk> chunk);

  // Constant after construction.
  std::vector<std::unique_ptr<ChunkStore>> tiers_;
  const TieredStoreOptions options_;
  HostTier* host_ = nullptr;  // tiers_[0] when it is a HostTier

  void Stored(size_t tier, const ChunkKey& key);

  std::atomic<std::shared_ptr<const PutListener>> put_listener_;
  std::atomic<uint64_t> hits_{0};
  std::atomic<uint64_t> misses_{0};
};

}  // namespace kdn::kvbus
