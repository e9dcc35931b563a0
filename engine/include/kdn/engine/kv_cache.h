#pragma once
// Paged KV cache: a pool of fixed-size blocks (16 tokens) per layer, and the
// sequences that own lists of them.
//
// KvCache is the part every backend shares: the block allocator, the
// sequences' block tables, and access to KV by layer in a host element type
// (Read/Write), whichever memory the blocks live in. A backend subclasses it
// with its storage: CpuKvCache (fp32 host memory) here, the CUDA backend's
// bf16 device pools in engine/cuda. The layout of one layer's pool is, K and
// V apart,
//   [block][slot in block][kv_head][head_dim]
// so one block of one layer is the token-major slice a KV chunk stores
// ([token][kv_head][head_dim]).
//
// Resident KV (docs/engine.md, "Resident KV"): a block can belong to
// several sequences and to the cache's index at once; it carries a reference
// count. The index names the KV of a sequence's first `end` tokens by a
// content key (kvbus::ChunkKey's 128 bits: a prefix chunk's or a tail
// piece's key), holding a reference on every block under [0, end). A
// sequence never writes into a block it shares: Reserve first copies a
// shared, partly filled last block into a block of its own (copy on write),
// and Write refuses positions in a shared block. Blocks that only the index
// holds stay cached; when Reserve finds too few free blocks it drops index
// entries least recently used first until enough are free, so free_blocks()
// counts those blocks as available.
//
// Pins (docs/serving.md, "Pinning a prefix") keep entries from eviction: a
// kept entry holds a reference of its own on its blocks, so they are
// neither evicted nor counted free, up to a bound on the pool's share.
//
// Not thread-safe: the engine that owns a cache serialises access to it,
// except where a method says otherwise.

#include <chrono>
#include <compare>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "kdn/common/kv_block.h"
#include "kdn/common/mutex.h"
#include "kdn/common/status.h"
#include "kdn/engine/kv_sequence.h"
#include "kdn/engine/tensor.h"

namespace kdn::engine {

using kdn::kKvBlockTokens;  // common/kv_block.h: the router counts in it too

class KvCache;

// A content key naming resident KV: kvbus::ChunkKey's value (the engine
// knows no kvbus; kvbridge::ResidentKey converts).
struct KvKey {
  uint64_t hi = 0;
  uint64_t lo = 0;
  friend bool operator==(const KvKey&, const KvKey&) = default;
  friend auto operator<=>(const KvKey&, const KvKey&) = default;
};

// The memory a cache's pool lives in, for a transport that lands KV in
// place (docs/kvbus.md, "Landing in place"): `bytes` at `base`, host memory
// (device -1) or device memory of `device`, elements of `dtype`. A null
// base: the pool cannot be addressed as one region.
struct KvPoolMemory {
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
  int device = -1;
  DType dtype = DType::kF32;
};

// A byte range of KvPoolMemory: [offset, offset + bytes) from its base.
using KvPoolRange = ByteRange;

// What the resident index holds, for metrics and tests.
struct ResidentStats {
  int entries = 0;             // keys indexed
  int cached_blocks = 0;       // blocks the index holds (some also in sequences)
  int evictable_blocks = 0;    // of those, held by no sequence
  uint64_t evictions = 0;      // entries dropped to make room
  uint64_t copied_blocks = 0;  // shared blocks copied before a sequence wrote into them
  int kept_entries = 0;        // entries a keep holds (never evicted)
  int kept_blocks = 0;         // blocks under them (not counted free)
};

class KvCache {
 public:
  virtual ~KvCache() = default;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  int num_layers() const { return num_layers_; }
  int num_kv_heads() const { return num_kv_heads_; }
  int head_dim() const { return head_dim_; }
  int num_blocks() const { return num_blocks_; }
  // Blocks Reserve can take: those held by nothing and those only the
  // resident index holds (it drops them when needed).
  int free_blocks() const { return static_cast<int>(free_.size()) + evictable_; }
  // Blocks held by nothing at all.
  int unused_blocks() const { return static_cast<int>(free_.size()); }
  // Elements in one token's K (or V) of one layer.
  int64_t token_stride() const { return static_cast<int64_t>(num_kv_heads_) * head_dim_; }
  int64_t block_stride() const { return token_stride() * kKvBlockTokens; }

