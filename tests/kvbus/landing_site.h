#pragma once
// A LandingSite for tests (kdn/kvbus/transport.h, "Landing in place"): it
// claims every key its sink does not hold, lands each payload scattered in
// a region of the host backend (a few pieces, in reverse order, as a decode worker's
// blocks lie), and on a verified landing gathers the pieces into a chunk
// and Puts it into the sink, so that the conformance suite, which checks
// the sink, runs unchanged over landing in place. Claims take no slot
// capacity; so that the suite's tests of slot capacity still mean
// something, the site claims at most `budget` bytes at once (the
// receiver's slot capacity) and leaves the rest to the sink's path.
//
// InPlaceReceiver wraps a receiver with such a site and owns both.

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "kdn/kvbus/shared_segment.h"
#include "kdn/common/mutex.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/transport.h"

namespace kdn::kvbus::testing {

class SinkLandingSite final : public LandingSite {
 public:
  SinkLandingSite(ChunkStore& sink, const DeviceMemory& segment, uint64_t budget)
      : sink_(sink), segment_(segment), budget_(budget), ranges_(segment.bytes()) {}

  std::optional<Landing> Claim(const ChunkKey& key, uint64_t payload_bytes) override {
    MutexLock lock(mu_);
    ++claims_asked_;
    if (payload_bytes == 0 || keys_.count(key) != 0 || sink_.Contains(key) ||
        claimed_bytes_ + payload_bytes > budget_) {
      return std::nullopt;
    }
    std::optional<uint64_t> at = ranges_.Allocate(payload_bytes);
    if (!at) return std::nullopt;
    Landing l{next_ticket_++, {}};
    // Up to three pieces, the last part of the range first.
    const uint64_t piece = (payload_bytes + 2) / 3;
    for (uint64_t end = payload_bytes; end > 0;) {
      const uint64_t begin = end > piece ? end - piece : 0;
      l.extents.push_back({*at + begin, end - begin});
      end = begin;
    }
    std::reverse(l.extents.begin(), l.extents.end());
    std::rotate(l.extents.begin(), l.extents.end() - 1, l.extents.end());
    claims_[l.ticket] = {key, *at, payload_bytes, l.extents};
    keys_.insert(key);
    claimed_bytes_ += payload_bytes;
    return l;
  }

  Status Landed(uint64_t ticket, const Result<ChunkInfo>& arrived) override {
    MutexLock lock(mu_);
    auto it = claims_.find(ticket);
    if (it == claims_.end()) return Internal("unknown ticket");
    const Claimed c = it->second;
    claims_.erase(it);
    keys_.erase(c.key);
    Status st = arrived.status();
    if (arrived.ok()) {
      ++landed_;
      auto chunk = Chunk::Build(*arrived, [&](uint8_t* out) {
        for (const Extent& x : c.extents) {
          std::memcpy(out, segment_.data() + x.offset, x.bytes);
          out += x.bytes;
        }
      });
      st = chunk.ok() ? sink_.Put(*chunk) : chunk.status();
    } else {
      ++failed_;
    }
    ranges_.Free(c.offset, c.bytes);
    claimed_bytes_ -= c.bytes;
    return st;
  }

  uint64_t landed() const {
    MutexLock lock(mu_);
    return landed_;
  }
  uint64_t failed() const {
    MutexLock lock(mu_);
    return failed_;
  }
  size_t open_claims() const {
    MutexLock lock(mu_);
    return claims_.size();
  }

 private:
  struct Claimed {
    ChunkKey key;
    uint64_t offset = 0, bytes = 0;
    std::vector<Extent> extents;
  };
  ChunkStore& sink_;
  const DeviceMemory& segment_;
  const uint64_t budget_;
  mutable Mutex mu_;
  uint64_t claimed_bytes_ KDN_GUARDED_BY(mu_) = 0;
  RangeAllocator ranges_ KDN_GUARDED_BY(mu_);
  std::map<uint64_t, Claimed> claims_ KDN_GUARDED_BY(mu_);
  std::set<ChunkKey> keys_ KDN_GUARDED_BY(mu_);
  uint64_t next_ticket_ KDN_GUARDED_BY(mu_) = 1;
  uint64_t claims_asked_ KDN_GUARDED_BY(mu_) = 0;
  uint64_t landed_ KDN_GUARDED_BY(mu_) = 0, failed_ KDN_GUARDED_BY(mu_) = 0;
};

// A receiver whose chunks land in place through a SinkLandingSite.
class InPlaceReceiver final : public Receiver {
 public:
  // The site's region is host memory of `kind`: shm, or a device region
  // that the host backend stands in for (written by kCudaIpc senders).
  static Result<std::unique_ptr<Receiver>> Listen(ChunkStore& sink, ReceiverOptions o,
                                                  uint64_t segment_bytes,
                                                  RegionKind kind = RegionKind::kShm) {
    std::unique_ptr<InPlaceReceiver> r(new InPlaceReceiver());
    KDN_ASSIGN_OR_RETURN(r->segment_, HostDeviceOps().Allocate(segment_bytes));
    r->site_ = std::make_unique<SinkLandingSite>(sink, *r->segment_, o.slot_capacity_bytes);
    // What the site does not claim lands in a segment of its own for shm
    // senders, as in the shm instantiation.
    if (o.shm_landing_bytes == 0) o.shm_landing_bytes = segment_bytes;
    o.landing = r->site_.get();
    o.landing_region = r->segment_.get();
    o.landing_kind = kind;
    KDN_ASSIGN_OR_RETURN(r->inner_, kvbus::Listen("tcp://127.0.0.1:0", sink, o));
    return std::unique_ptr<Receiver>(std::move(r));
  }
  ~InPlaceReceiver() override { inner_.reset(); }  // before the site and the segment
  std::string endpoint() const override { return inner_->endpoint(); }
  ReceiverStats Stats() const override { return inner_->Stats(); }
  Status Health() const override { return inner_->Health(); }
  const SinkLandingSite& site() const { return *site_; }

 private:
  InPlaceReceiver() = default;
  std::unique_ptr<DeviceMemory> segment_;
  std::unique_ptr<SinkLandingSite> site_;
  std::unique_ptr<Receiver> inner_;
};

}  // namespace kdn::kvbus::testing
