#include "kdn/decode_worker/slice_landing.h"

#include <algorithm>
#include <string>

namespace kdn::decode_worker {

namespace {

// CORRUPTION naming the first field in which `got` is not `want`.
Status Matches(const kvbus::ChunkInfo& got, const kvbus::ChunkInfo& want) {
  const auto differ = [&](const char* field, int64_t g, int64_t w) {
    return Corruption("KV slice " + want.key.ToHex() + ": " + field + " " + std::to_string(g) +
                      ", this request expects " + std::to_string(w));
  };
  if (got.model_fingerprint != want.model_fingerprint) {
    return Corruption("KV slice " + want.key.ToHex() + " is of another model");
  }
  if (got.layers != want.layers) return differ("layers", got.layers, want.layers);
  if (got.kv_heads != want.kv_heads) return differ("kv_heads", got.kv_heads, want.kv_heads);
  if (got.head_dim != want.head_dim) return differ("head_dim", got.head_dim, want.head_dim);
  if (got.tokens != want.tokens) return differ("tokens", got.tokens, want.tokens);
  if (got.position != want.position) return differ("position", got.position, want.position);
  if (got.dtype != want.dtype) {
    return differ("dtype", static_cast<int64_t>(got.dtype), static_cast<int64_t>(want.dtype));
  }
  return Status::Ok();
}

}  // namespace

void SliceLanding::Expect(uint64_t id, std::vector<ExpectedSlice> slices) {
  MutexLock lock(mu_);
  std::vector<uint64_t>& mine = by_request_[id];
  for (ExpectedSlice& s : slices) {
    const uint64_t ticket = next_ticket_++;
    uint64_t bytes = 0;
    for (const kvbus::Extent& x : s.extents) bytes += x.bytes;
    by_key_[s.info.key].push_back(ticket);
    mine.push_back(ticket);
    entries_.emplace(ticket, Entry{id, std::move(s), bytes, State::kWaiting});
    ++stats_.expected_now;
  }
}

SliceLanding::Settled SliceLanding::Forget(uint64_t id) {
  MutexLock lock(mu_);
  Settled out;
  auto mine = by_request_.find(id);
  if (mine == by_request_.end()) return out;
  for (uint64_t ticket : mine->second) {
    auto it = entries_.find(ticket);
    if (it == entries_.end()) continue;
    const Entry& e = it->second;
    if (e.state == State::kLanded) {
      out.landed.insert(e.slice.info.key);
    } else {
      --stats_.expected_now;
      if (e.state != State::kWaiting) out.unsafe = true;
    }
    auto& same = by_key_[e.slice.info.key];
    std::erase(same, ticket);
    if (same.empty()) by_key_.erase(e.slice.info.key);
    entries_.erase(it);
  }
  by_request_.erase(mine);
  return out;
}

LandingStats SliceLanding::Stats() const {
  MutexLock lock(mu_);
  return stats_;
}

std::optional<kvbus::Landing> SliceLanding::Claim(const kvbus::ChunkKey& key,
                                                  uint64_t payload_bytes) {
  MutexLock lock(mu_);
  auto same = by_key_.find(key);
  if (same == by_key_.end()) return std::nullopt;
  for (uint64_t ticket : same->second) {  // registered first, first
    Entry& e = entries_.at(ticket);
    if (e.state != State::kWaiting || e.payload_bytes != payload_bytes) continue;
    e.state = State::kClaimed;
    ++stats_.claims;
    return kvbus::Landing{ticket, e.slice.extents};
  }
  return std::nullopt;
}

Status SliceLanding::Landed(uint64_t ticket, const Result<kvbus::ChunkInfo>& arrived) {
  MutexLock lock(mu_);
  auto it = entries_.find(ticket);
  if (it == entries_.end()) {
    // Forgotten meanwhile (cancelled, timed out): its blocks are held back.
    return FailedPrecondition("the request this KV slice was for is gone");
  }
  Entry& e = it->second;
  if (!arrived.ok()) {
    e.state = State::kFailed;
    ++stats_.failed;
    return arrived.status();
  }
  if (Status st = Matches(*arrived, e.slice.info); !st.ok()) {
    e.state = State::kFailed;
    ++stats_.refused;
    return st;
  }
  e.state = State::kLanded;
  ++stats_.landed;
  stats_.landed_bytes += e.payload_bytes;
  --stats_.expected_now;
  return Status::Ok();
}

}  // namespace kdn::decode_worker
