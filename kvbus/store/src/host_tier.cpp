#include "kdn/kvbus/host_tier.h"

namespace kdn::kvbus {

HostTier::HostTier(uint64_t capacity_bytes, Clock clock)
    : capacity_(capacity_bytes),
      clock_(clock ? std::move(clock) : Clock([] { return std::chrono::steady_clock::now(); })) {}

HostTier::TimePoint HostTier::DeadlineAfter(TimePoint now, std::chrono::milliseconds lease) {
  // A lease of "forever" (milliseconds::max) must not overflow the clock.
  const auto room = TimePoint::max() - now;
  if (lease >= std::chrono::duration_cast<std::chrono::milliseconds>(room)) {
    return TimePoint::max();
  }
  return now + lease;
}

size_t HostTier::ExpireLocked(TimePoint now) {
  while (!keep_deadlines_.empty() && keep_deadlines_.begin()->first <= now) {
    // A copy: UnkeepLocked erases the node the key lies in.
    const ChunkKey key = keep_deadlines_.begin()->second;
    UnkeepLocked(key);
  }
  size_t dropped = 0;
  while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
    const uint64_t id = deadlines_.begin()->second;
    deadlines_.erase(deadlines_.begin());
    auto it = pins_.find(id);
    ReleaseLocked(it->second);
    pins_.erase(it);
    ++dropped;
  }
  return dropped;
}

void HostTier::HoldLocked(Entry& e) {
  if (e.pins++ == 0) pinned_bytes_ += e.chunk->size();
}

void HostTier::UnholdLocked(Entry& e) {
  if (--e.pins == 0) pinned_bytes_ -= e.chunk->size();
}

void HostTier::ReleaseLocked(const PinRecord& pin) {
  // Entries are never removed while pinned, so the entry is there.
  UnholdLocked(index_.at(pin.key));
}

void HostTier::SetKeptLocked(Entry& e, bool kept) {
  if (e.kept == kept) return;
  e.kept = kept;
  kept ? HoldLocked(e) : UnholdLocked(e);
}

void HostTier::UnkeepLocked(ChunkKey key) {
  auto it = keeps_.find(key);
  if (it == keeps_.end()) return;
  keep_deadlines_.erase({it->second, key});
  keeps_.erase(it);
  if (auto e = index_.find(key); e != index_.end()) SetKeptLocked(e->second, false);
}

Result<size_t> HostTier::Keep(std::span<const ChunkKey> keys, std::chrono::milliseconds lease) {
  if (lease.count() < 0) {
    return InvalidArgument("host tier: keep lease of " + std::to_string(lease.count()) + " ms");
  }
  MutexLock lock(mu_);
  const TimePoint now = Now();
  ExpireLocked(now);
  if (lease.count() == 0) {
    for (const ChunkKey& k : keys) UnkeepLocked(k);
    return size_t{0};
  }
  size_t fresh = 0;
  for (const ChunkKey& k : keys) fresh += keeps_.count(k) == 0 ? 1 : 0;
  if (keeps_.size() + fresh > kMaxKeptKeys) {
    return ResourceExhausted("host tier: keeping " + std::to_string(fresh) +
                             " more keys would pass the bound of " + std::to_string(kMaxKeptKeys) +
                             " kept keys");
  }
  const TimePoint deadline = DeadlineAfter(now, lease);
  for (const ChunkKey& k : keys) {
    auto [it, added] = keeps_.try_emplace(k, deadline);
    if (!added) {
      if (it->second >= deadline) continue;
      keep_deadlines_.erase({it->second, k});
      it->second = deadline;
    }
    keep_deadlines_.emplace(deadline, k);
    if (auto e = index_.find(k); e != index_.end()) SetKeptLocked(e->second, true);
  }
  return keys.size();
}

size_t HostTier::KeptCount() {
  MutexLock lock(mu_);
  ExpireLocked(Now());
  return keeps_.size();
}

void HostTier::TouchLocked(Entry& e) { lru_.splice(lru_.begin(), lru_, e.lru); }

Result<std::shared_ptr<const Chunk>> HostTier::Get(const ChunkKey& key) {
  MutexLock lock(mu_);
  ExpireLocked(Now());
  if (auto it = index_.find(key); it != index_.end()) {
    TouchLocked(it->second);
    ++hits_;
    return it->second.chunk;
  }
  if (auto it = demoting_.find(key); it != demoting_.end()) {
    ++hits_;
    return it->second.chunk;
  }
  ++misses_;
  return NotFound("host tier: no chunk " + key.ToHex());
}

bool HostTier::Contains(const ChunkKey& key) {
  MutexLock lock(mu_);
  ExpireLocked(Now());
  return index_.count(key) != 0 || demoting_.count(key) != 0;
}

