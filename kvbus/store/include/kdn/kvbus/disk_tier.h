#pragma once
// DiskTier: KV chunks kept as files in one folder, bounded in bytes, evicted
// LRU (docs/design.md, "Tiers").
//
// Layout: <dir>/<first 2 hex digits>/<32 hex digit key>.kvc, each file the
// chunk's serialized bytes (Chunk::bytes()), plus <dir>/LOCK. A chunk is
// written to a temporary name beside its final one, fsync'd, then renamed,
// so a crash leaves either the whole file or a temporary that the next Open
// removes. Open rebuilds the index from the folder (file names and sizes) and
// orders it for eviction by modification time; Get sets a file's
// modification time, so that order survives a restart.
//
// Files are not trusted: Get verifies every file with Chunk::Parse and checks
// that its header's key is the one its name says. A damaged file is a miss:
// it is removed, counted as `corrupt`, and never served.
//
// One DiskTier owns a folder at a time: Open takes an exclusive lock on
// <dir>/LOCK (flock) and fails while another DiskTier, in this process or
// another, holds it.
//
// Thread-safe: one mutex guards the index and counters; file contents are
// read, written and fsync'd outside it, so calls on different chunks overlap.

#include <cstdint>
#include <filesystem>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>

#include "kdn/common/mutex.h"
#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/key.h"

namespace kdn::kvbus {

class DiskTier : public ChunkStore {
 public:
  // Opens (creating it if missing) the folder `dir`; `capacity_bytes` bounds
  // the sum of the chunk files' sizes (0: unbounded). If the folder holds
  // more than that, the least recently modified files are removed. Errors
  // name the path: IO_ERROR when the folder cannot be created or read,
  // FAILED_PRECONDITION when it is not a folder or another DiskTier holds it.
  static Result<std::unique_ptr<DiskTier>> Open(std::filesystem::path dir, uint64_t capacity_bytes);
  ~DiskTier() override;  // releases the folder lock; leaves the files

  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  std::string name() const override { return "disk"; }

  // Reads and verifies the chunk's file; a hit refreshes its recency.
  // NOT_FOUND on a miss, including a missing or damaged file (then dropped
  // from the index). IO_ERROR naming the path when the file exists but
  // cannot be read.
  Result<std::shared_ptr<const Chunk>> Get(const ChunkKey& key) override;
  // Whether the index lists `key`; the file is not read, so a damaged file
  // counts as held until a Get finds it damaged.
  bool Contains(const ChunkKey& key) override;
  // Writes the chunk's file (temporary name, fsync, rename), then evicts the
  // least recently used files until the total fits. A key already held is
  // kept as it is and becomes most recent. RESOURCE_EXHAUSTED when the chunk
  // is larger than the capacity or the disk is full; IO_ERROR otherwise;
  // both name the path. A failed Put leaves no file behind.
  Status Put(std::shared_ptr<const Chunk> chunk) override;
  // `puts` counts chunks newly stored.
  TierStats Stats() override;

  const std::filesystem::path& dir() const { return dir_; }
  // Where the chunk `key` is (or would be) stored.
  std::filesystem::path PathFor(const ChunkKey& key) const;

 private:
  struct Entry {
    uint64_t bytes = 0;
    // Distinguishes this file from a later one under the same key, so a Get
    // that found the file damaged never drops a newer, good one.
    uint64_t generation = 0;
    std::list<ChunkKey>::iterator lru;
  };

  DiskTier(std::filesystem::path dir, uint64_t capacity_bytes, int lock_fd);
  // Scans the folder: indexes chunk files, removes temporaries. Called once
  // by Open before the tier is shared.
  Status Rebuild();
  // Adds an entry as most recent.
  void InsertLocked(const ChunkKey& key, uint64_t bytes) KDN_REQUIRES(mu_);
  // Removes the entry and, if `remove_file`, its file.
  void EraseLocked(const ChunkKey& key, bool remove_file) KDN_REQUIRES(mu_);
  // Evicts least recently used entries, never `keep`, until the total fits.
  void EvictLocked(const ChunkKey* keep) KDN_REQUIRES(mu_);

  // Constant after construction.
  const std::filesystem::path dir_;
  const uint64_t capacity_;
  const int lock_fd_;

  Mutex mu_;
  std::unordered_map<ChunkKey, Entry, ChunkKeyHash> index_ KDN_GUARDED_BY(mu_);
  std::list<ChunkKey> lru_ KDN_GUARDED_BY(mu_);  // most recently used first
  uint64_t bytes_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t next_generation_ KDN_GUARDED_BY(mu_) = 1;
  uint64_t hits_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t misses_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t puts_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t evictions_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t corrupt_ KDN_GUARDED_BY(mu_) = 0;
};

}  // namespace kdn::kvbus
