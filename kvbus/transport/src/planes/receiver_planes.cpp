// The receiver's halves of the region planes (receiver_planes.h).

#include "receiver_planes.h"

#include <random>
#include <string>

namespace kdn::kvbus {

// ---- ShmLanding ---------------------------------------------------------------

Result<std::unique_ptr<ShmLanding>> ShmLanding::Create(uint64_t bytes) {
  if (bytes < RangeAllocator::kAlign) {
    return InvalidArgument("kvbus receiver: shm_landing_bytes must be 0 or at least 4096");
  }
  KDN_ASSIGN_OR_RETURN(std::unique_ptr<SharedSegment> segment, SharedSegment::Create(bytes));
  const auto region = static_cast<uint32_t>(std::random_device{}() | 1u);
  return std::unique_ptr<ShmLanding>(new ShmLanding(std::move(segment), region));
}

WireRegion ShmLanding::Descriptor() const {
  return WireRegion{region_, segment_->bytes(), segment_->handle(), kShmPlaneName};
}

void ShmLanding::Free(uint64_t offset, uint64_t bytes,
                      std::optional<Clock::time_point> hold_until) {
  if (hold_until) {
    quarantine_.emplace(*hold_until, std::make_pair(offset, bytes));
  } else {
    ranges_.Free(offset, bytes);
  }
}

void ShmLanding::EndQuarantine(Clock::time_point now) {
  while (!quarantine_.empty() && quarantine_.begin()->first <= now) {
    const auto [offset, bytes] = quarantine_.begin()->second;
    ranges_.Free(offset, bytes);
    quarantine_.erase(quarantine_.begin());
  }
}

std::optional<ShmLanding::Clock::time_point> ShmLanding::next_release() const {
  if (quarantine_.empty()) return std::nullopt;
  return quarantine_.begin()->first;
}

// ---- RegionLanding ------------------------------------------------------------

namespace {

uint64_t ClaimBytes(const Landing& claim) {
  uint64_t n = 0;
  for (const Extent& x : claim.extents) n += x.bytes;
  return n;
}

// What every landed chunk must be, whoever claimed it: the key offered, raw
// KV with nothing between its header and its KV.
Status CheckArrived(const ChunkInfo& got, const ChunkKey& key) {
  if (got.key != key) {
    return Corruption("chunk announced as " + key.ToHex() + " carries key " + got.key.ToHex());
  }
  if (got.codec != KvCodec::kRaw || got.pruned() || got.is_steering()) {
    return Corruption("chunk " + key.ToHex() +
                      ": an encoded, pruned or steering chunk cannot land in place");
  }
  return Status::Ok();
}

}  // namespace

Status RegionLanding::CheckClaim(const Landing& claim, const ChunkKey& key,
                                 uint64_t payload_bytes) const {
  // The site's extents are checked as a sender's grant would be: inside
  // the region, adding up to the payload.
  const uint64_t region = memory_.bytes();
  for (const Extent& x : claim.extents) {
    if (x.offset > region || x.bytes > region - x.offset) {
      return Internal("landing site placed " + std::to_string(x.bytes) + " bytes at " +
                      std::to_string(x.offset) + ", outside its region of " +
                      std::to_string(region));
    }
  }
  if (const uint64_t total = ClaimBytes(claim); total != payload_bytes) {
    return InvalidArgument("chunk " + key.ToHex() + " offered with a payload of " +
                           std::to_string(payload_bytes) + " bytes, its landing holds " +
                           std::to_string(total));
  }
  return Status::Ok();
}

Result<ChunkInfo> RegionLanding::VerifyLanded(const WireChunkHeader& h,
                                              const Landing& claim) const {
  // The sender wrote the payload into the extents; the header came here.
  KDN_ASSIGN_OR_RETURN(
      ChunkHeaderFields f,
      Chunk::ParseHeader({reinterpret_cast<const uint8_t*>(h.header.data()), h.header.size()}));
  KDN_RETURN_IF_ERROR(CheckArrived(f.info, h.key));
  if (h.bytes != Chunk::kHeaderBytes + f.payload_bytes) {
    return InvalidArgument("chunk " + h.key.ToHex() + " landed " + std::to_string(h.bytes) +
                           " bytes, its header says " +
                           std::to_string(Chunk::kHeaderBytes + f.payload_bytes));
  }
  KDN_ASSIGN_OR_RETURN(const uint64_t sum, memory_.ops().Checksum(memory_.data(), claim.extents));
  if (sum != f.payload_checksum) {
    return Corruption("chunk " + h.key.ToHex() + ": payload checksum mismatch where it landed");
  }
  return f.info;
}

Result<ChunkInfo> RegionLanding::Fill(const WireChunkHeader& h, const zmq::message_t& data,
                                      const Landing& claim) const {
  // Verified in the frame, then its payload written into place (the frame
  // lives for this call: nothing keeps it).
  if (data.size() != h.bytes) {
    return Corruption("chunk " + h.key.ToHex() + ": " + std::to_string(data.size()) +
                      " bytes arrived, " + std::to_string(h.bytes) + " announced");
  }
  const auto* bytes = data.data<uint8_t>();
  KDN_ASSIGN_OR_RETURN(
      std::shared_ptr<const Chunk> chunk,
      Chunk::Parse(std::shared_ptr<const uint8_t>(std::shared_ptr<void>(), bytes), data.size()));
  KDN_RETURN_IF_ERROR(CheckArrived(chunk->info(), h.key));
  if (chunk->payload().size() != ClaimBytes(claim)) {
    return InvalidArgument("chunk " + h.key.ToHex() + " of " +
                           std::to_string(chunk->payload().size()) +
                           " payload bytes for a landing of " + std::to_string(ClaimBytes(claim)));
  }
  KDN_RETURN_IF_ERROR(memory_.ops().Upload(chunk->payload().data(), memory_.data(), claim.extents));
  return chunk->info();
}

}  // namespace kdn::kvbus