  // A new, empty sequence bound to this cache.
  KvSequence NewSequence();
  // Makes `seq` hold room for `new_length` tokens, taking blocks as needed,
  // and (when new_length > length) gives it a block of its own in place of a
  // shared, partly filled last block, copying its KV. Drops resident entries
  // least recently used first when too few blocks are unused.
  // ResourceExhausted (and `seq` unchanged) when too few blocks are free.
  Status Reserve(KvSequence& seq, int64_t new_length);
  // Marks the first `length` tokens of `seq` as holding KV. length <= reserved.
  void SetLength(KvSequence& seq, int64_t length);

  // One layer's KV of positions [first, first + count) of `seq`, as host
  // elements of `dtype`: count rows of K, then count rows of V, each row
  // token_stride() elements ([token][kv_head][head_dim]), which is a chunk's
  // layout for one layer. Read fills `out` (2 * count * token_stride() *
  // DTypeSize(dtype) bytes); Write stores `in` into the sequence's blocks
  // (rounding to the cache's element type, nearest even). The positions must
  // lie inside the blocks `seq` reserved; neither call changes its length.
  // INVALID_ARGUMENT for positions, a layer or a buffer size out of range.
  // Calls on different layers may run on different threads at once (blend
  // loads layer l+1 while layer l computes).
  Status Read(const KvSequence& seq, int layer, int64_t first, int64_t count, DType dtype,
              std::span<uint8_t> out) const;
  Status Write(KvSequence& seq, int layer, int64_t first, int64_t count, DType dtype,
               std::span<const uint8_t> in);
  // The same for layers [layer0, layer0 + layers) in one call: `layers`
  // blocks of LayerBytes(count, dtype), layer after layer, which is a
  // chunk's payload. A device cache moves them in one copy and waits once,
  // so loading or storing a whole chunk costs one round trip, not one per
  // layer.
  Status ReadLayers(const KvSequence& seq, int layer0, int layers, int64_t first, int64_t count,
                    DType dtype, std::span<uint8_t> out) const;
  Status WriteLayers(KvSequence& seq, int layer0, int layers, int64_t first, int64_t count,
                     DType dtype, std::span<const uint8_t> in);
  // Resident KV. Publish indexes the KV of `seq`'s positions [0, end) under
  // `key` (end <= seq.length(), > 0; not pruned KV: no position shift, no
  // holes), taking a reference on the blocks under them; from then on those
  // blocks never change. A key already indexed is
  // only touched. Attach makes an empty sequence hold a resident key's KV by
  // reference (length = that entry's end) and touches it: no KV moves.
  // NOT_FOUND when the key is not resident, FAILED_PRECONDITION when `seq`
  // holds blocks. ResidentEnd gives an entry's end, or -1.
  // Attach takes the chain of keys a prefix match found, in position order,
  // attaches the last and touches them last to first, so that eviction,
  // least recently used first, drops a chain's deepest entries before the
  // ones it extends (which stay reachable).
  void Publish(const KvSequence& seq, const KvKey& key, int64_t end) KDN_EXCLUDES(index_mu_);
  Status Attach(KvSequence& seq, std::span<const KvKey> chain) KDN_EXCLUDES(index_mu_);
  int64_t ResidentEnd(const KvKey& key) const KDN_EXCLUDES(index_mu_);
  // Whether `key` is resident now. Thread-safe: a lookup thread may ask
  // while the engine's thread works (the answer can be stale when used).
  bool IsResident(const KvKey& key) const KDN_EXCLUDES(index_mu_);
  // Drops every entry: cached blocks no sequence holds become unused.
  void DropResident() KDN_EXCLUDES(index_mu_);
  // On the engine's thread, as free_blocks().
  ResidentStats resident_stats() const KDN_EXCLUDES(index_mu_);

  // Keeps. Keep asks that the entries under `keys` stay resident for
  // `lease` from `now`, whether they are resident yet or not (a prefix is
  // pinned before its KV is computed); a key kept again keeps the later of
  // its deadlines, and a zero lease lets the keys go. Thread-safe: a
  // control thread calls it. Returns the keys taken, 0 when the bound of
  // kMaxKeptKeys would be passed (nothing is taken then).
  // A keep takes effect on the engine's thread: when its key is published,
  // and at ApplyKeeps, which also lets go of keeps whose deadline is past
  // `now` (on the clock Keep was given). The engine calls it before it
  // decides what fits in the pool, since holding an entry takes its blocks
  // out of free_blocks(). An entry is held only while the blocks held stay
  // within keep_limit_blocks() (half the pool, so that pins never starve
  // the requests that use it); a keep past that waits, unheld, for room
  // (the host tier keeps its chunks meanwhile). DropResident lets go of the
  // held entries but not of the keeps.
  using TimePoint = std::chrono::steady_clock::time_point;
  static constexpr size_t kMaxKeptKeys = size_t{1} << 16;
  size_t Keep(std::span<const KvKey> keys, std::chrono::milliseconds lease, TimePoint now)
      KDN_EXCLUDES(index_mu_);
  void ApplyKeeps(TimePoint now) KDN_EXCLUDES(index_mu_);
  int keep_limit_blocks() const { return num_blocks_ / 2; }

