#include "kdn/kvbus/wire.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "kvbus_transport.pb.h"
#include "kdn/net/zmq_check.h"

namespace kdn::kvbus {

namespace {

namespace pb = ::kdn::proto;

pb::TransportCode CodeToWire(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return pb::TRANSPORT_CODE_OK;
    case StatusCode::kInvalidArgument: return pb::TRANSPORT_CODE_INVALID_ARGUMENT;
    case StatusCode::kNotFound: return pb::TRANSPORT_CODE_NOT_FOUND;
    case StatusCode::kCorruption: return pb::TRANSPORT_CODE_CORRUPTION;
    case StatusCode::kUnimplemented: return pb::TRANSPORT_CODE_UNIMPLEMENTED;
    case StatusCode::kResourceExhausted: return pb::TRANSPORT_CODE_RESOURCE_EXHAUSTED;
    case StatusCode::kFailedPrecondition: return pb::TRANSPORT_CODE_FAILED_PRECONDITION;
    case StatusCode::kUnavailable: return pb::TRANSPORT_CODE_UNAVAILABLE;
    case StatusCode::kDeadlineExceeded: return pb::TRANSPORT_CODE_DEADLINE_EXCEEDED;
    case StatusCode::kInternal: return pb::TRANSPORT_CODE_INTERNAL;
    case StatusCode::kIoError: return pb::TRANSPORT_CODE_IO_ERROR;
  }
  return pb::TRANSPORT_CODE_INTERNAL;
}

// Proto3 enums are open: a code this build does not know is INTERNAL.
StatusCode CodeFromWire(int code) {
  switch (code) {
    case pb::TRANSPORT_CODE_OK: return StatusCode::kOk;
    case pb::TRANSPORT_CODE_INVALID_ARGUMENT: return StatusCode::kInvalidArgument;
    case pb::TRANSPORT_CODE_NOT_FOUND: return StatusCode::kNotFound;
    case pb::TRANSPORT_CODE_CORRUPTION: return StatusCode::kCorruption;
    case pb::TRANSPORT_CODE_UNIMPLEMENTED: return StatusCode::kUnimplemented;
    case pb::TRANSPORT_CODE_RESOURCE_EXHAUSTED: return StatusCode::kResourceExhausted;
    case pb::TRANSPORT_CODE_FAILED_PRECONDITION: return StatusCode::kFailedPrecondition;
    case pb::TRANSPORT_CODE_UNAVAILABLE: return StatusCode::kUnavailable;
    case pb::TRANSPORT_CODE_DEADLINE_EXCEEDED: return StatusCode::kDeadlineExceeded;
    case pb::TRANSPORT_CODE_INTERNAL: return StatusCode::kInternal;
    case pb::TRANSPORT_CODE_IO_ERROR: return StatusCode::kIoError;
    default: return StatusCode::kInternal;
  }
}

Status StatusFromWire(int code, const std::string& message) {
  const StatusCode c = CodeFromWire(code);
  if (c == StatusCode::kOk) return Status::Ok();
  return Status(c, "receiver: " + message);
}

template <typename P>
ChunkKey KeyOf(const P& p) {
  return ChunkKey{p.key_hi(), p.key_lo()};
}

template <typename P>
void SetKey(P* p, const ChunkKey& k) {
  p->set_key_hi(k.hi);
  p->set_key_lo(k.lo);
}

void Fill(const WireOffer& m, pb::TransportFrame& f) {
  pb::Offer* o = f.mutable_offer();
  o->set_batch(m.batch);
  o->set_host_id(m.host_id);
  for (const std::string& p : m.planes) o->add_planes(p);
  if (!m.link.empty()) o->set_link(m.link);
  o->mutable_entries()->Reserve(static_cast<int>(m.entries.size()));
  for (const WireOfferEntry& e : m.entries) {
    pb::OfferEntry* pe = o->add_entries();
    SetKey(pe, e.key);
    pe->set_bytes(e.bytes);
  }
}

void Fill(const WireDecisions& m, pb::TransportFrame& f) {
  pb::Decisions* d = f.mutable_decisions();
  d->set_batch(m.batch);
  d->mutable_decisions()->Reserve(static_cast<int>(m.decisions.size()));
  for (const WireDecision& e : m.decisions) {
    pb::Decision* pd = d->add_decisions();
    SetKey(pd, e.key);
    switch (e.kind) {
      case WireDecisionKind::kHeld: pd->set_kind(pb::DECISION_HELD); break;
      case WireDecisionKind::kGranted:
        pd->set_kind(pb::DECISION_GRANTED);
        pd->set_region(e.region);
        pd->set_offset(e.offset);
        pd->set_in_place(e.in_place);
        for (const Extent& x : e.extents) {
          pb::Extent* px = pd->add_extents();
          px->set_offset(x.offset);
          px->set_bytes(x.bytes);
        }
        break;
      case WireDecisionKind::kRejected:
        pd->set_kind(pb::DECISION_REJECTED);
        pd->set_code(CodeToWire(e.status.ok() ? StatusCode::kInternal : e.status.code()));
        pd->set_message(e.status.message());
        break;
    }
  }
  if (!m.dropped_link.empty()) d->set_dropped_link(m.dropped_link);
  for (const WireRegion& r : m.regions) {
    pb::RegionInfo* pr = d->add_regions();
    pr->set_id(r.id);
    pr->set_plane(r.plane);
    pr->set_bytes(r.bytes);
    pr->set_handle(r.handle);
  }
}

void Fill(const WireChunkHeader& m, pb::TransportFrame& f) {
  pb::ChunkHeader* h = f.mutable_chunk();
  h->set_batch(m.batch);
  SetKey(h, m.key);
  h->set_bytes(m.bytes);
  h->set_landed(m.landed);
  h->set_linked(m.linked);
  if (!m.header.empty()) h->set_header(m.header);
}

void Fill(const WireAcks& m, pb::TransportFrame& f) {
  pb::Acks* a = f.mutable_acks();
  a->mutable_acks()->Reserve(static_cast<int>(m.acks.size()));
  for (const WireAck& e : m.acks) {
    pb::AckEntry* pa = a->add_acks();
    pa->set_batch(e.batch);
    SetKey(pa, e.key);
    pa->set_code(CodeToWire(e.status.code()));
    if (!e.status.ok()) pa->set_message(e.status.message());
    pa->set_duplicate(e.duplicate);
    if (!e.dropped_link.empty()) pa->set_dropped_link(e.dropped_link);
  }
}

void Fill(const WirePing& m, pb::TransportFrame& f) { f.mutable_ping()->set_seq(m.seq); }
void Fill(const WirePong& m, pb::TransportFrame& f) {
  pb::Pong* p = f.mutable_pong();
  p->set_seq(m.seq);
  for (uint64_t b : m.waiting_batches) p->add_waiting_batches(b);
}

void Fill(const WireCancel& m, pb::TransportFrame& f) {
  pb::Cancel* c = f.mutable_cancel();
  c->set_batch(m.batch);
  for (const ChunkKey& k : m.keys) SetKey(c->add_keys(), k);
}

Result<WireMessage> FromProto(const pb::TransportFrame& f) {
  switch (f.body_case()) {
    case pb::TransportFrame::kOffer: {
      WireOffer m;
      m.batch = f.offer().batch();
      m.host_id = f.offer().host_id();
      m.link = f.offer().link();
      for (const std::string& p : f.offer().planes()) m.planes.push_back(p);
      m.entries.reserve(f.offer().entries_size());
      for (const pb::OfferEntry& e : f.offer().entries()) {
        m.entries.push_back(WireOfferEntry{KeyOf(e), e.bytes()});
      }
      return WireMessage(std::move(m));
    }
    case pb::TransportFrame::kDecisions: {
      WireDecisions m;
      m.batch = f.decisions().batch();
      m.dropped_link = f.decisions().dropped_link();
      m.decisions.reserve(f.decisions().decisions_size());
      for (const pb::Decision& d : f.decisions().decisions()) {
        WireDecision w{KeyOf(d), WireDecisionKind::kRejected, Status::Ok()};
        switch (d.kind()) {
          case pb::DECISION_HELD: w.kind = WireDecisionKind::kHeld; break;
          case pb::DECISION_GRANTED:
            w.kind = WireDecisionKind::kGranted;
            w.region = d.region();
            w.offset = d.offset();
            w.in_place = d.in_place();
            w.extents.reserve(d.extents_size());
            for (const pb::Extent& x : d.extents()) w.extents.push_back({x.offset(), x.bytes()});
            if (!w.extents.empty() && (w.region == 0 || !w.in_place)) {
              return InvalidArgument("kvbus wire: extents outside an in-place grant into a region");
            }
            break;
          case pb::DECISION_REJECTED:
            w.status = StatusFromWire(d.code(), d.message());
            if (w.status.ok()) return InvalidArgument("kvbus wire: a rejection with code OK");
            break;
          default:
            return InvalidArgument("kvbus wire: decision of unknown kind " +
                                   std::to_string(d.kind()));
        }
        m.decisions.push_back(std::move(w));
      }
      for (const pb::RegionInfo& r : f.decisions().regions()) {
        // A plane this sender has none of (a newer build's, or one not
        // registered here) is kept by name: the sender maps no such region
        // and sends its grants by tcp.
        m.regions.push_back(WireRegion{r.id(), r.bytes(), r.handle(), r.plane()});
      }
      return WireMessage(std::move(m));
    }
    case pb::TransportFrame::kChunk:
      return WireMessage(WireChunkHeader{f.chunk().batch(), KeyOf(f.chunk()), f.chunk().bytes(),
                                         f.chunk().landed(), f.chunk().header(),
                                         f.chunk().linked()});
    case pb::TransportFrame::kAcks: {
      WireAcks m;
      m.acks.reserve(f.acks().acks_size());
      for (const pb::AckEntry& a : f.acks().acks()) {
        m.acks.push_back(WireAck{a.batch(), KeyOf(a), StatusFromWire(a.code(), a.message()),
                                 a.duplicate(), a.dropped_link()});
      }
      return WireMessage(std::move(m));
    }
    case pb::TransportFrame::kPing: return WireMessage(WirePing{f.ping().seq()});
    case pb::TransportFrame::kPong: {
      WirePong m{f.pong().seq(),
                 {f.pong().waiting_batches().begin(), f.pong().waiting_batches().end()}};
      std::sort(m.waiting_batches.begin(), m.waiting_batches.end());
      return WireMessage(std::move(m));
    }
    case pb::TransportFrame::kCancel: {
      WireCancel m;
      m.batch = f.cancel().batch();
      for (const pb::CancelEntry& k : f.cancel().keys()) m.keys.push_back(KeyOf(k));
      return WireMessage(std::move(m));
    }
    case pb::TransportFrame::BODY_NOT_SET: break;
  }
  return Corruption("kvbus wire: a frame without a body");
}

}  // namespace

