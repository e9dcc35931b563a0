// The receiver's half of landing in place (kdn/kvbus/transport.h; docs/kvbus.md,
// "Landing in place"): a chunk its LandingSite claims is granted the site's
// extents, and its payload is verified where it lies (written there by the
// sender through a region plane) or put there from a tcp frame, never into
// the sink; both through the region's backend (kdn/kvbus/device_ops.h).

#include "kdn/common/log.h"
#include "transport_internal.h"

namespace kdn::kvbus {

void TcpReceiver::JoinLink(const std::string& peer, const std::string& id) {
  // Links land in a device region, written by no one else.
  if (!in_place_ || in_place_->kind() != RegionKind::kDevice || !options_.landing_by_plane) return;
  const auto it = links_.find(peer);
  if (it != links_.end() && it->second.id == id) return;
  if (const auto failed = failed_links_.find(peer);
      failed != failed_links_.end() && failed->second == id) {
    return;
  }
  // Each message waits at most as long as a silent connection is given.
  Result<std::unique_ptr<DeviceLink>> link =
      options_.landing_region->ops().JoinLink(id, 1, 5 * options_.heartbeat_interval);
  if (!link.ok()) {
    LogWarn("kvbus receiver: a sender's nccl link could not be joined ({})",
            link.status().ToString());
    failed_links_[peer] = id;
    outbox_[peer].dropped_link = id;
    return;
  }
  if (links_.size() >= kMaxLinks && links_.count(peer) == 0) {
    // The link of the peer heard from least recently goes (last_seen_
    // forgets silent peers: theirs go first).
    const auto heard = [&](const std::string& p) {
      const auto it = last_seen_.find(p);
      return it == last_seen_.end() ? TransportClock::time_point{} : it->second;
    };
    auto oldest = links_.begin();
    for (auto it = links_.begin(); it != links_.end(); ++it) {
      if (heard(it->first) < heard(oldest->first)) oldest = it;
    }
    const std::string evicted = oldest->first;
    outbox_[evicted].dropped_link = DropLink(evicted);
  }
  links_[peer] = PeerLink{id, std::move(link).value()};
}

std::string TcpReceiver::DropLink(const std::string& peer) {
  const auto it = links_.find(peer);
  if (it == links_.end()) return "";
  std::string id = std::move(it->second.id);
  failed_links_[peer] = id;
  links_.erase(it);
  return id;
}

DeviceLink* TcpReceiver::PeerLinkOf(const std::string& peer) {
  const auto it = links_.find(peer);
  return it == links_.end() || it->second.link->aborted() ? nullptr : it->second.link.get();
}

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
  lease.in_region = options_.landing_by_plane &&
                    (PeerWrites(peer, in_place_->plane()) || PeerLinkOf(peer) != nullptr);
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
  stats_.planes[!h.landed  ? "tcp"
                : h.linked ? kLinkPlaneName
                           : in_place_->plane()] +=
      PlaneStats{1, h.landed ? h.bytes : data->size()};
  std::string dropped_link;
  // A linked chunk granted for tcp leaves its payload on the link, which
  // is out of step from then on.
  if (h.linked && !lease.in_region) dropped_link = DropLink(peer);
  Result<ChunkInfo> arrived =
      h.landed && !lease.in_region
          ? Result<ChunkInfo>(FailedPrecondition(
                "chunk " + h.key.ToHex() + " said it landed in place, but was granted for tcp"))
      : h.linked ? ReceiveLinked(peer, h, *lease.in_place, &dropped_link)
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
  outbox_[peer].acks.push_back(WireAck{h.batch, h.key, std::move(st), false, dropped_link});
}

Result<ChunkInfo> TcpReceiver::ReceiveLinked(const std::string& peer, const WireChunkHeader& h,
                                             const Landing& claim, std::string* dropped) {
  DeviceLink* link = PeerLinkOf(peer);
  if (link == nullptr) {
    return FailedPrecondition("chunk " + h.key.ToHex() +
                              " said its payload comes over the nccl link, but none is up");
  }
  if (Status got = in_place_->Receive(*link, claim); !got.ok()) {
    // The link is done with (a half-read message leaves it unusable); the
    // ack tells the sender, which makes a new one.
    LogWarn("kvbus receiver: the nccl link with a sender ended ({})", got.ToString());
    *dropped = DropLink(peer);
    return got;
  }
  return in_place_->VerifyLanded(h, claim);
}

}  // namespace kdn::kvbus
