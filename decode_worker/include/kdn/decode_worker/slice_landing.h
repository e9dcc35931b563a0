#pragma once
// SliceLanding: where the layer slices a prefill worker pushes land in the
// decode worker (docs/kvbus.md, "Landing in place"). When a prepared
// request's load is in, the Decoder knows which slices will come (the
// regions past the tokens it holds, times the layers) and which of its
// reserved KV blocks each fills; it registers them here, and the kvbus
// receiver, to which this is the LandingSite, has each offered slice's
// payload written straight into those blocks (by the sender over shm, or
// by the receiver from a tcp frame), verified there. At Start the Decoder
// takes what landed and copies nothing for it.
//
// A key expected by two requests (one prefix, two requests prepared here)
// is claimed once for each, first registered first. A slice that arrives
// with another shape, position, dtype or model than expected is refused
// (CORRUPTION to the sender). A request forgotten while a claim of its is
// unsettled, or ended without landing, may still have a sender writing
// into its blocks: Forget says so, and the Decoder holds those blocks back
// for a lease before it reuses them.
//
// Thread-safe: the Decoder's thread registers and forgets, the receiver's
// I/O thread claims and settles.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <unordered_map>
#include <vector>

#include "kdn/common/mutex.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/transport.h"

namespace kdn::decode_worker {

struct ExpectedSlice {
  kvbus::ChunkInfo info;               // key, fingerprint, shape, dtype, position
  std::vector<kvbus::Extent> extents;  // its payload's place in the pool
};

struct LandingStats {
  uint64_t claims = 0;        // slices claimed by a transfer
  uint64_t landed = 0;        // landed and verified in place
  uint64_t landed_bytes = 0;  // their payloads
  uint64_t refused = 0;       // arrived with another shape than expected
  uint64_t failed = 0;        // claims that ended without landing
  uint64_t expected_now = 0;  // registered and not yet landed, now
};

class SliceLanding final : public kvbus::LandingSite {
 public:
  // The slices request `id` (the Decoder's) expects. A request registers once.
  void Expect(uint64_t id, std::vector<ExpectedSlice> slices) KDN_EXCLUDES(mu_);
  // What request `id` has, as it leaves: the keys of its slices that landed,
  // and whether a sender may still write into its blocks (a claim not
  // settled, or settled without landing).
  struct Settled {
    std::set<kvbus::ChunkKey> landed;
    bool unsafe = false;
  };
  Settled Forget(uint64_t id) KDN_EXCLUDES(mu_);
  LandingStats Stats() const KDN_EXCLUDES(mu_);

  // kvbus::LandingSite (the receiver's I/O thread).
  std::optional<kvbus::Landing> Claim(const kvbus::ChunkKey& key, uint64_t payload_bytes) override
      KDN_EXCLUDES(mu_);
  Status Landed(uint64_t ticket, const Result<kvbus::ChunkInfo>& arrived) override
      KDN_EXCLUDES(mu_);

 private:
  enum class State : uint8_t { kWaiting, kClaimed, kLanded, kFailed };
  struct Entry {
    uint64_t request = 0;
    ExpectedSlice slice;
    uint64_t payload_bytes = 0;
    State state = State::kWaiting;
  };
  mutable Mutex mu_;
  uint64_t next_ticket_ KDN_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, Entry> entries_ KDN_GUARDED_BY(mu_);  // by ticket, registered first first
  std::unordered_map<kvbus::ChunkKey, std::vector<uint64_t>, kvbus::ChunkKeyHash> by_key_
      KDN_GUARDED_BY(mu_);
  std::map<uint64_t, std::vector<uint64_t>> by_request_ KDN_GUARDED_BY(mu_);
  LandingStats stats_ KDN_GUARDED_BY(mu_);
};

}  // namespace kdn::decode_worker
