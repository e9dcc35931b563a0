// The tcp transport's receiving end: a ROUTER that any number of senders'
// DEALERs connect to, driven by one I/O thread. Offers queue up in arrival
// order and are granted while slot capacity lasts; chunks are verified and
// Put into the sink; decisions and acks go out in one message per peer and
// batch at the end of each round.

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <unordered_set>

#include "transport_internal.h"
#include "kdn/common/log.h"
#include "kdn/kvbus/buffer_pool.h"
#include "kdn/net/zmq_check.h"

namespace kdn::kvbus {

namespace {

// A round handles this many messages (or bytes) before acks and grants go out.
constexpr int kMaxMessagesPerRound = 256;
constexpr uint64_t kMaxBytesPerRound = uint64_t{64} << 20;
// Room for control frames (offers are split at 16384 entries) beyond a chunk.
constexpr int64_t kControlFrameAllowance = int64_t{4} << 20;

// Frames that are no kvbus message, or none a receiver takes: counted in
// ReceiverStats::bad_messages and logged, rate-limited (a peer can send
// them without end).
void LogBadFrames(const std::string& endpoint, uint64_t round, uint64_t total) {
  static LogLimiter limiter;
  limiter.Warn("kvbus receiver at {}: dropped {} malformed frames ({} so far)", endpoint, round,
               total);
}

}  // namespace

TcpReceiver::TcpReceiver(ChunkStore& sink, const ReceiverOptions& options)
    : options_(options), sink_(sink), context_(1) {}

Result<std::unique_ptr<Receiver>> TcpReceiver::Start(const std::string& endpoint, ChunkStore& sink,
                                                     const ReceiverOptions& options) {
  if (options.slot_capacity_bytes == 0 || options.lease.count() <= 0 ||
      options.heartbeat_interval.count() <= 0 || options.socket_buffer_bytes < 0) {
    return InvalidArgument(
        "kvbus tcp receiver: slot_capacity_bytes, lease and heartbeat_interval must be > 0, "
        "socket_buffer_bytes >= 0");
  }
  KDN_ASSIGN_OR_RETURN(const std::string zmq_endpoint, NormalizeTcpEndpoint(endpoint, true));
  KDN_ASSIGN_OR_RETURN(std::unique_ptr<WakeFd> wake, WakeFd::Make());
  std::unique_ptr<TcpReceiver> r;
  KDN_ZMQ_RETURN_IF_ERROR(r.reset(new TcpReceiver(sink, options)));
  r->wake_ = std::move(wake);
  KDN_ZMQ_RETURN_IF_ERROR(r->socket_ = zmq::socket_t(r->context_, zmq::socket_type::router));
  KDN_RETURN_IF_ERROR(
      net::SecureServer(r->context_, r->socket_, options.curve, net::CurveRole::kData, &r->auth_));
  KDN_RETURN_IF_ERROR(SetCommonSocketOptions(r->socket_, options.heartbeat_interval,
                                             5 * options.heartbeat_interval));
  // A sender that reconnects with its routing id takes its old place.
  KDN_ZMQ_RETURN_IF_ERROR(r->socket_.set(zmq::sockopt::router_handover, true));
  KDN_ZMQ_RETURN_IF_ERROR(r->socket_.set(zmq::sockopt::sndhwm, 100000));
  // Frames queued per peer before TCP pushes back: bounds the memory a fast
  // or hostile sender can park here to ~32 chunks (a chunk is two frames),
  // rather than ZeroMQ's default of 1000 frames.
  KDN_ZMQ_RETURN_IF_ERROR(r->socket_.set(zmq::sockopt::rcvhwm, 64));
  if (options.socket_buffer_bytes > 0) {
    KDN_ZMQ_RETURN_IF_ERROR(r->socket_.set(zmq::sockopt::rcvbuf, options.socket_buffer_bytes));
  }
  // No legitimate frame exceeds the largest chunk the receiver accepts.
  const uint64_t max_frame = options.slot_capacity_bytes + kControlFrameAllowance;
  if (max_frame < uint64_t{INT64_MAX}) {
    KDN_ZMQ_RETURN_IF_ERROR(
        r->socket_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(max_frame)));
  }
  if (options.shm_landing_bytes > 0) {
    KDN_ASSIGN_OR_RETURN(r->shm_, ShmLanding::Create(options.shm_landing_bytes));
    r->stats_.shm_landing_bytes = options.shm_landing_bytes;
  }
  if ((options.landing == nullptr) != (options.landing_region == nullptr)) {
    return InvalidArgument(
        "kvbus receiver: a landing site needs its region, and a region its site");
  }
  if (options.landing_region != nullptr) {
    if (options.landing_kind == RegionKind::kUnknown ||
        (options.landing_kind == RegionKind::kShm &&
         &options.landing_region->ops() != &HostDeviceOps())) {
      return InvalidArgument(std::string("kvbus receiver: a landing region of kind ") +
                             RegionKindName(options.landing_kind) + " in " +
                             options.landing_region->ops().name() +
                             " memory (shm lands in host memory; device in a device backend's)");
    }
    // An id of its own per receiver, as the shm segment's.
    uint32_t id = 0;
    do {
      id = static_cast<uint32_t>(std::random_device{}() | 1u);
    } while (r->shm_ && id == r->shm_->region());
    const std::string plane = options.landing_plane.empty()
                                  ? std::string(DefaultPlaneOf(options.landing_kind))
                                  : options.landing_plane;
    KDN_RETURN_IF_ERROR(CheckRegionPlane(plane));
    // A device region is written by cuda_ipc (or received over an nccl
    // link), which senders know it by; host memory by any other plane.
    if ((options.landing_kind == RegionKind::kDevice) != (plane == kCudaIpcPlaneName)) {
      return InvalidArgument("kvbus receiver: a landing region of " +
                             std::string(RegionKindName(options.landing_kind)) +
                             " memory cannot be written by plane '" + plane +
                             "' (device memory: cuda_ipc; host memory: any other)");
    }
    r->in_place_ =
        std::make_unique<RegionLanding>(*options.landing_region, options.landing_kind, plane, id);
  }
  KDN_ZMQ_RETURN_IF_ERROR(r->socket_.bind(zmq_endpoint));
  KDN_ZMQ_RETURN_IF_ERROR(r->endpoint_ = r->socket_.get(zmq::sockopt::last_endpoint));
  r->next_peer_check_ = TransportClock::now();
  r->thread_ = std::thread(&TcpReceiver::Run, r.get());
  return std::unique_ptr<Receiver>(std::move(r));
}

