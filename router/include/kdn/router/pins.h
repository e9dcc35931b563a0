#pragma once
// Pins (docs/serving.md, "Pinning a prefix"): prompt prefixes that requests
// marked with `cache_control`, each kept from eviction for its TTL and
// refreshed by every request that reaches it. The workers hold the chunks
// (proto::KeepRequest, kvbus::ChunkStore::Keep); this book is the router's
// account of them: what each tenant pinned, within its byte bound, listed
// and dropped through /v1/kdn/pins.
//
// A pin is named by its prefix's last chunk key: keys are chained, so that
// key stands for the whole prefix, and the same prefix pinned twice is one
// pin. Tenants never see one another's pins (their keys differ anyway: the
// tenant fixes the namespace).
//
// Thread-safe: the backend thread pins and touches, HTTP threads list and
// drop; one mutex.

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kdn/common/mutex.h"
#include "kdn/common/status.h"
#include "kdn/kvbus/key.h"

namespace kdn::router {

struct PinInfo {
  std::string id;      // "pin-" and the 32 hex digits of its last chunk's key
  int64_t tokens = 0;  // the prefix pinned: whole chunks
  uint64_t bytes = 0;  // what it counts against its tenant's bound
  std::chrono::seconds ttl{0};
  int64_t created_at = 0;  // Unix seconds
  int64_t expires_at = 0;  // Unix seconds; refreshed by each hit
  uint64_t hits = 0;       // requests that reached it after it was made
};

// What the workers must be told: keep `keys` for `lease` (0: let them go).
struct KeepOrder {
  std::vector<kvbus::ChunkKey> keys;
  std::chrono::milliseconds lease{0};
};

class PinBook {
 public:
  using Clock = std::chrono::steady_clock;

  // `max_bytes_per_tenant`: the bound on the bytes of a tenant's live pins
  // (0: pinning is off, every pin refused).
  explicit PinBook(uint64_t max_bytes_per_tenant);

  struct Grant {
    PinInfo info;
    bool created = false;  // false: the prefix was pinned already (refreshed)
    KeepOrder order;       // for the workers
  };
  // Pins the prefix whose chunk keys are `keys` (a prompt's leading keys,
  // not empty) for `tenant`: `tokens` long, `bytes` against the bound, for
  // `ttl` from `now`. Pinned already: its deadline becomes the later of the
  // two, its TTL the longer. RESOURCE_EXHAUSTED, saying by how much, when a
  // new pin would take the tenant past its bound.
  Result<Grant> Pin(const std::string& tenant, std::vector<kvbus::ChunkKey> keys, int64_t tokens,
                    uint64_t bytes, std::chrono::seconds ttl, Clock::time_point now);

  struct Hit {
    PinInfo info;  // the longest pin the prompt reaches
    // Set when the workers' keep must be renewed: a pin's keep runs out in
    // less than three quarters of its TTL (a hit every moment sends one
    // renewal per quarter TTL, not one per request).
    std::vector<KeepOrder> renew;
  };
  // A request of `tenant` whose prompt's chunk keys are `keys`: every pin of
  // the tenant it reaches is refreshed (its deadline `now` + its TTL) and
  // counted a hit. Nullopt when it reaches none.
  std::optional<Hit> Touch(const std::string& tenant, std::span<const kvbus::ChunkKey> keys,
                           Clock::time_point now);

  // The tenant's live pins, longest first.
  std::vector<PinInfo> List(const std::string& tenant, Clock::time_point now);
  // Drops the tenant's pin `id` (every pin of the tenant when `id` is
  // empty). Returns what the workers must let go: the keys no live pin holds
  // any more. NOT_FOUND when the tenant has no such pin.
  Result<KeepOrder> Drop(const std::string& tenant, const std::string& id, Clock::time_point now);
  // Forgets pins past their deadline (the workers' keeps lapse by
  // themselves).
  void Expire(Clock::time_point now);

  struct Totals {
    uint64_t pins = 0;
    uint64_t bytes = 0;
    uint64_t hits = 0;     // requests that reached a pin
    uint64_t refused = 0;  // pins refused past a tenant's bound
  };
  Totals totals();

  uint64_t max_bytes_per_tenant() const { return max_bytes_; }

 private:
  struct Entry {
    std::vector<kvbus::ChunkKey> keys;
    PinInfo info;
    Clock::time_point deadline;
    Clock::time_point kept_until;  // the last keep sent to the workers runs out
  };
  struct Tenant {
    std::map<kvbus::ChunkKey, Entry> pins;  // by last key
    uint64_t bytes = 0;
  };

  void ExpireLocked(Clock::time_point now) KDN_REQUIRES(mu_);
  void EraseLocked(Tenant& t, std::map<kvbus::ChunkKey, Entry>::iterator it) KDN_REQUIRES(mu_);
  static int64_t UnixAt(Clock::time_point t, Clock::time_point now);

  const uint64_t max_bytes_;
  Mutex mu_;
  std::map<std::string, Tenant> tenants_ KDN_GUARDED_BY(mu_);
  uint64_t hits_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t refused_ KDN_GUARDED_BY(mu_) = 0;
};

// The TTL of a `cache_control` object's "ttl": "5m" and "1h" as Anthropic
// takes them, and any whole number of seconds, minutes or hours ("90s",
// "10m", "2h") from kMinPinTtl to kMaxPinTtl. Nullopt for anything else.
inline constexpr std::chrono::seconds kMinPinTtl{1};
inline constexpr std::chrono::seconds kMaxPinTtl{24 * 3600};
inline constexpr std::chrono::seconds kDefaultPinTtl{300};
std::optional<std::chrono::seconds> ParsePinTtl(const std::string& text);

}  // namespace kdn::router
