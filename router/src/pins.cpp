#include "kdn/router/pins.h"

#include <algorithm>
#include <charconv>
#include <set>

namespace kdn::router {

namespace {

std::string PinId(const kvbus::ChunkKey& last) { return "pin-" + last.ToHex(); }

std::string MiB(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

std::chrono::milliseconds Lease(std::chrono::seconds ttl) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(ttl);
}

}  // namespace

PinBook::PinBook(uint64_t max_bytes_per_tenant) : max_bytes_(max_bytes_per_tenant) {}

int64_t PinBook::UnixAt(Clock::time_point t, Clock::time_point now) {
  const auto unix_now = std::chrono::system_clock::now().time_since_epoch();
  return std::chrono::duration_cast<std::chrono::seconds>(unix_now + (t - now)).count();
}

void PinBook::EraseLocked(Tenant& t, std::map<kvbus::ChunkKey, Entry>::iterator it) {
  t.bytes -= it->second.info.bytes;
  t.pins.erase(it);
}

void PinBook::ExpireLocked(Clock::time_point now) {
  for (auto t = tenants_.begin(); t != tenants_.end();) {
    for (auto it = t->second.pins.begin(); it != t->second.pins.end();) {
      auto next = std::next(it);
      if (it->second.deadline <= now) EraseLocked(t->second, it);
      it = next;
    }
    t = t->second.pins.empty() ? tenants_.erase(t) : std::next(t);
  }
}

Result<PinBook::Grant> PinBook::Pin(const std::string& tenant, std::vector<kvbus::ChunkKey> keys,
                                    int64_t tokens, uint64_t bytes, std::chrono::seconds ttl,
                                    Clock::time_point now) {
  if (keys.empty()) return InvalidArgument("a pin needs at least one whole chunk");
  MutexLock lock(mu_);
  ExpireLocked(now);
  Tenant& t = tenants_[tenant];
  const kvbus::ChunkKey last = keys.back();
  Grant g;
  if (auto it = t.pins.find(last); it != t.pins.end()) {
    Entry& e = it->second;
    e.info.ttl = std::max(e.info.ttl, ttl);
    e.deadline = std::max(e.deadline, now + ttl);
    e.info.expires_at = UnixAt(e.deadline, now);
    if (e.deadline > e.kept_until) {  // the workers' keep must reach further
      e.kept_until = e.deadline;
      g.order = {e.keys, std::chrono::duration_cast<std::chrono::milliseconds>(e.deadline - now)};
    }
    g.info = e.info;
    return g;
  }
  {
    if (t.bytes + bytes > max_bytes_) {
      ++refused_;
      if (t.pins.empty()) tenants_.erase(tenant);
      if (max_bytes_ == 0) {
        return ResourceExhausted(
            "this router pins no prefixes (--max-pinned-mib 0): send the request without "
            "cache_control");
      }
      return ResourceExhausted(
          "pinning this prefix (" + std::to_string(tokens) + " tokens, " + MiB(bytes) +
          ") would take the tenant's pinned KV to " + MiB(t.bytes + bytes) +
          ", past its bound of " + MiB(max_bytes_) +
          "; drop pins with DELETE /v1/kdn/pins/ID or send the request without cache_control");
    }
    Entry e;
    e.info.id = PinId(last);
    e.info.tokens = tokens;
    e.info.bytes = bytes;
    e.info.ttl = ttl;
    e.info.created_at = UnixAt(now, now);
    e.deadline = now + ttl;
    e.keys = std::move(keys);
    t.bytes += bytes;
    e.info.expires_at = UnixAt(e.deadline, now);
    e.kept_until = e.deadline;
    g.created = true;
    g.info = e.info;
    g.order = {e.keys, Lease(ttl)};
    t.pins.emplace(last, std::move(e));
  }
  return g;
}

std::optional<PinBook::Hit> PinBook::Touch(const std::string& tenant,
                                           std::span<const kvbus::ChunkKey> keys,
                                           Clock::time_point now) {
  MutexLock lock(mu_);
  ExpireLocked(now);
  auto t = tenants_.find(tenant);
  if (t == tenants_.end()) return std::nullopt;
  std::optional<Hit> hit;
  for (const kvbus::ChunkKey& k : keys) {
    auto it = t->second.pins.find(k);
    if (it == t->second.pins.end()) continue;
    Entry& e = it->second;
    e.deadline = now + e.info.ttl;
    e.info.expires_at = UnixAt(e.deadline, now);
    ++e.info.hits;
    if (!hit) hit.emplace();
    if (e.kept_until - now < e.info.ttl * 3 / 4) {
      e.kept_until = e.deadline;
      hit->renew.push_back({e.keys, Lease(e.info.ttl)});
    }
    if (e.info.tokens >= hit->info.tokens) hit->info = e.info;
  }
  if (hit) ++hits_;
  return hit;
}

std::vector<PinInfo> PinBook::List(const std::string& tenant, Clock::time_point now) {
  MutexLock lock(mu_);
  ExpireLocked(now);
  std::vector<PinInfo> out;
  if (auto t = tenants_.find(tenant); t != tenants_.end()) {
    for (const auto& [last, e] : t->second.pins) out.push_back(e.info);
  }
  std::sort(out.begin(), out.end(), [](const PinInfo& a, const PinInfo& b) {
    return a.tokens != b.tokens ? a.tokens > b.tokens : a.id < b.id;
  });
  return out;
}

Result<KeepOrder> PinBook::Drop(const std::string& tenant, const std::string& id,
                                Clock::time_point now) {
  MutexLock lock(mu_);
  ExpireLocked(now);
  auto t = tenants_.find(tenant);
  std::vector<kvbus::ChunkKey> dropped;
  if (t != tenants_.end()) {
    for (auto it = t->second.pins.begin(); it != t->second.pins.end();) {
      auto next = std::next(it);
      if (id.empty() || it->second.info.id == id) {
        dropped.insert(dropped.end(), it->second.keys.begin(), it->second.keys.end());
        EraseLocked(t->second, it);
      }
      it = next;
    }
    if (t->second.pins.empty()) tenants_.erase(t);
  }
  if (dropped.empty() && !id.empty()) return NotFound("no pin " + id);
  // What another live pin holds stays kept (a shorter prefix of a longer
  // pin, or the same prefix pinned by another tenant without API keys).
  std::set<kvbus::ChunkKey> held;
  for (const auto& [name, other] : tenants_) {
    for (const auto& [last, e] : other.pins) held.insert(e.keys.begin(), e.keys.end());
  }
  KeepOrder order;
  std::set<kvbus::ChunkKey> seen;
  for (const kvbus::ChunkKey& k : dropped) {
    if (held.count(k) == 0 && seen.insert(k).second) order.keys.push_back(k);
  }
  return order;
}

void PinBook::Expire(Clock::time_point now) {
  MutexLock lock(mu_);
  ExpireLocked(now);
}

PinBook::Totals PinBook::totals() {
  MutexLock lock(mu_);
  Totals s;
  for (const auto& [name, t] : tenants_) {
    s.pins += t.pins.size();
    s.bytes += t.bytes;
  }
  s.hits = hits_;
  s.refused = refused_;
  return s;
}

std::optional<std::chrono::seconds> ParsePinTtl(const std::string& text) {
  if (text.size() < 2) return std::nullopt;
  int64_t n = 0;
  const char* end = text.data() + text.size() - 1;
  auto [p, ec] = std::from_chars(text.data(), end, n);
  if (ec != std::errc() || p != end || n <= 0 || n > kMaxPinTtl.count()) return std::nullopt;
  int64_t unit = 0;
  switch (text.back()) {
    case 's': unit = 1; break;
    case 'm': unit = 60; break;
    case 'h': unit = 3600; break;
    default: return std::nullopt;
  }
  const std::chrono::seconds ttl(n * unit);
  if (ttl < kMinPinTtl || ttl > kMaxPinTtl) return std::nullopt;
  return ttl;
}

}  // namespace kdn::router