  // The pool's memory (base null when it is not one addressable region).
  virtual KvPoolMemory Memory() const { return {}; }
  // Where one layer's KV of positions [first, first + count) of `seq` lies
  // in Memory(): its K rows, then its V rows, each as runs of consecutive
  // bytes (adjacent runs merged), in the order of a layer's bytes that Read
  // gives in the pool's own dtype (a layer slice's payload). A transport
  // writes a slice there in place, as Write would, so the same checks
  // apply: INVALID_ARGUMENT for positions or a layer out of range,
  // FAILED_PRECONDITION for positions in a block `seq` shares or a pool
  // that cannot be addressed. Replaces `out`'s contents.
  Status LayerRanges(const KvSequence& seq, int layer, int64_t first, int64_t count,
                     std::vector<KvPoolRange>* out) const;

  // Bytes Read fills and Write takes for `count` tokens of one layer.
  size_t LayerBytes(int64_t count, DType dtype) const {
    return static_cast<size_t>(2 * count * token_stride()) * DTypeSize(dtype);
  }

 protected:
  KvCache(int num_layers, int num_kv_heads, int head_dim, int num_blocks);
  // The storage side of Read/Write and ReadLayers/WriteLayers, arguments
  // checked (count > 0): `blocks` is the sequence's block table, the buffer
  // holds `layers` layer blocks.
  virtual Status ReadRows(std::span<const int32_t> blocks, int layer0, int layers, int64_t first,
                          int64_t count, DType dtype, uint8_t* out) const = 0;
  virtual Status WriteRows(std::span<const int32_t> blocks, int layer0, int layers, int64_t first,
                           int64_t count, DType dtype, const uint8_t* in) = 0;
  // Copies every layer's K and V of block `from` into block `to`.
  virtual Status CopyBlock(int32_t from, int32_t to) = 0;
  // Where block `block`'s K (or V, `value`) of `layer` starts in Memory(),
  // in bytes; block_stride() elements follow. Backends whose Memory() has
  // a base define it.
  virtual uint64_t BlockOffset(int layer, bool value, int32_t block) const;

 private:
  friend class KvSequence;
  struct Entry {
    std::vector<int32_t> blocks;  // under [0, end)
    int64_t end = 0;
    std::list<KvKey>::iterator lru;  // in lru_
    bool held = false;               // a keep holds its blocks
  };
  Status CheckRows(const KvSequence& seq, int layer0, int layers, int64_t first, int64_t count,
                   DType dtype, size_t bytes) const;
  // FAILED_PRECONDITION when a block under [first, first + count) of `seq`
  // is shared (written in place, it would change another holder's KV).
  Status CheckOwned(const KvSequence& seq, int64_t first, int64_t count) const;
  void Release(std::vector<int32_t>& blocks, size_t keep);
  // Reference counting; `index` says whose reference it is.
  void AddRef(int32_t block, bool index);
  void DropRef(int32_t block, bool index);
  bool Evictable(int32_t block) const {
    return index_refs_[block] > 0 && refs_[block] == index_refs_[block];
  }
  // Drops least recently used entries until `need` blocks are unused or
  // none is left; true when enough are.
  bool EvictFor(size_t need) KDN_EXCLUDES(index_mu_);
  void Evict(std::map<KvKey, Entry>::iterator it) KDN_REQUIRES(index_mu_);
  void Touch(Entry& e) KDN_REQUIRES(index_mu_);
  // A keep's reference on an entry's blocks; Hold is false (and takes
  // nothing) when keep_limit_blocks() would be passed.
  bool Hold(Entry& e) KDN_REQUIRES(index_mu_);
  void Unhold(Entry& e) KDN_REQUIRES(index_mu_);
  int32_t Take();  // an unused block, referenced once

