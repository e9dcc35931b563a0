#include "kdn/kvbus/tiered_store.h"

#include <algorithm>

namespace kdn::kvbus {

namespace {

std::vector<std::unique_ptr<ChunkStore>> HostOverDisk(std::unique_ptr<HostTier> host,
                                                      std::unique_ptr<DiskTier> disk) {
  std::vector<std::unique_ptr<ChunkStore>> tiers;
  tiers.push_back(std::move(host));
  tiers.push_back(std::move(disk));
  return tiers;
}

}  // namespace

TieredStore::TieredStore(std::vector<std::unique_ptr<ChunkStore>> tiers, TieredStoreOptions options)
    : tiers_(std::move(tiers)), options_(options) {
  std::erase_if(tiers_, [](const std::unique_ptr<ChunkStore>& t) { return t == nullptr; });
  WireDemotion();
}

TieredStore::TieredStore(std::unique_ptr<HostTier> host, std::unique_ptr<DiskTier> disk,
                         TieredStoreOptions options)
    : TieredStore(HostOverDisk(std::move(host), std::move(disk)), options) {}

TieredStore::~TieredStore() {
  if (host_ != nullptr) host_->SetEvictionHandler(nullptr);
}

void TieredStore::WireDemotion() {
  if (tiers_.empty()) return;
  host_ = dynamic_cast<HostTier*>(tiers_[0].get());
  if (host_ != nullptr && tiers_.size() > 1) {
    host_->SetEvictionHandler([this](std::shared_ptr<const Chunk> c) { Demote(std::move(c)); });
  }
}

void TieredStore::Demote(std::shared_ptr<const Chunk> chunk) {
  ChunkStore& next = *tiers_[1];
  if (next.Contains(chunk->key())) return;
  // Best effort: a chunk the next tier cannot take is simply gone from the
  // cache, which costs a recompute, not correctness.
  const ChunkKey key = chunk->key();
  if (next.Put(std::move(chunk)).ok()) Stored(1, key);
}

void TieredStore::SetPutListener(PutListener listener) {
  put_listener_.store(listener ? std::make_shared<const PutListener>(std::move(listener))
                               : nullptr);
}

void TieredStore::Stored(size_t tier, const ChunkKey& key) {
  if (tier == 0) return;
  if (auto listener = put_listener_.load()) (*listener)(tier, key);
}

Result<std::shared_ptr<const Chunk>> TieredStore::Get(const ChunkKey& key) {
  Status failure;
  for (size_t i = 0; i < tiers_.size(); ++i) {
    auto got = tiers_[i]->Get(key);
    if (!got.ok()) {
      if (got.status().code() != StatusCode::kNotFound && failure.ok()) {
        failure = got.status().WithContext(tiers_[i]->name());
      }
      continue;
    }
    // Promote slowest-first so that, if the host evicts to make room, the
    // chunk is already in the tiers it would be demoted to.
    for (size_t j = i; j-- > 0;) (void)tiers_[j]->Put(*got);
    hits_.fetch_add(1, std::memory_order_relaxed);
    return got;
  }
  misses_.fetch_add(1, std::memory_order_relaxed);
  if (!failure.ok()) return failure;
  return NotFound("tiered store: no tier holds chunk " + key.ToHex());
}

bool TieredStore::Contains(const ChunkKey& key) {
  return std::any_of(tiers_.begin(), tiers_.end(),
                     [&](const std::unique_ptr<ChunkStore>& t) { return t->Contains(key); });
}

std::vector<bool> TieredStore::ContainsMany(std::span<const ChunkKey> keys) {
  std::vector<bool> held(keys.size(), false);
  std::vector<size_t> open(keys.size());  // indices no tier has been found to hold
  for (size_t i = 0; i < keys.size(); ++i) open[i] = i;
  std::vector<ChunkKey> ask;
  for (auto& t : tiers_) {
    if (open.empty()) break;
    ask.clear();
    for (size_t i : open) ask.push_back(keys[i]);
    const std::vector<bool> found = t->ContainsMany(ask);
    std::vector<size_t> still;
    for (size_t j = 0; j < open.size(); ++j) {
      if (j < found.size() && found[j]) {
        held[open[j]] = true;
      } else {
        still.push_back(open[j]);
      }
    }
    open = std::move(still);
  }
  return held;
}

Status TieredStore::Put(std::shared_ptr<const Chunk> chunk) {
  if (!chunk) return InvalidArgument("tiered store: Put of a null chunk");
  if (tiers_.empty()) return FailedPrecondition("tiered store: no tiers");
  Status first;
  bool stored = false;
  for (size_t i = 0; i < tiers_.size(); ++i) {
    Status st = tiers_[i]->Put(chunk);
    if (st.ok()) {
      stored = true;
      Stored(i, chunk->key());
      if (!options_.write_through) break;
      continue;
    }
    if (first.ok()) first = st.WithContext(tiers_[i]->name());
    // Without write-through, fall through only for lack of room: any other
    // failure (a bad chunk) would fail the same way everywhere.
    if (!options_.write_through && st.code() != StatusCode::kResourceExhausted) break;
  }
  return stored ? Status::Ok() : first;
}

TierStats TieredStore::Stats() { return Sum(&ChunkStore::Stats); }

TierStats TieredStore::LocalStats() { return Sum(&ChunkStore::LocalStats); }

Result<size_t> TieredStore::Keep(std::span<const ChunkKey> keys, std::chrono::milliseconds lease) {
  size_t most = 0;
  Status first_error;
  for (auto& t : tiers_) {
    auto kept = t->Keep(keys, lease);
    if (kept.ok()) {
      most = std::max(most, *kept);
    } else if (first_error.ok()) {
      first_error = kept.status();
    }
  }
  if (most == 0 && !first_error.ok()) return first_error;
  return most;
}

TierStats TieredStore::Sum(TierStats (ChunkStore::*stats)()) {
  TierStats sum;
  bool unbounded = false;
  for (auto& t : tiers_) {
    const TierStats s = (t.get()->*stats)();
    sum.chunks += s.chunks;
    sum.bytes += s.bytes;
    sum.capacity_bytes += s.capacity_bytes;
    unbounded = unbounded || s.capacity_bytes == 0;
    sum.puts += s.puts;
    sum.evictions += s.evictions;
    sum.corrupt += s.corrupt;
    sum.unreachable += s.unreachable;
  }
  if (unbounded) sum.capacity_bytes = 0;
  sum.hits = hits_.load(std::memory_order_relaxed);
  sum.misses = misses_.load(std::memory_order_relaxed);
  return sum;
}

size_t TieredStore::LongestPrefix(std::span<const ChunkKey> keys) {
  const std::vector<bool> held = ContainsMany(keys);
  return static_cast<size_t>(std::find(held.begin(), held.end(), false) - held.begin());
}

std::vector<std::pair<std::string, TierStats>> TieredStore::TierBreakdown() {
  std::vector<std::pair<std::string, TierStats>> out;
  out.reserve(tiers_.size());
  for (auto& t : tiers_) out.emplace_back(t->name(), t->Stats());
  return out;
}

}  // namespace kdn::kvbus
