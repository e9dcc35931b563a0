// The receiver's half of landing in place (kdn/kvbus/transport.h; docs/kvbus.md,
// "Landing in place"): a chunk its LandingSite claims is granted the site's
// extents, and its payload is verified where it lies (written there by the
// sender through a region plane) or put there from a tcp frame, never into
// the sink; both through the region's backend (kdn/kvbus/device_ops.h).

#include <cstring>

#include "tcp_transport_internal.h"

namespace kdn::kvbus {

namespace {

uint64_t ClaimBytes(const Landing& claim) {
  uint64_t n = 0;
  for (const Extent& x : claim.extents) n += x.bytes;
  return n;
}

// What every landed chunk must be, whoever claimed it: the key offered, raw.
Status CheckArrived(const ChunkInfo& got, const ChunkKey& key) {
  if (got.key != key) {
    return Corruption("chunk announced as " + key.ToHex() + " carries key " + got.key.ToHex());
  }
  if (got.codec != KvCodec::kRaw) {
    return Corruption("chunk " + key.ToHex() + ": an encoded chunk cannot land in place");
  }
  return Status::Ok();
}

}  // namespace

void TcpReceiver::EndClaim(const Lease& lease, const Status& status) {
  if (lease.in_place) (void)options_.landing->Landed(lease.in_place->ticket, status);
}

WireDecision TcpReceiver::InPlaceDecision(const ChunkKey& key, const Lease& lease) const {
  WireDecision d{key, WireDecisionKind::kGranted, Status::Ok()};
  d.in_place = true;
  if (lease.in_region) {
    d.region = pool_region_;
    d.extents = lease.in_place->extents;
  }
  return d;
}

void TcpReceiver::GrantInPlace(const std::string& peer, uint64_t batch, const WireOfferEntry& e,
                               Landing claim, std::vector<WireDecision>& out) {
  // The site's extents are checked as a sender's grant would be: inside
  // the region, adding up to the payload.
  const uint64_t region = options_.landing_region->bytes();
  uint64_t total = 0;
  Status bad;
  for (const Extent& x : claim.extents) {
    if (x.offset > region || x.bytes > region - x.offset) {
      bad =
          Internal("landing site placed " + std::to_string(x.bytes) + " bytes at " +
                   std::to_string(x.offset) + ", outside its region of " + std::to_string(region));
      break;
    }
    total += x.bytes;
  }
  if (bad.ok() && total != e.bytes - Chunk::kHeaderBytes) {
    bad = InvalidArgument("chunk " + e.key.ToHex() + " offered with a payload of " +
                          std::to_string(e.bytes - Chunk::kHeaderBytes) +
                          " bytes, its landing holds " + std::to_string(total));
  }
  if (!bad.ok()) {
    (void)options_.landing->Landed(claim.ticket, bad);
    out.push_back(WireDecision{e.key, WireDecisionKind::kRejected, std::move(bad)});
    return;
  }
  const auto now = TransportClock::now();
  Lease lease{e.bytes, now + options_.lease};
  lease.in_region = options_.landing_by_plane && PeerWrites(peer, options_.landing_kind);
  lease.in_place = std::move(claim);
  const LeaseKey id{peer, batch, e.key};
  out.push_back(InPlaceDecision(e.key, lease));
  lease_deadlines_.emplace(lease.deadline, id);
  leases_.emplace(id, std::move(lease));
  ++leased_keys_[e.key];  // an offer of the key the site does not claim waits for it
  ++stats_.chunks_granted;
  ++stats_.in_place_claims;
}

Result<ChunkInfo> TcpReceiver::LandInPlace(const WireChunkHeader& h, const zmq::message_t* data,
                                           const Landing& claim) {
  uint8_t* const base = options_.landing_region->data();
  DeviceOps& ops = options_.landing_region->ops();
  if (h.landed) {
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
    KDN_ASSIGN_OR_RETURN(const uint64_t sum, ops.Checksum(base, claim.extents));
    if (sum != f.payload_checksum) {
      return Corruption("chunk " + h.key.ToHex() + ": payload checksum mismatch where it landed");
    }
    ++stats_.in_place_plane_chunks;
    if (options_.landing_kind == RegionKind::kShm) {
      stats_.shm_bytes += h.bytes;
      ++stats_.shm_chunks;
    }
    return f.info;
  }
  // The whole chunk came in the frame: verified there, then its payload
  // copied into place (the frame lives for this call: nothing keeps it).
  if (data->size() != h.bytes) {
    return Corruption("chunk " + h.key.ToHex() + ": " + std::to_string(data->size()) +
                      " bytes arrived, " + std::to_string(h.bytes) + " announced");
  }
  const auto* bytes = data->data<uint8_t>();
  KDN_ASSIGN_OR_RETURN(
      std::shared_ptr<const Chunk> chunk,
      Chunk::Parse(std::shared_ptr<const uint8_t>(std::shared_ptr<void>(), bytes), data->size()));
  KDN_RETURN_IF_ERROR(CheckArrived(chunk->info(), h.key));
  if (chunk->payload().size() != ClaimBytes(claim)) {
    return InvalidArgument("chunk " + h.key.ToHex() + " of " +
                           std::to_string(chunk->payload().size()) +
                           " payload bytes for a landing of " + std::to_string(ClaimBytes(claim)));
  }
  KDN_RETURN_IF_ERROR(ops.Upload(chunk->payload().data(), base, claim.extents));
  return chunk->info();
}

void TcpReceiver::HandleInPlace(const std::string& peer, const WireChunkHeader& h,
                                const zmq::message_t* data, const Lease& lease) {
  stats_.bytes_received += h.landed ? h.bytes : data->size();
  stats_.planes[h.landed ? PlaneName(options_.landing_kind) : "tcp"] +=
      PlaneStats{1, h.landed ? h.bytes : data->size()};
  Result<ChunkInfo> arrived =
      h.landed && !lease.in_region
          ? Result<ChunkInfo>(FailedPrecondition(
                "chunk " + h.key.ToHex() + " said it landed in place, but was granted for tcp"))
          : LandInPlace(h, data, *lease.in_place);
  Status st = options_.landing->Landed(lease.in_place->ticket, arrived);
  if (!arrived.ok()) st = arrived.status();
  if (st.ok()) {
    ++stats_.in_place_chunks;
    stats_.in_place_bytes += h.bytes - Chunk::kHeaderBytes;
  } else {
    ++stats_.chunks_rejected;
  }
  outbox_[peer].acks.push_back(WireAck{h.batch, h.key, std::move(st), false});
}

}  // namespace kdn::kvbus
