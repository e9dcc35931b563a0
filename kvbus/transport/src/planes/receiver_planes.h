#pragma once
// Private to the kvbus transports: the receiver's halves of the region
// planes, as data_plane.h holds the sender's (docs/kvbus.md, "Transports"
// and "Landing in place"). TcpReceiver runs the protocol (offers, leases,
// acks) and takes tcp frames itself; what a region plane needs on the
// receiving side lives here:
//   ShmLanding     the shm landing segment: its ranges, granted and freed,
//                  and the ranges held back after an expired grant;
//   RegionLanding  a landing site's region (shm or device kind): the
//                  site's claims checked against it, a payload a sender's
//                  plane wrote there (or the nccl plane's link brought)
//                  verified where it lies, and a tcp frame's payload
//                  written there, through the region's backend
//                  (kdn/kvbus/device_ops.h).
//
// Not thread-safe: the receiver's I/O thread owns them.

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <zmq.hpp>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/region_plane.h"
#include "kdn/kvbus/transport.h"
#include "kdn/kvbus/shared_segment.h"
#include "kdn/kvbus/wire.h"

namespace kdn::kvbus {

class ShmLanding {
 public:
  using Clock = std::chrono::steady_clock;
  // A segment of `bytes` (at least RangeAllocator::kAlign), named by a
  // region id of its own: a sender never mistakes a new receiver's segment
  // at the same endpoint for an old one it mapped. INVALID_ARGUMENT for a
  // smaller size; IO_ERROR if the segment cannot be made.
  static Result<std::unique_ptr<ShmLanding>> Create(uint64_t bytes);

  uint32_t region() const { return region_; }
  WireRegion Descriptor() const;
  const uint8_t* data() const { return segment_->data(); }
  uint64_t used_bytes() const { return ranges_.used_bytes(); }

  // The offset of a free range of `bytes`, or none (the chunk goes by tcp).
  std::optional<uint64_t> Allocate(uint64_t bytes) { return ranges_.Allocate(bytes); }
  // Gives [offset, +bytes) back now, or (`hold_until`) once that time has
  // passed: a sender whose grant expired may still be writing there.
  void Free(uint64_t offset, uint64_t bytes, std::optional<Clock::time_point> hold_until);
  // Frees what was held back until `now` or before.
  void EndQuarantine(Clock::time_point now);
  // When the next held-back range is due, if any.
  std::optional<Clock::time_point> next_release() const;

 private:
  ShmLanding(std::unique_ptr<SharedSegment> segment, uint32_t region)
      : segment_(std::move(segment)), ranges_(segment_->bytes()), region_(region) {}

  std::unique_ptr<SharedSegment> segment_;
  RangeAllocator ranges_;
  const uint32_t region_;
  std::multimap<Clock::time_point, std::pair<uint64_t, uint64_t>> quarantine_;
};

class RegionLanding {
 public:
  // `memory` is the site's region, of memory of `kind`, written by
  // senders' plane named `plane`; `region` its id in grants. `memory` is
  // borrowed (ReceiverOptions).
  RegionLanding(const DeviceMemory& memory, RegionKind kind, std::string plane, uint32_t region)
      : memory_(memory), kind_(kind), plane_(std::move(plane)), region_(region) {}

  uint32_t region() const { return region_; }
  RegionKind kind() const { return kind_; }
  const std::string& plane() const { return plane_; }
  WireRegion Descriptor() const {
    return WireRegion{region_, memory_.bytes(), memory_.handle(), plane_};
  }

  // OK when `claim`'s extents lie inside the region and hold exactly
  // `payload_bytes`: INTERNAL (the site's error) for an extent outside it,
  // INVALID_ARGUMENT for a total that differs from what `key` was offered
  // with.
  Status CheckClaim(const Landing& claim, const ChunkKey& key, uint64_t payload_bytes) const;
  // A payload a sender's plane wrote into `claim`: the header `h` carried
  // parsed, the key the one offered, the chunk raw, its size the header's,
  // and the payload's checksum where it lies. The chunk's info, or why not.
  Result<ChunkInfo> VerifyLanded(const WireChunkHeader& h, const Landing& claim) const;
  // The next message of `link` (the nccl plane) received onto `claim`'s
  // extents, to be verified there as a landed one.
  Status Receive(DeviceLink& link, const Landing& claim) const {
    return link.Recv(memory_.data(), claim.extents);
  }
  // The whole chunk `h` announced, in a tcp frame: verified there, then its
  // payload written into `claim`. The chunk's info, or why not (nothing is
  // written then).
  Result<ChunkInfo> Fill(const WireChunkHeader& h, const zmq::message_t& data,
                         const Landing& claim) const;

 private:
  const DeviceMemory& memory_;
  const RegionKind kind_;
  const std::string plane_;
  const uint32_t region_;
};

}  // namespace kdn::kvbus
