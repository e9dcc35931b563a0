#include "kdn/engine/kv_cache.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <iterator>
#include <set>
#include <string>
#include <utility>

namespace kdn::engine {

KvCache::KvCache(int num_layers, int num_kv_heads, int head_dim, int num_blocks)
    : num_layers_(num_layers),
      num_kv_heads_(num_kv_heads),
      head_dim_(head_dim),
      num_blocks_(num_blocks),
      refs_(num_blocks, 0),
      index_refs_(num_blocks, 0),
      keep_refs_(num_blocks, 0) {
  free_.reserve(num_blocks);
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

void KvCache::AddRef(int32_t block, bool index) {
  const bool was = Evictable(block);
  ++refs_[block];
  if (index && ++index_refs_[block] == 1) ++cached_;
  evictable_ += static_cast<int>(Evictable(block)) - static_cast<int>(was);
}

void KvCache::DropRef(int32_t block, bool index) {
  assert(refs_[block] > 0 && (!index || index_refs_[block] > 0));
  const bool was = Evictable(block);
  --refs_[block];
  if (index && --index_refs_[block] == 0) --cached_;
  evictable_ += static_cast<int>(Evictable(block)) - static_cast<int>(was);
  if (refs_[block] == 0) free_.push_back(block);
}

int32_t KvCache::Take() {
  const int32_t b = free_.back();
  free_.pop_back();
  AddRef(b, false);
  return b;
}

KvSequence KvCache::NewSequence() {
  KvSequence s;
  s.cache_ = this;
  return s;
}

Status KvCache::Reserve(KvSequence& seq, int64_t new_length) {
  assert(seq.cache_ == this);
  const size_t need = static_cast<size_t>((new_length + kKvBlockTokens - 1) / kKvBlockTokens);
  const size_t more = need > seq.blocks_.size() ? need - seq.blocks_.size() : 0;
  // The block the next write lands in, when the sequence shares it.
  const auto shared_last = [&]() -> int64_t {
    const int64_t at = seq.length_ / kKvBlockTokens;
    const bool grows = new_length > seq.length_ && seq.length_ % kKvBlockTokens != 0;
    return grows && at < static_cast<int64_t>(seq.blocks_.size()) && refs_[seq.blocks_[at]] > 1
               ? at
               : -1;
  };
  size_t total = more + (shared_last() >= 0 ? 1 : 0);
  if (total == 0) return Status::Ok();
  // Blocks only the index holds are what evicting every entry frees: when
  // even those are too few, nothing is evicted for a request refused anyway.
  if (free_.size() < total && (free_blocks() < static_cast<int>(total) || !EvictFor(total))) {
    return ResourceExhausted("KV cache: " + std::to_string(total) + " more blocks needed for " +
                             std::to_string(new_length) + " tokens, " +
                             std::to_string(free_blocks()) + " of " + std::to_string(num_blocks_) +
                             " free");
  }
  // Evicting may have left the last block to this sequence alone.
  if (const int64_t at = shared_last(); at >= 0) {
    const int32_t copy = Take();
    if (Status st = CopyBlock(seq.blocks_[at], copy); !st.ok()) {
      DropRef(copy, false);
      return st;
    }
    DropRef(seq.blocks_[at], false);
    seq.blocks_[at] = copy;
    ++copied_blocks_;
  }
  for (size_t i = 0; i < more; ++i) seq.blocks_.push_back(Take());
  return Status::Ok();
}

void KvCache::Publish(const KvSequence& seq, const KvKey& key, int64_t end) {
  assert(seq.cache_ == this && end > 0 && end <= seq.length_);
  assert(seq.position_shift_ == 0 && seq.hole_end_ == 0);  // a prefix's own KV only
  MutexLock lock(index_mu_);
  if (auto it = index_.find(key); it != index_.end()) {
    Touch(it->second);
    return;
  }
  Entry e;
  e.blocks.assign(seq.blocks_.begin(),
                  seq.blocks_.begin() + (end + kKvBlockTokens - 1) / kKvBlockTokens);
  e.end = end;
  for (int32_t b : e.blocks) AddRef(b, true);
  lru_.push_front(key);
  e.lru = lru_.begin();
  Entry& added = index_.emplace(key, std::move(e)).first->second;
  // A keep that came before its KV: held from now on (its blocks are the
  // sequence's too, so nothing counted free changes here).
  // Past the bound it waits for an entry to be let go (Unhold).
  if (keeps_.contains(key)) (void)Hold(added);
}

Status KvCache::Attach(KvSequence& seq, std::span<const KvKey> chain) {
  assert(seq.cache_ == this);
  if (!seq.blocks_.empty()) {
    return FailedPrecondition("KV cache: resident KV attaches to an empty sequence only");
  }
  MutexLock lock(index_mu_);
  if (chain.empty()) return InvalidArgument("KV cache: no key to attach");
  auto last = index_.find(chain.back());
  if (last == index_.end()) return NotFound("KV cache: the key is not resident");
  for (int32_t b : last->second.blocks) AddRef(b, false);
  seq.blocks_ = last->second.blocks;
  seq.length_ = last->second.end;
  for (auto k = chain.rbegin(); k != chain.rend(); ++k) {
    if (auto it = index_.find(*k); it != index_.end()) Touch(it->second);
  }
  return Status::Ok();
}

int64_t KvCache::ResidentEnd(const KvKey& key) const {
  MutexLock lock(index_mu_);
  auto it = index_.find(key);
  return it == index_.end() ? -1 : it->second.end;
}

bool KvCache::IsResident(const KvKey& key) const {
  MutexLock lock(index_mu_);
  return index_.contains(key);
}

void KvCache::DropResident() {
  MutexLock lock(index_mu_);
  while (!index_.empty()) {
    Evict(index_.begin());
    --evictions_;  // not to make room
  }
}

ResidentStats KvCache::resident_stats() const {
  MutexLock lock(index_mu_);
  return {static_cast<int>(index_.size()),
          cached_,
          evictable_,
          evictions_,
          copied_blocks_,
          kept_entries_,
          kept_blocks_};
}

size_t KvCache::Keep(std::span<const KvKey> keys, std::chrono::milliseconds lease, TimePoint now) {
  MutexLock lock(index_mu_);
  if (lease.count() <= 0) {
    for (const KvKey& k : keys) {
      if (auto it = keeps_.find(k); it != keeps_.end()) it->second = TimePoint::min();
    }
    keeps_changed_ = true;
    return 0;
  }
  std::set<KvKey> fresh;
  for (const KvKey& k : keys) {
    if (!keeps_.contains(k)) fresh.insert(k);
  }
  if (keeps_.size() + fresh.size() > kMaxKeptKeys) return 0;
  // Saturating, in milliseconds (a nanosecond count of a long lease would
  // overflow): a lease past the clock's end keeps until let go.
  const TimePoint deadline =
      lease >= std::chrono::duration_cast<std::chrono::milliseconds>(TimePoint::max() - now)
          ? TimePoint::max()
          : now + lease;
  for (const KvKey& k : keys) {
    auto [it, added] = keeps_.try_emplace(k, deadline);
    if (!added) it->second = std::max(it->second, deadline);
  }
  keeps_changed_ = true;
  return keys.size();
}

void KvCache::ApplyKeeps(TimePoint now) {
  MutexLock lock(index_mu_);
  // A second pass when the first let entries go: what waited for room, and
  // came before them in key order, is held now rather than at the next call.
  for (int pass = 0; pass < 2 && (keeps_changed_ || now >= next_keep_deadline_); ++pass) {
    keeps_changed_ = false;
    next_keep_deadline_ = TimePoint::max();
    for (auto k = keeps_.begin(); k != keeps_.end();) {
      auto e = index_.find(k->first);
      if (k->second <= now) {
        if (e != index_.end() && e->second.held) Unhold(e->second);  // sets keeps_changed_
        k = keeps_.erase(k);
        continue;
      }
      next_keep_deadline_ = std::min(next_keep_deadline_, k->second);
      if (e != index_.end() && !e->second.held) (void)Hold(e->second);
      ++k;
    }
  }
}

bool KvCache::Hold(Entry& e) {
  int more = 0;
  for (int32_t b : e.blocks) more += keep_refs_[b] == 0 ? 1 : 0;
  if (kept_blocks_ + more > keep_limit_blocks()) return false;
  for (int32_t b : e.blocks) {
    AddRef(b, false);
    if (keep_refs_[b]++ == 0) ++kept_blocks_;
  }
  e.held = true;
  ++kept_entries_;
  return true;
}

void KvCache::Unhold(Entry& e) {
  for (int32_t b : e.blocks) {
    if (--keep_refs_[b] == 0) --kept_blocks_;
    DropRef(b, false);
  }
  e.held = false;
  --kept_entries_;
  keeps_changed_ = true;  // room: the next ApplyKeeps holds what waited for it
}

bool KvCache::EvictFor(size_t need) {
  MutexLock lock(index_mu_);
  // Least recently used first, past the held entries.
  auto k = lru_.end();
  while (free_.size() < need && k != lru_.begin()) {
    const auto victim = std::prev(k);
    auto it = index_.find(*victim);
    if (it->second.held) {
      k = victim;
      continue;
    }
    Evict(it);  // erases victim's node only: k stays valid
  }
  return free_.size() >= need;
}

void KvCache::Evict(std::map<KvKey, Entry>::iterator it) {
  if (it->second.held) Unhold(it->second);
  for (int32_t b : it->second.blocks) DropRef(b, true);
  lru_.erase(it->second.lru);
  index_.erase(it);
  ++evictions_;
}

void KvCache::Touch(Entry& e) { lru_.splice(lru_.begin(), lru_, e.lru); }

void KvCache::SetLength(KvSequence& seq, int64_t length) {
  assert(length <= static_cast<int64_t>(seq.blocks_.size()) * kKvBlockTokens);
  seq.length_ = length;
}

void KvCache::Release(std::vector<int32_t>& blocks, size_t keep) {
  while (blocks.size() > keep) {
    DropRef(blocks.back(), false);
    blocks.pop_back();
  }
}

Status KvCache::CheckRows(const KvSequence& seq, int layer0, int layers, int64_t first,
                          int64_t count, DType dtype, size_t bytes) const {
  if (seq.cache_ != this) return InvalidArgument("KV cache: the sequence belongs to another cache");
  if (layer0 < 0 || layers < 1 || layer0 + layers > num_layers_) {
    const std::string which = layers == 1 ? "layer " + std::to_string(layer0)
                                          : "layers [" + std::to_string(layer0) + ", " +
                                                std::to_string(layer0 + layers) + ")";
    return InvalidArgument("KV cache: " + which + " outside [0, " + std::to_string(num_layers_) +
                           ")");
  }
  if (first < 0 || count < 0 || first + count > seq.reserved()) {
    return InvalidArgument("KV cache: positions [" + std::to_string(first) + ", " +
                           std::to_string(first + count) + ") outside the " +
                           std::to_string(seq.reserved()) + " the sequence reserved");
  }
  const size_t want = static_cast<size_t>(layers) * LayerBytes(count, dtype);
  if (bytes != want) {
    return InvalidArgument("KV cache: a buffer of " + std::to_string(bytes) + " bytes for " +
                           std::to_string(count) + " tokens of " + std::to_string(layers) +
                           " layer(s), expected " + std::to_string(want));
  }
  return Status::Ok();
}

Status KvCache::CheckOwned(const KvSequence& seq, int64_t first, int64_t count) const {
  for (int64_t b = first / kKvBlockTokens; b <= (first + count - 1) / kKvBlockTokens; ++b) {
    if (refs_[seq.blocks_[b]] > 1) {
      return FailedPrecondition("KV cache: positions [" + std::to_string(first) + ", " +
                                std::to_string(first + count) +
                                ") lie in a block the sequence shares");
    }
  }
  return Status::Ok();
}

uint64_t KvCache::BlockOffset(int, bool, int32_t) const { return 0; }

Status KvCache::LayerRanges(const KvSequence& seq, int layer, int64_t first, int64_t count,
                            std::vector<KvPoolRange>* out) const {
  out->clear();
  const KvPoolMemory mem = Memory();
  if (mem.base == nullptr) {
    return FailedPrecondition("KV cache: this pool is not one addressable region");
  }
  KDN_RETURN_IF_ERROR(
      CheckRows(seq, layer, 1, first, count, mem.dtype, LayerBytes(count, mem.dtype)));
  if (count == 0) return Status::Ok();
  KDN_RETURN_IF_ERROR(CheckOwned(seq, first, count));
  const uint64_t row = static_cast<uint64_t>(token_stride()) * DTypeSize(mem.dtype);
  for (const bool value : {false, true}) {
    AppendPagedRuns(
        seq.blocks_, first, count, kKvBlockTokens, row,
        [&](int32_t block) { return BlockOffset(layer, value, block); }, out);
  }
  return Status::Ok();
}

Status KvCache::Read(const KvSequence& seq, int layer, int64_t first, int64_t count, DType dtype,
                     std::span<uint8_t> out) const {
  return ReadLayers(seq, layer, 1, first, count, dtype, out);
}

Status KvCache::Write(KvSequence& seq, int layer, int64_t first, int64_t count, DType dtype,
                      std::span<const uint8_t> in) {
  return WriteLayers(seq, layer, 1, first, count, dtype, in);
}

Status KvCache::ReadLayers(const KvSequence& seq, int layer0, int layers, int64_t first,
                           int64_t count, DType dtype, std::span<uint8_t> out) const {
  KDN_RETURN_IF_ERROR(CheckRows(seq, layer0, layers, first, count, dtype, out.size()));
  if (count == 0) return Status::Ok();
  return ReadRows(seq.blocks_, layer0, layers, first, count, dtype, out.data());
}

Status KvCache::WriteLayers(KvSequence& seq, int layer0, int layers, int64_t first, int64_t count,
                            DType dtype, std::span<const uint8_t> in) {
  KDN_RETURN_IF_ERROR(CheckRows(seq, layer0, layers, first, count, dtype, in.size()));
  if (count == 0) return Status::Ok();
  KDN_RETURN_IF_ERROR(CheckOwned(seq, first, count));
  return WriteRows(seq.blocks_, layer0, layers, first, count, dtype, in.data());
}

CpuKvCache::CpuKvCache(int num_layers, int num_kv_heads, int head_dim, int num_blocks,
                       uint8_t* storage)
    : KvCache(num_layers, num_kv_heads, head_dim, num_blocks), k_(num_layers), v_(num_layers) {
  const uint64_t bytes = StorageBytes(num_layers, num_kv_heads, head_dim, num_blocks);
  if (storage == nullptr) {
    own_ = std::make_unique<float[]>(bytes / sizeof(float));  // zeroed
    pool_ = own_.get();
  } else {
    pool_ = reinterpret_cast<float*>(storage);
  }
  const auto layer = static_cast<size_t>(num_blocks) * block_stride();
  for (int l = 0; l < num_layers; ++l) {
    k_[l] = pool_ + 2 * l * layer;
    v_[l] = k_[l] + layer;
  }
}

KvPoolMemory CpuKvCache::Memory() const {
  return {reinterpret_cast<uint8_t*>(pool_),
          StorageBytes(num_layers(), num_kv_heads(), head_dim(), num_blocks()), -1, DType::kF32};
}

uint64_t CpuKvCache::BlockOffset(int layer, bool value, int32_t block) const {
  const float* at = (value ? v_ : k_)[layer] + static_cast<int64_t>(block) * block_stride();
  return static_cast<uint64_t>(at - pool_) * sizeof(float);
}

namespace {

// Runs of consecutive positions inside one block are contiguous in a pool:
// f(layer K, layer V, offset in the rows buffer, elements) once per run.
template <typename Pool, typename F>
void ForEachRun(Pool& k, Pool& v, std::span<const int32_t> blocks, int64_t first, int64_t count,
                int64_t stride, size_t row_bytes, F f) {
  for (int64_t t = first; t < first + count;) {
    const int64_t slot = t % kKvBlockTokens;
    const int64_t run = std::min<int64_t>(kKvBlockTokens - slot, first + count - t);
    const int64_t at = blocks[t / kKvBlockTokens] * stride * kKvBlockTokens + slot * stride;
    f(k + at, v + at, static_cast<size_t>(t - first) * row_bytes, run * stride);
    t += run;
  }
}

}  // namespace

Status CpuKvCache::CopyBlock(int32_t from, int32_t to) {
  const auto n = static_cast<size_t>(block_stride());
  for (int l = 0; l < num_layers(); ++l) {
    std::copy_n(k_[l] + from * n, n, k_[l] + to * n);
    std::copy_n(v_[l] + from * n, n, v_[l] + to * n);
  }
  return Status::Ok();
}

Status CpuKvCache::ReadRows(std::span<const int32_t> blocks, int layer0, int layers, int64_t first,
                            int64_t count, DType dtype, uint8_t* out) const {
  const size_t row_bytes = static_cast<size_t>(token_stride()) * DTypeSize(dtype);
  for (int l = layer0; l < layer0 + layers; ++l, out += LayerBytes(count, dtype)) {
    ForEachRun(k_[l], v_[l], blocks, first, count, token_stride(), row_bytes,
               [&](const float* k, const float* v, size_t at, int64_t n) {
                 FromFloat(dtype, k, n, out + at);
                 FromFloat(dtype, v, n, out + count * row_bytes + at);
               });
  }
  return Status::Ok();
}

Status CpuKvCache::WriteRows(std::span<const int32_t> blocks, int layer0, int layers, int64_t first,
                             int64_t count, DType dtype, const uint8_t* in) {
  const size_t row_bytes = static_cast<size_t>(token_stride()) * DTypeSize(dtype);
  for (int l = layer0; l < layer0 + layers; ++l, in += LayerBytes(count, dtype)) {
    ForEachRun(k_[l], v_[l], blocks, first, count, token_stride(), row_bytes,
               [&](float* k, float* v, size_t at, int64_t n) {
                 ToFloat(dtype, in + at, n, k);
                 ToFloat(dtype, in + count * row_bytes + at, n, v);
               });
  }
  return Status::Ok();
}

}  // namespace kdn::engine
