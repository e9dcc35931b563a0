// The receiver's half of landing in place (kdn/kvbus/transport.h; docs/kvbus.md,
// "Landing in place"): a chunk its LandingSite claims is granted the site's
// extents, and its payload is verified where it lies (written there by the
// sender through a region plane) or put there from a tcp frame, never into
// the sink; both through the region's backend (kdn/kvbus/device_ops.h).

#include "tcp_transport_internal.h"

namespace kdn::kvbus {

void TcpReceiver::EndClaim(const Lease& lease, const Status& status) {
  if (lease.in_place) (void)options_.landing->Landed(lease.in_place->ticket, status);
}

WireDecision TcpReceiver::InPlaceDecision(const ChunkKey& key, const Lease& lease) const {
  WireDecision d{key, WireDecisionKind::kGranted, Status::Ok()};
  d.in_place = true;
  if (lease.in_region) {
    d.region = in_place_->region();
    d.extents = lease.in_place->extents;
  }
  return d;
}

void TcpReceiver::GrantInPlace(const std::string& peer, uint64_t batch, const WireOfferEntry& e,
                               Landing claim, std::vector<WireDecision>& out) {
  Status bad = in_place_->CheckClaim(claim, e.key, e.bytes - Chunk::kHeaderBytes);
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

void TcpReceiver::HandleInPlace(const std::string& peer, const WireChunkHeader& h,
                                const zmq::message_t* data, const Lease& lease) {
  stats_.bytes_received += h.landed ? h.bytes : data->size();
  stats_.planes[h.landed ? PlaneName(options_.landing_kind) : "tcp"] +=
      PlaneStats{1, h.landed ? h.bytes : data->size()};
  Result<ChunkInfo> arrived =
      h.landed && !lease.in_region
          ? Result<ChunkInfo>(FailedPrecondition(
                "chunk " + h.key.ToHex() + " said it landed in place, but was granted for tcp"))
      : h.landed ? in_place_->VerifyLanded(h, *lease.in_place)
                 : in_place_->Fill(h, *data, *lease.in_place);
  Status st = options_.landing->Landed(lease.in_place->ticket, arrived);
  if (!arrived.ok()) st = arrived.status();
  if (arrived.ok() && h.landed) {
    ++stats_.in_place_plane_chunks;
    if (in_place_->kind() == RegionKind::kShm) {
      stats_.shm_bytes += h.bytes;
      ++stats_.shm_chunks;
    }
  }
  if (st.ok()) {
    ++stats_.in_place_chunks;
    stats_.in_place_bytes += h.bytes - Chunk::kHeaderBytes;
  } else {
    ++stats_.chunks_rejected;
  }
  outbox_[peer].acks.push_back(WireAck{h.batch, h.key, std::move(st), false});
}

}  // namespace kdn::kvbus