Result<zmq::message_t> EncodeWire(const WireMessage& message) {
  pb::TransportFrame f;
  f.set_version(kTransportWireVersion);
  std::visit([&f](const auto& m) { Fill(m, f); }, message);
  const size_t size = f.ByteSizeLong();
  if (size > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return Internal("kvbus wire: a " + std::to_string(size) + "-byte frame is too large");
  }
  zmq::message_t out;
  KDN_ZMQ_RETURN_IF_ERROR(out.rebuild(size));
  if (!f.SerializeToArray(out.data(), static_cast<int>(size))) {
    return Internal("kvbus wire: cannot serialize a frame");
  }
  return out;
}

Result<WireMessage> DecodeWire(const void* data, size_t size) {
  if (size > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return Corruption("kvbus wire: a " + std::to_string(size) + "-byte control frame");
  }
  pb::TransportFrame f;
  if (!f.ParseFromArray(data, static_cast<int>(size))) {
    return Corruption("kvbus wire: " + std::to_string(size) + " bytes that are not a frame");
  }
  if (f.version() != kTransportWireVersion) {
    return Corruption("kvbus wire: version " + std::to_string(f.version()) + ", expected " +
                      std::to_string(kTransportWireVersion));
  }
  return FromProto(f);
}

}  // namespace kdn::kvbus