Status HostTier::Put(std::shared_ptr<const Chunk> chunk) {
  if (!chunk) return InvalidArgument("host tier: Put of a null chunk");
  const uint64_t size = chunk->size();
  const ChunkKey key = chunk->key();
  std::vector<std::shared_ptr<const Chunk>> evicted;
  EvictionHandler handler;
  {
    MutexLock lock(mu_);
    ExpireLocked(Now());
    if (auto it = index_.find(key); it != index_.end()) {
      TouchLocked(it->second);
      return Status::Ok();
    }
    if (capacity_ != 0 && size > capacity_) {
      return ResourceExhausted("host tier: chunk " + key.ToHex() + " of " + std::to_string(size) +
                               " bytes exceeds the capacity of " + std::to_string(capacity_));
    }
    // Check before evicting anything, so that a failed Put changes nothing.
    // A kept key's chunk is pinned as it arrives: the room it takes is
    // pinned too.
    if (capacity_ != 0 && pinned_bytes_ + size > capacity_) {
      return ResourceExhausted("host tier: no room for chunk " + key.ToHex() + " of " +
                               std::to_string(size) + " bytes: " + std::to_string(pinned_bytes_) +
                               " of " + std::to_string(capacity_) + " bytes are pinned");
    }
    auto victim = lru_.end();
    while (capacity_ != 0 && bytes_ + size > capacity_) {
      // The check above guarantees an unpinned victim remains.
      do {
        --victim;
      } while (index_.at(*victim).pins > 0);
      auto node = index_.find(*victim);
      victim = lru_.erase(victim);
      bytes_ -= node->second.chunk->size();
      ++evictions_;
      if (handler_) {
        Demoting& d = demoting_[node->first];
        d.chunk = node->second.chunk;
        ++d.count;
      }
      if (listener_) listener_(node->first, false);
      evicted.push_back(std::move(node->second.chunk));
      index_.erase(node);
    }
    lru_.push_front(key);
    Entry& added = index_.emplace(key, Entry{std::move(chunk), lru_.begin(), 0}).first->second;
    if (keeps_.count(key) != 0) SetKeptLocked(added, true);
    bytes_ += size;
    ++puts_;
    if (listener_) listener_(key, true);
    if (!evicted.empty()) handler = handler_;
  }
  // Outside the lock: demoting may write to disk, and the handler may call
  // back into this tier.
  if (handler) Demote(handler, std::move(evicted));
  return Status::Ok();
}

void HostTier::Demote(const EvictionHandler& handler,
                      std::vector<std::shared_ptr<const Chunk>> evicted) {
  for (auto& chunk : evicted) {
    const ChunkKey key = chunk->key();
    handler(std::move(chunk));
    MutexLock lock(mu_);
    auto it = demoting_.find(key);
    if (it != demoting_.end() && --it->second.count == 0) demoting_.erase(it);
  }
}

bool HostTier::Erase(const ChunkKey& key) {
  MutexLock lock(mu_);
  ExpireLocked(Now());
  auto it = index_.find(key);
  if (it == index_.end() || it->second.pins > 0) return false;
  bytes_ -= it->second.chunk->size();
  lru_.erase(it->second.lru);
  index_.erase(it);
  if (listener_) listener_(key, false);
  return true;
}

TierStats HostTier::Stats() {
  MutexLock lock(mu_);
  ExpireLocked(Now());
  TierStats s;
  s.chunks = index_.size();
  s.bytes = bytes_;
  s.capacity_bytes = capacity_;
  s.hits = hits_;
  s.misses = misses_;
  s.puts = puts_;
  s.evictions = evictions_;
  return s;
}

Result<uint64_t> HostTier::Pin(const ChunkKey& key, std::chrono::milliseconds lease) {
  if (lease.count() <= 0) {
    return InvalidArgument("host tier: pin lease of " + std::to_string(lease.count()) + " ms");
  }
  MutexLock lock(mu_);
  const TimePoint now = Now();
  ExpireLocked(now);
  auto it = index_.find(key);
  if (it == index_.end()) return NotFound("host tier: cannot pin absent chunk " + key.ToHex());
  Entry& e = it->second;
  HoldLocked(e);
  TouchLocked(e);
  const uint64_t id = next_pin_++;
  const TimePoint deadline = DeadlineAfter(now, lease);
  pins_.emplace(id, PinRecord{key, deadline});
  deadlines_.emplace(deadline, id);
  return id;
}

Status HostTier::Renew(uint64_t pin, std::chrono::milliseconds lease) {
  if (lease.count() <= 0) {
    return InvalidArgument("host tier: pin lease of " + std::to_string(lease.count()) + " ms");
  }
  MutexLock lock(mu_);
  const TimePoint now = Now();
  ExpireLocked(now);
  auto it = pins_.find(pin);
  if (it == pins_.end()) return NotFound("host tier: no pin " + std::to_string(pin));
  deadlines_.erase({it->second.deadline, pin});
  it->second.deadline = DeadlineAfter(now, lease);
  deadlines_.emplace(it->second.deadline, pin);
  return Status::Ok();
}

Status HostTier::Unpin(uint64_t pin) {
  MutexLock lock(mu_);
  ExpireLocked(Now());
  auto it = pins_.find(pin);
  if (it == pins_.end()) return NotFound("host tier: no pin " + std::to_string(pin));
  deadlines_.erase({it->second.deadline, pin});
  ReleaseLocked(it->second);
  pins_.erase(it);
  return Status::Ok();
}

size_t HostTier::ExpirePins() {
  MutexLock lock(mu_);
  return ExpireLocked(Now());
}

size_t HostTier::PinCount() {
  MutexLock lock(mu_);
  ExpireLocked(Now());
  return pins_.size();
}

void HostTier::SetEvictionHandler(EvictionHandler handler) {
  MutexLock lock(mu_);
  handler_ = std::move(handler);
}

void HostTier::SetChangeListener(ChangeListener listener) {
  MutexLock lock(mu_);
  listener_ = std::move(listener);
}

}  // namespace kdn::kvbus