  const int num_layers_, num_kv_heads_, head_dim_, num_blocks_;
  std::vector<int32_t> free_;        // stack of unused block ids
  std::vector<int32_t> refs_;        // [block] -> references (sequences and index)
  std::vector<int32_t> index_refs_;  // [block] -> of those, the index's
  int evictable_ = 0;                // blocks that only the index holds
  int cached_ = 0;                   // blocks the index holds
  uint64_t evictions_ = 0, copied_blocks_ = 0;
  // The index. The engine's thread changes it; IsResident reads it from
  // other threads, so every access holds index_mu_.
  mutable Mutex index_mu_;
  std::map<KvKey, Entry> index_ KDN_GUARDED_BY(index_mu_);
  std::list<KvKey> lru_ KDN_GUARDED_BY(index_mu_);  // most recently used first
  // Keeps: deadlines by key (Keep writes them from any thread), and what
  // the held ones hold (the engine's thread, under index_mu_ as the index).
  std::map<KvKey, TimePoint> keeps_ KDN_GUARDED_BY(index_mu_);
  bool keeps_changed_ KDN_GUARDED_BY(index_mu_) = false;
  TimePoint next_keep_deadline_ KDN_GUARDED_BY(index_mu_) = TimePoint::max();
  std::vector<int32_t> keep_refs_ KDN_GUARDED_BY(index_mu_);  // [block] -> held keeps over it
  int kept_entries_ KDN_GUARDED_BY(index_mu_) = 0;
  int kept_blocks_ KDN_GUARDED_BY(index_mu_) = 0;
};

// The CPU backend's cache: fp32 pools in host memory, which the CPU engine
// reads and writes in place through the accessors below. All of it is one
// region, [layer][K, V][block][slot][kv_head][head_dim]: its own memory, or
// `storage` (StorageBytes of it, zeroed or not, borrowed: it must outlive
// the cache), such as a shared segment a transport's sender maps to land
// KV in place.
class CpuKvCache final : public KvCache {
 public:
  CpuKvCache(int num_layers, int num_kv_heads, int head_dim, int num_blocks,
             uint8_t* storage = nullptr);
  static uint64_t StorageBytes(int num_layers, int num_kv_heads, int head_dim, int num_blocks) {
    return uint64_t{2} * num_layers * num_blocks * kKvBlockTokens * num_kv_heads * head_dim *
           sizeof(float);
  }
  KvPoolMemory Memory() const override;

  float* Key(int layer, int32_t block) { return &k_[layer][block * block_stride()]; }
  float* Value(int layer, int32_t block) { return &v_[layer][block * block_stride()]; }
  const float* Key(int layer, int32_t block) const { return &k_[layer][block * block_stride()]; }
  const float* Value(int layer, int32_t block) const { return &v_[layer][block * block_stride()]; }
  // Pointers to the K/V of one token of a sequence at a position it reserved.
  float* KeyAt(const KvSequence& seq, int layer, int64_t pos) {
    return Key(layer, seq.blocks()[pos / kKvBlockTokens]) + (pos % kKvBlockTokens) * token_stride();
  }
  float* ValueAt(const KvSequence& seq, int layer, int64_t pos) {
    return Value(layer, seq.blocks()[pos / kKvBlockTokens]) +
           (pos % kKvBlockTokens) * token_stride();
  }
  const float* KeyAt(const KvSequence& seq, int layer, int64_t pos) const {
    return Key(layer, seq.blocks()[pos / kKvBlockTokens]) + (pos % kKvBlockTokens) * token_stride();
  }
  const float* ValueAt(const KvSequence& seq, int layer, int64_t pos) const {
    return Value(layer, seq.blocks()[pos / kKvBlockTokens]) +
           (pos % kKvBlockTokens) * token_stride();
  }

 protected:
  Status ReadRows(std::span<const int32_t> blocks, int layer0, int layers, int64_t first,
                  int64_t count, DType dtype, uint8_t* out) const override;
  Status WriteRows(std::span<const int32_t> blocks, int layer0, int layers, int64_t first,
                   int64_t count, DType dtype, const uint8_t* in) override;
  Status CopyBlock(int32_t from, int32_t to) override;
  uint64_t BlockOffset(int layer, bool value, int32_t block) const override;

 private:
  std::unique_ptr<float[]> own_;  // the pool, unless storage was given
  float* pool_ = nullptr;
  std::vector<float*> k_, v_;  // [layer] -> its K (V) pool, num_blocks blocks
};

}  // namespace kdn::engine