TcpReceiver::~TcpReceiver() {
  stop_ = true;
  if (wake_) wake_->Signal();
  if (thread_.joinable()) thread_.join();
  socket_.close();  // linger 0
  auth_.reset();
  context_.close();
}

Status TcpReceiver::Health() const {
  MutexLock lock(mu_);
  return health_;
}

ReceiverStats TcpReceiver::Stats() const {
  MutexLock lock(mu_);
  return published_;
}

void TcpReceiver::Publish() {
  stats_.waiting_chunks = waiting_.size();
  if (shm_) stats_.shm_landed_bytes = shm_->used_bytes();
  MutexLock lock(mu_);
  published_ = stats_;
}

void TcpReceiver::Run() {
  pthread_setname_np(pthread_self(), "kvbus-tcp-recv");
  while (!stop_) {
    const Status st = RunOnce();
    if (!st.ok()) {
      // Senders see the receiver go silent; the owner reads it from Health().
      LogError("kvbus tcp receiver at {} stopped: {}", endpoint_, st.ToString());
      MutexLock lock(mu_);
      health_ = st;
      return;
    }
  }
}

Status TcpReceiver::RunOnce() {
  auto now = TransportClock::now();
  std::optional<TransportClock::time_point> next;
  if (!lease_deadlines_.empty()) next = lease_deadlines_.begin()->first;
  if (const auto release = shm_ ? shm_->next_release() : std::nullopt) {
    next = next ? std::min(*next, *release) : *release;
  }
  if (!last_seen_.empty()) next = next ? std::min(*next, next_peer_check_) : next_peer_check_;
  int timeout_ms = -1;
  if (next) {
    timeout_ms =
        *next <= now
            ? 0
            : static_cast<int>(std::min<int64_t>(
                  std::chrono::ceil<std::chrono::milliseconds>(*next - now).count(), 60'000));
  }
  zmq_pollitem_t items[2] = {{socket_.handle(), 0, ZMQ_POLLIN, 0},
                             {nullptr, wake_->fd(), ZMQ_POLLIN, 0}};
  if (zmq_poll(items, 2, timeout_ms) < 0) {
    if (zmq_errno() == EINTR) return Status::Ok();
    return net::ZmqErrorStatus(zmq_errno(), "zmq_poll");
  }
  if (items[1].revents & ZMQ_POLLIN) wake_->Drain();
  if (items[0].revents & ZMQ_POLLIN) {
    // Control frames count against the round's budget as chunk bytes do, so
    // a flood of large offers cannot starve the other senders' pongs.
    round_bytes_ = 0;
    const uint64_t bad_before = stats_.bad_messages;
    for (int n = 0; n < kMaxMessagesPerRound; ++n) {
      bool got = false;
      KDN_RETURN_IF_ERROR(ReceiveOne(got));
      if (!got || round_bytes_ >= kMaxBytesPerRound) break;
    }
    if (stats_.bad_messages > bad_before) {
      LogBadFrames(endpoint_, stats_.bad_messages - bad_before, stats_.bad_messages);
    }
  }
  now = TransportClock::now();
  ExpireLeases(now);
  if (shm_) shm_->EndQuarantine(now);
  if (now >= next_peer_check_) ForgetSilentPeers(now);
  GrantWaiting(now);
  // Before the acks go out, so that a sender that saw its batch done reads
  // stats that count it.
  Publish();
  return Flush();
}

Status TcpReceiver::ReceiveOne(bool& got) {
  zmq::message_t peer;
  KDN_ASSIGN_OR_RETURN(got, TryRecv(socket_, peer));
  if (!got) return Status::Ok();
  round_bytes_ += peer.size();
  // [peer routing id][frame][chunk bytes, for a chunk header only]
  zmq::message_t parts[2];
  size_t count = 0;
  bool more = peer.more();
  while (more) {
    zmq::message_t part;
    KDN_ZMQ_RETURN_IF_ERROR(socket_.recv(part, zmq::recv_flags::none));
    more = part.more();
    round_bytes_ += part.size();
    if (count < 2) parts[count] = std::move(part);
    ++count;
  }
  if (count == 0 || count > 2) {
    ++stats_.bad_messages;
    return Status::Ok();
  }
  Handle(std::string(peer.data<char>(), peer.size()), parts[0], count == 2 ? &parts[1] : nullptr);
  return Status::Ok();
}

void TcpReceiver::Handle(const std::string& peer, const zmq::message_t& head,
                         const zmq::message_t* data) {
  last_seen_[peer] = TransportClock::now();
  Result<WireMessage> message = DecodeWire(head.data(), head.size());
  if (!message.ok()) {
    ++stats_.bad_messages;
    return;
  }
  if (const auto* h = std::get_if<WireChunkHeader>(&*message)) {
    // A landed chunk comes alone, any other with its bytes; a linked one
    // is landed (its bytes come over the link).
    if (!data != h->landed || (h->linked && !h->landed)) {
      ++stats_.bad_messages;
      return;
    }
    HandleChunk(peer, *h, data);
    return;
  }
  if (data) {  // only a chunk header is followed by bytes
    ++stats_.bad_messages;
    return;
  }
  if (const auto* offer = std::get_if<WireOffer>(&*message)) {
    HandleOffer(peer, *offer);
  } else if (const auto* cancel = std::get_if<WireCancel>(&*message)) {
    HandleCancel(peer, *cancel);
  } else if (const auto* ping = std::get_if<WirePing>(&*message)) {
    Outbox& box = outbox_[peer];
    box.pong = true;
    box.pong_seq = ping->seq;
  } else {
    ++stats_.bad_messages;  // decisions, acks, pongs: a receiver never gets these
  }
}

bool TcpReceiver::PeerWrites(const std::string& peer, const std::string& plane) const {
  const auto it = peer_planes_.find(peer);
  return it != peer_planes_.end() &&
         std::find(it->second.begin(), it->second.end(), plane) != it->second.end();
}

void TcpReceiver::HandleOffer(const std::string& peer, const WireOffer& m) {
  ++stats_.offers;
  peer_planes_[peer] = m.host_id == HostId() ? m.planes : std::vector<std::string>{};
  if (!m.link.empty()) JoinLink(peer, m.link);
  // A kvbus sender splits its offers; a larger one would make decisions
  // frames the receiver cannot encode (and stall its round).
  if (m.entries.size() > kMaxOfferEntries) {
    ++stats_.bad_messages;
    return;
  }
  std::vector<WireDecision>& out = outbox_[peer].decisions[m.batch];
  for (const WireOfferEntry& e : m.entries) {
    ++stats_.chunks_offered;
    if (e.bytes < Chunk::kHeaderBytes) {  // no chunk is this small: a 0-byte lease costs nothing
      out.push_back(WireDecision{e.key, WireDecisionKind::kRejected,
                                 InvalidArgument("chunk " + e.key.ToHex() + " offered with " +
                                                 std::to_string(e.bytes) + " bytes")});
      continue;
    }
    if (e.bytes > options_.slot_capacity_bytes) {
      out.push_back(WireDecision{
          e.key, WireDecisionKind::kRejected,
          ResourceExhausted("chunk " + e.key.ToHex() + " of " + std::to_string(e.bytes) +
                            " bytes exceeds the receiver's slot capacity of " +
                            std::to_string(options_.slot_capacity_bytes) + " bytes")});
      continue;
    }
    if (options_.landing != nullptr) {
      // Claimed chunks land in place, each claim by a transfer of its own:
      // never waiting for slot capacity.
      if (auto it = leases_.find(LeaseKey{peer, m.batch, e.key});
          it != leases_.end() && it->second.in_place) {
        out.push_back(InPlaceDecision(e.key, it->second));  // a repeated offer
        continue;
      }
      if (std::optional<Landing> claim =
              options_.landing->Claim(e.key, e.bytes - Chunk::kHeaderBytes)) {
        GrantInPlace(peer, m.batch, e, std::move(*claim), out);
        continue;
      }
    }
    if (sink_.Contains(e.key)) {
      ++stats_.chunks_held;
      out.push_back(WireDecision{e.key, WireDecisionKind::kHeld, Status::Ok()});
      continue;
    }
    LeaseKey id{peer, m.batch, e.key};
    if (leases_.count(id) != 0) {  // offered again: its grant stands, but was lost on the way
      out.push_back(WireDecision{e.key, WireDecisionKind::kGranted, Status::Ok()});
      continue;
    }
    waiting_.push_back(WaitingOffer{std::move(id), e.bytes});
  }
}

void TcpReceiver::GrantWaiting(TransportClock::time_point now) {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    const LeaseKey& id = it->id;
    if (sink_.Contains(id.key)) {  // delivered meanwhile, maybe by another offer
      ++stats_.chunks_held;
      outbox_[id.peer].decisions[id.batch].push_back(
          WireDecision{id.key, WireDecisionKind::kHeld, Status::Ok()});
      it = waiting_.erase(it);
      continue;
    }
    // On its way under another lease: wait for it rather than move it twice.
    if (leased_keys_.count(id.key) != 0) {
      ++it;
      continue;
    }
    // First come, first served: a large offer is not overtaken forever.
    if (stats_.leased_bytes + it->bytes > options_.slot_capacity_bytes) break;
    const TransportClock::time_point deadline = now + options_.lease;
    Lease lease{it->bytes, deadline};
    WireDecision grant{id.key, WireDecisionKind::kGranted, Status::Ok()};
    // A shm peer gets a range of the segment when one is free; else the
    // bytes come by tcp (a full segment never stalls a transfer).
    if (shm_ && PeerWrites(id.peer, kShmPlaneName)) {
      if (std::optional<uint64_t> at = shm_->Allocate(it->bytes)) {
        lease.landing = true;
        lease.landing_offset = *at;
        grant.region = shm_->region();
        grant.offset = *at;
      }
    }
    leases_.emplace(id, lease);
    lease_deadlines_.emplace(deadline, id);
    ++leased_keys_[id.key];
    stats_.leased_bytes += it->bytes;
    stats_.peak_leased_bytes = std::max(stats_.peak_leased_bytes, stats_.leased_bytes);
    ++stats_.chunks_granted;
    outbox_[id.peer].decisions[id.batch].push_back(std::move(grant));
    it = waiting_.erase(it);
  }
}

std::optional<TcpReceiver::Lease> TcpReceiver::TakeLease(const LeaseKey& id) {
  auto it = leases_.find(id);
  if (it == leases_.end()) return std::nullopt;
  Lease lease = std::move(it->second);
  if (!lease.in_place) stats_.leased_bytes -= lease.bytes;  // claims take no slot capacity
  auto k = leased_keys_.find(id.key);
  if (k != leased_keys_.end() && --k->second <= 0) leased_keys_.erase(k);
  // Last: `id` may be the very entry erased here.
  auto deadline = std::make_pair(lease.deadline, it->first);
  leases_.erase(it);
  lease_deadlines_.erase(deadline);
  return lease;
}

void TcpReceiver::FreeLanding(const Lease& lease, bool quarantine, TransportClock::time_point now) {
  if (!lease.landing) return;
  shm_->Free(lease.landing_offset, lease.bytes,
             quarantine ? std::optional(now + options_.lease) : std::nullopt);
}

void TcpReceiver::ExpireLeases(TransportClock::time_point now) {
  while (!lease_deadlines_.empty() && lease_deadlines_.begin()->first <= now) {
    // Copied: TakeLease erases the deadline entry it is read from.
    const LeaseKey id = lease_deadlines_.begin()->second;
    if (std::optional<Lease> lease = TakeLease(id)) {
      ++stats_.leases_expired;
      FreeLanding(*lease, /*quarantine=*/true, now);
      EndClaim(*lease, Unavailable("kvbus: the grant of chunk " + id.key.ToHex() +
                                   " expired before its bytes came"));
    } else {
      lease_deadlines_.erase(lease_deadlines_.begin());  // an orphan: never loop on it
    }
  }
}

void TcpReceiver::ForgetSilentPeers(TransportClock::time_point now) {
  next_peer_check_ = now + std::clamp(options_.lease / 4, std::chrono::milliseconds(10),
                                      std::chrono::milliseconds(1000));
  const auto silent = [&](const std::string& peer) {
    auto it = last_seen_.find(peer);
    return it == last_seen_.end() || now - it->second > options_.lease;
  };
  waiting_.remove_if([&](const WaitingOffer& w) { return silent(w.id.peer); });
  std::erase_if(last_seen_, [&](const auto& p) { return now - p.second > options_.lease; });
  std::erase_if(peer_planes_, [&](const auto& p) { return last_seen_.count(p.first) == 0; });
  std::erase_if(failed_links_, [&](const auto& p) { return last_seen_.count(p.first) == 0; });
}

void TcpReceiver::HandleCancel(const std::string& peer, const WireCancel& m) {
  std::vector<LeaseKey> ids;
  if (m.keys.empty()) {
    for (auto it = leases_.lower_bound(LeaseKey{peer, m.batch, ChunkKey{}});
         it != leases_.end() && it->first.peer == peer && it->first.batch == m.batch; ++it) {
      ids.push_back(it->first);
    }
  } else {
    for (const ChunkKey& k : m.keys) ids.push_back(LeaseKey{peer, m.batch, k});
  }
  for (const LeaseKey& id : ids) {
    if (std::optional<Lease> lease = TakeLease(id)) {
      ++stats_.leases_cancelled;
      // A sender cancels only what it is not writing: reusable at once.
      FreeLanding(*lease, /*quarantine=*/false, TransportClock::now());
      EndClaim(*lease, Unavailable("kvbus: the sender cancelled chunk " + id.key.ToHex()));
    }
  }
  const std::unordered_set<ChunkKey, ChunkKeyHash> keys(m.keys.begin(), m.keys.end());
  waiting_.remove_if([&](const WaitingOffer& w) {
    return w.id.peer == peer && w.id.batch == m.batch &&
           (keys.empty() || keys.count(w.id.key) != 0);
  });
}

void TcpReceiver::HandleChunk(const std::string& peer, const WireChunkHeader& h,
                              const zmq::message_t* data) {
  ++stats_.chunks_received;
  const std::optional<Lease> lease = TakeLease(LeaseKey{peer, h.batch, h.key});
  if (lease && lease->in_place) return HandleInPlace(peer, h, data, *lease);
  if (h.linked) {
    // Its payload is on the link, and without an in-place grant nothing
    // here takes it off: the link is out of step, and goes (the sender
    // makes a new one).
    if (lease) FreeLanding(*lease, /*quarantine=*/false, TransportClock::now());
    ++stats_.chunks_rejected;
    outbox_[peer].acks.push_back(WireAck{
        h.batch, h.key,
        FailedPrecondition("chunk " + h.key.ToHex() +
                           " came over the nccl link without an in-place grant (it expired "
                           "after " +
                           std::to_string(options_.lease.count()) + " ms, or was never made)"),
        false, DropLink(peer)});
    return;
  }
  // A landing range is given back, once, as soon as the bytes are copied
  // out (or refused), before the verification and the sink's Put.
  bool landing_freed = false;
  const auto free_landing = [&] {
    if (lease && !landing_freed) FreeLanding(*lease, /*quarantine=*/false, TransportClock::now());
    landing_freed = true;
  };
  WireAck ack{h.batch, h.key, Status::Ok(), false};
  const auto reject = [&](Status why) {
    ++stats_.chunks_rejected;
    ack.status = std::move(why);
    free_landing();
    outbox_[peer].acks.push_back(std::move(ack));
  };
  // Where the bytes are: after the header on the connection, or (landed) in
  // the segment range this chunk's lease granted, and only there. Bytes by
  // tcp without a lease (it expired, or was never asked for) are still
  // taken: they are here already, and verified like any others.
  const uint8_t* bytes = nullptr;
  if (!h.landed) {
    stats_.bytes_received += data->size();
    stats_.planes["tcp"] += PlaneStats{1, data->size()};
    if (data->size() != h.bytes) {
      return reject(Corruption("chunk " + h.key.ToHex() + ": " + std::to_string(data->size()) +
                               " bytes arrived, " + std::to_string(h.bytes) + " announced"));
    }
    bytes = data->data<uint8_t>();
  } else {
    if (!lease || !lease->landing) {
      return reject(FailedPrecondition("chunk " + h.key.ToHex() +
                                       " said it landed in shared memory, but holds no shm grant "
                                       "(it expired after " +
                                       std::to_string(options_.lease.count()) +
                                       " ms, or was never made)"));
    }
    if (h.bytes != lease->bytes) {
      return reject(InvalidArgument("chunk " + h.key.ToHex() + " landed " +
                                    std::to_string(h.bytes) + " bytes under a grant of " +
                                    std::to_string(lease->bytes)));
    }
    ++stats_.shm_chunks;
    stats_.shm_bytes += h.bytes;
    stats_.bytes_received += h.bytes;
    stats_.planes["shm"] += PlaneStats{1, h.bytes};
    bytes = shm_->data() + lease->landing_offset;
  }
  if (sink_.Contains(h.key)) {
    ++stats_.duplicates;
    ack.duplicate = true;
  } else if (Result<std::shared_ptr<uint8_t>> copy = BufferPool::Default().Acquire(h.bytes);
             !copy.ok()) {
    ++stats_.put_failures;
    ack.status = copy.status();
  } else {
    // The one copy on this side, into a pre-faulted buffer, made before the
    // chunk is verified: what is verified is what is kept, out of the
    // sender's reach.
    std::memcpy(copy->get(), bytes, h.bytes);
    free_landing();
    Deliver(h, std::move(copy).value(), h.bytes, ack);
  }
  free_landing();
  outbox_[peer].acks.push_back(std::move(ack));
}

void TcpReceiver::Deliver(const WireChunkHeader& h, std::shared_ptr<const uint8_t> data,
                          size_t bytes, WireAck& ack) {
  Result<std::shared_ptr<const Chunk>> chunk = Chunk::Parse(std::move(data), bytes);
  if (!chunk.ok()) {
    ++stats_.chunks_rejected;
    ack.status = chunk.status();
  } else if ((*chunk)->key() != h.key) {
    ++stats_.chunks_rejected;
    ack.status = Corruption("chunk announced as " + h.key.ToHex() + " carries key " +
                            (*chunk)->key().ToHex());
  } else {
    Status put = sink_.Put(std::move(chunk).value());
    if (put.ok()) {
      ++stats_.chunks_stored;
    } else {
      ++stats_.put_failures;
      ack.status = put.WithContext("sink " + sink_.name());
    }
  }
}

Status TcpReceiver::Flush() {
  const auto send_to = [this](const std::string& peer, const WireMessage& m) -> Status {
    Result<zmq::message_t> encoded = EncodeWire(m);
    // Too large to encode: dropped like a lost frame, not fatal to every peer.
    if (!encoded.ok()) return Status::Ok();
    zmq::message_t frame = std::move(encoded).value();
    zmq::message_t id(peer.data(), peer.size());
    // A peer that is gone, or whose queue is full, loses the frame: its own
    // timeouts take over from there.
    KDN_ASSIGN_OR_RETURN(const bool queued, TrySend(socket_, id, /*more=*/true));
    if (queued) KDN_RETURN_IF_ERROR(TrySend(socket_, frame, /*more=*/false).status());
    return Status::Ok();
  };
  for (auto& [peer, box] : outbox_) {
    if (!box.dropped_link.empty()) {
      // Said on its own, without decisions: a sender renews its link
      // whatever else it hears.
      WireDecisions m{0, {}, {}, std::move(box.dropped_link)};
      KDN_RETURN_IF_ERROR(send_to(peer, m));
    }
    for (auto& [batch, decisions] : box.decisions) {
      if (decisions.empty()) continue;
      WireDecisions m{batch, std::move(decisions), {}};
      const auto names = [&](uint32_t region) {
        return region != 0 &&
               std::any_of(m.decisions.begin(), m.decisions.end(),
                           [&](const WireDecision& d) { return d.region == region; });
      };
      if (shm_ && names(shm_->region())) m.regions.push_back(shm_->Descriptor());
      if (in_place_ && names(in_place_->region())) m.regions.push_back(in_place_->Descriptor());
      KDN_RETURN_IF_ERROR(send_to(peer, m));
    }
    if (!box.acks.empty()) KDN_RETURN_IF_ERROR(send_to(peer, WireAcks{std::move(box.acks)}));
    if (box.pong) {
      WirePong pong{box.pong_seq, {}};
      for (const WaitingOffer& w : waiting_) {
        if (w.id.peer == peer) pong.waiting_batches.push_back(w.id.batch);
      }
      std::sort(pong.waiting_batches.begin(), pong.waiting_batches.end());
      pong.waiting_batches.erase(
          std::unique(pong.waiting_batches.begin(), pong.waiting_batches.end()),
          pong.waiting_batches.end());
      KDN_RETURN_IF_ERROR(send_to(peer, pong));
    }
  }
  outbox_.clear();
  return Status::Ok();
}

}  // namespace kdn::kvbus
