// The tcp transport's sending end: a DEALER connected to one receiver's
// ROUTER, driven by one I/O thread. Submit queues a batch and wakes the
// thread; the thread offers the batch's keys, sends what the receiver grants
// (zero-copy: ZeroMQ holds a reference to the chunk until its bytes are on
// the wire), and records decisions and acks for Poll and Wait.

#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include "transport_internal.h"
#include "kdn/common/log.h"
#include "kdn/net/zmq_check.h"
#include "kdn/kvbus/zmq_chunk.h"

namespace kdn::kvbus {

namespace {

// Messages handled per round before queued sends get their turn.
constexpr int kMaxReceivesPerRound = 1024;

// A routing id that stays the same across reconnects, so the receiver's
// leases still match after a dropped connection comes back.
std::string MakeRoutingId() {
  std::random_device rd;
  std::string id(16, '\0');
  for (char& c : id) c = static_cast<char>(rd() & 0xff);
  id[0] = static_cast<char>(0x80 | (id[0] & 0x7f));  // a leading 0 is reserved by ZeroMQ
  return id;
}

// How long a link message may take (and the receiver to join first): half
// the peer timeout, so that a link that runs into it leaves the sender time
// to hear from its receiver before it holds it silent (nothing is read
// while a message goes).
std::chrono::milliseconds LinkTimeout(const SenderOptions& o) { return o.peer_timeout / 2; }

int PollTimeoutMs(TransportClock::time_point now, TransportClock::time_point next) {
  if (next <= now) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(next - now).count();
  return static_cast<int>(std::min<int64_t>(ms, 60'000));
}

}  // namespace

TcpSender::TcpSender(std::string endpoint, const SenderOptions& options)
    : endpoint_(std::move(endpoint)),
      options_(options),
      context_(1),
      planes_(MakeRegionPlanes(options)) {}

RegionPlane* TcpSender::MappedPlane(uint32_t region) {
  const auto named = region_planes_.find(region);
  if (region == 0 || named == region_planes_.end()) return nullptr;
  const auto plane = planes_.find(named->second);
  if (plane == planes_.end() || !plane->second->Mapped(region)) return nullptr;
  return plane->second.get();
}

Result<std::unique_ptr<Sender>> TcpSender::Start(const std::string& endpoint,
                                                 const SenderOptions& options) {
  if (options.heartbeat_interval.count() <= 0 ||
      options.peer_timeout <= options.heartbeat_interval || options.socket_buffer_bytes < 0) {
    return InvalidArgument(
        "kvbus tcp sender: needs 0 < heartbeat_interval < peer_timeout and "
        "socket_buffer_bytes >= 0");
  }
  if ((options.transport == TransportKind::kCudaIpc || options.transport == TransportKind::kNccl) &&
      options.device_ops == nullptr) {
    return InvalidArgument(std::string("kvbus sender: transport ") +
                           TransportKindName(options.transport) +
                           " needs a device backend (device_ops)");
  }
  KDN_ASSIGN_OR_RETURN(const std::string zmq_endpoint, NormalizeTcpEndpoint(endpoint, false));
  KDN_ASSIGN_OR_RETURN(std::unique_ptr<WakeFd> wake, WakeFd::Make());
  std::unique_ptr<TcpSender> s;
  KDN_ZMQ_RETURN_IF_ERROR(s.reset(new TcpSender(endpoint, options)));
  if (options.transport == TransportKind::kNccl) {
    KDN_ASSIGN_OR_RETURN(s->link_, LinkPlane::Make(*options.device_ops, LinkTimeout(options)));
  }
  s->wake_ = std::move(wake);
  KDN_ZMQ_RETURN_IF_ERROR(s->socket_ = zmq::socket_t(s->context_, zmq::socket_type::dealer));
  KDN_RETURN_IF_ERROR(net::SecureClient(s->socket_, options.curve));
  KDN_RETURN_IF_ERROR(
      SetCommonSocketOptions(s->socket_, options.heartbeat_interval, options.peer_timeout));
  KDN_ZMQ_RETURN_IF_ERROR(s->socket_.set(zmq::sockopt::routing_id, MakeRoutingId()));
  // Queued chunk frames reference the chunks (no copies), so a deep queue
  // costs little memory; the receiver's grants bound it anyway.
  KDN_ZMQ_RETURN_IF_ERROR(s->socket_.set(zmq::sockopt::sndhwm, 100000));
  if (options.socket_buffer_bytes > 0) {
    KDN_ZMQ_RETURN_IF_ERROR(s->socket_.set(zmq::sockopt::sndbuf, options.socket_buffer_bytes));
  }
  KDN_RETURN_IF_ERROR(s->WatchConnection());  // before connect, to see its first attempt
  KDN_ZMQ_RETURN_IF_ERROR(s->socket_.connect(zmq_endpoint));
  s->thread_ = std::thread(&TcpSender::Run, s.get());
  return std::unique_ptr<Sender>(std::move(s));
}

TcpSender::~TcpSender() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  if (wake_) wake_->Signal();
  if (thread_.joinable()) thread_.join();
  control_.clear();
  data_.clear();
  // The monitor's socket too must close before the context can.
  monitor_.reset();
  socket_.close();  // linger 0: unsent frames are dropped (and their chunks released)
  context_.close();
  MutexLock lock(mu_);
  FailAllLocked(Unavailable("kvbus tcp sender to " + endpoint_ + " closed"));
  done_cv_.SignalAll();
}

Result<uint64_t> TcpSender::Submit(std::vector<std::shared_ptr<const Chunk>> chunks) {
  std::vector<OutChunk> out;
  out.reserve(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (!chunks[i]) return InvalidArgument("kvbus Submit: chunk " + std::to_string(i) + " is null");
    out.emplace_back(std::move(chunks[i]));
  }
  return Enqueue(std::move(out));
}

Result<uint64_t> TcpSender::SubmitSourced(std::vector<SourcedChunk> chunks) {
  std::vector<OutChunk> out;
  out.reserve(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i].memory == nullptr) {
      return InvalidArgument("kvbus SubmitSourced: chunk " + std::to_string(i) + " has no memory");
    }
    out.emplace_back(std::make_shared<const SourcedChunk>(std::move(chunks[i])));
  }
  return Enqueue(std::move(out));
}

Result<uint64_t> TcpSender::Enqueue(std::vector<OutChunk> chunks) {
  Batch batch;
  batch.submitted = TransportClock::now();
  batch.slots.resize(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    Slot& slot = batch.slots[i];
    slot.result.key = chunks[i].key();
    slot.chunk = std::move(chunks[i]);
    auto [first, inserted] = batch.index.emplace(slot.result.key, static_cast<uint32_t>(i));
    if (!inserted) {
      slot.duplicate = true;
      batch.slots[first->second].copies.push_back(static_cast<uint32_t>(i));
    }
  }
  batch.unfinished = batch.slots.size();
  uint64_t id = 0;
  {
    MutexLock lock(mu_);
    if (!fatal_.ok()) return fatal_;
    if (stop_) return Unavailable("kvbus tcp sender to " + endpoint_ + " is closing");
    id = next_batch_++;
    unfinished_ += batch.unfinished;
    const bool empty = batch.slots.empty();
    batches_.emplace(id, std::move(batch));
    if (empty) return id;
    to_offer_.push_back(id);
  }
  wake_->Signal();
  return id;
}

SenderStats TcpSender::Stats() const {
  MutexLock lock(mu_);
  return stats_;
}

Result<BatchStatus> TcpSender::Poll(uint64_t batch) {
  return Wait(batch, std::chrono::milliseconds(0));
}

Result<BatchStatus> TcpSender::Wait(uint64_t batch, std::chrono::milliseconds timeout) {
  // A year is forever here, and keeps the deadline from overflowing.
  timeout = std::clamp(timeout, std::chrono::milliseconds(0),
                       std::chrono::milliseconds(365LL * 24 * 3600 * 1000));
  const auto deadline = TransportClock::now() + timeout;
  MutexLock lock(mu_);
  auto it = batches_.find(batch);
  while (it != batches_.end() && it->second.unfinished > 0) {
    const bool woken = done_cv_.WaitUntil(mu_, deadline);
    it = batches_.find(batch);  // the wait let go of mu_: `it` may be gone
    if (!woken) break;
  }
  if (it == batches_.end()) {
    return NotFound("kvbus tcp sender: no batch " + std::to_string(batch) +
                    " (never submitted, or already reported done)");
  }
  BatchStatus status = SnapshotLocked(batch, it->second);
  if (status.done) batches_.erase(it);
  return status;
}

BatchStatus TcpSender::SnapshotLocked(uint64_t id, const Batch& batch) const {
  BatchStatus s;
  s.batch = id;
  s.done = batch.unfinished == 0;
  s.chunks.reserve(batch.slots.size());
  for (const Slot& slot : batch.slots) s.chunks.push_back(slot.result);
  return s;
}

void TcpSender::Finish(Batch& batch, uint32_t slot, ChunkOutcome outcome, Status status) {
  Slot& first = batch.slots[slot];
  if (first.phase == Phase::kDone) return;
  const auto apply = [&](Slot& s) KDN_REQUIRES(mu_) {
    s.phase = Phase::kDone;
    s.result.outcome = outcome;
    s.result.status = status;
    s.chunk = OutChunk();  // the batch no longer needs the bytes
    --batch.unfinished;
    --unfinished_;
  };
  apply(first);
  for (uint32_t c : first.copies) apply(batch.slots[c]);
  if (batch.unfinished == 0) {
    const double s = std::chrono::duration<double>(TransportClock::now() - batch.submitted).count();
    stats_.planes[batch.plane != nullptr ? batch.plane : "tcp"].seconds += s;
  }
}

void TcpSender::FailAllLocked(const Status& status) {
  for (auto& [id, batch] : batches_) {
    for (uint32_t i = 0; i < batch.slots.size() && batch.unfinished > 0; ++i) {
      if (!batch.slots[i].duplicate) Finish(batch, i, ChunkOutcome::kFailed, status);
    }
  }
  to_offer_.clear();
}

void TcpSender::Run() {
  pthread_setname_np(pthread_self(), "kvbus-tcp-send");
  last_heard_ = last_ping_ = TransportClock::now();
  while (true) {
    {
      MutexLock lock(mu_);
      if (stop_) return;
    }
    const Status st = RunOnce();
    if (!st.ok()) {
      MutexLock lock(mu_);
      fatal_ = st.WithContext("kvbus tcp sender to " + endpoint_);
      LogError("{}; its transfers fail", fatal_.ToString());
      FailAllLocked(fatal_);
      done_cv_.SignalAll();
      return;
    }
  }
}

Status TcpSender::RunOnce() {
  auto now = TransportClock::now();
  bool busy = false;
  {
    MutexLock lock(mu_);
    busy = unfinished_ > 0;
  }
  // The receiver's silence is measured from when there was work to hear about.
  if (busy && !busy_) last_heard_ = last_ping_ = now;
  busy_ = busy;
  int timeout_ms = -1;
  if (busy) {
    timeout_ms = PollTimeoutMs(now, std::min(last_ping_ + options_.heartbeat_interval,
                                             last_heard_ + options_.peer_timeout));
  }
  const bool want_out = !control_.empty() || !data_.empty();
  zmq_pollitem_t items[3] = {
      {socket_.handle(), 0, static_cast<short>(ZMQ_POLLIN | (want_out ? ZMQ_POLLOUT : 0)), 0},
      {nullptr, wake_->fd(), ZMQ_POLLIN, 0},
      {monitor_->handle(), 0, ZMQ_POLLIN, 0}};
  if (zmq_poll(items, 3, timeout_ms) < 0) {
    if (zmq_errno() == EINTR) return Status::Ok();
    return net::ZmqErrorStatus(zmq_errno(), "zmq_poll");
  }
  if (items[1].revents & ZMQ_POLLIN) wake_->Drain();
  KDN_RETURN_IF_ERROR(OfferNewBatches());
  if (items[0].revents & ZMQ_POLLIN) KDN_RETURN_IF_ERROR(ReceiveAll());
  KDN_RETURN_IF_ERROR(FlushControl());
  KDN_RETURN_IF_ERROR(FlushData());
  KDN_RETURN_IF_ERROR(CheckConnection(TransportClock::now()));  // after the acks that came
  CheckPeer(TransportClock::now());
  return FlushControl();
}

Status TcpSender::OfferNewBatches() {
  // A link that ended without a new one (none could be made then) is
  // tried again before new batches are offered, at most once a heartbeat.
  if (link_ && !link_->usable()) {
    const auto now = TransportClock::now();
    bool due = false;
    {
      MutexLock lock(mu_);
      due = !to_offer_.empty() && now >= next_link_try_;
    }
    if (due) {
      next_link_try_ = now + options_.heartbeat_interval;
      RenewLink(link_->error());
    }
  }
  std::vector<WireOffer> offers;
  {
    MutexLock lock(mu_);
    for (uint64_t id : to_offer_) {
      auto it = batches_.find(id);
      if (it == batches_.end()) continue;
      for (uint32_t i = 0; i < it->second.slots.size(); ++i) {
        Slot& slot = it->second.slots[i];
        if (slot.duplicate || slot.phase != Phase::kOffered) continue;
        // Pings wait for an empty control queue, so the next one follows this offer.
        slot.offered_before_ping = ping_seq_ + 1;
        if (offers.empty() || offers.back().batch != id ||
            offers.back().entries.size() >= kMaxOfferEntries) {
          offers.push_back(NewOffer(id));
        }
        offers.back().entries.push_back(WireOfferEntry{slot.result.key, slot.chunk.size()});
      }
    }
    to_offer_.clear();
  }
  for (const WireOffer& offer : offers) {
    KDN_ASSIGN_OR_RETURN(zmq::message_t frame, EncodeWire(offer));
    control_.push_back(std::move(frame));
  }
  return Status::Ok();
}

Status TcpSender::ReceiveAll() {
  for (int n = 0; n < kMaxReceivesPerRound; ++n) {
    zmq::message_t frame;
    KDN_ASSIGN_OR_RETURN(const bool got, TryRecv(socket_, frame));
    if (!got) break;
    last_heard_ = TransportClock::now();
    // A receiver sends single frames; anything after one is dropped.
    bool more = frame.more();
    while (more) {
      zmq::message_t extra;
      KDN_ZMQ_RETURN_IF_ERROR(socket_.recv(extra, zmq::recv_flags::none));
      more = extra.more();
    }
    Result<WireMessage> message = DecodeWire(frame.data(), frame.size());
    if (!message.ok()) continue;  // not from a kvbus receiver of this version
    if (const auto* d = std::get_if<WireDecisions>(&*message)) {
      HandleDecisions(*d);
    } else if (const auto* a = std::get_if<WireAcks>(&*message)) {
      HandleAcks(*a);
    } else if (const auto* p = std::get_if<WirePong>(&*message)) {
      HandlePong(*p);
    }
  }
  return Status::Ok();
}

WireOffer TcpSender::NewOffer(uint64_t batch) const {
  WireOffer offer{batch, {}, {}, HostId()};
  if (options_.transport == TransportKind::kTcp) return offer;
  for (const auto& [name, plane] : planes_) {
    // Only shm writes the landing segment; kCudaIpc lands what is claimed
    // on the device plane and sends the rest as auto would.
    if (options_.transport == TransportKind::kShm && name != kShmPlaneName) continue;
    if (plane->usable()) offer.planes.push_back(name);
  }
  if (link_ && link_->usable()) offer.link = link_->id();
  return offer;
}

bool TcpSender::GoesByLink(const WireDecision& d) const {
  if (!link_ || !link_->usable() || !d.in_place || d.region == 0) return false;
  const auto named = region_planes_.find(d.region);
  return named != region_planes_.end() && named->second == kCudaIpcPlaneName;
}

void TcpSender::MapRegions(const std::vector<WireRegion>& regions) {
  std::map<std::string, std::vector<WireRegion>> by_plane;
  for (const WireRegion& r : regions) {
    region_planes_[r.id] = r.plane;
    by_plane[r.plane].push_back(r);
  }
  for (auto& [name, named] : by_plane) {
    auto it = planes_.find(name);
    if (it == planes_.end()) continue;  // no plane for it: its grants go by tcp
    RegionPlane& plane = *it->second;
    const bool was_usable = plane.usable();
    plane.Map(named);
    if (was_usable && !plane.usable()) {
      // auto sends by tcp from now on; a kShm sender fails these chunks.
      LogWarn("kvbus sender to {}: no {} ({}){}", endpoint_, plane.name(), plane.error().ToString(),
              options_.transport == TransportKind::kAuto ? "; sending by tcp" : "");
    }
  }
}

Status TcpSender::PlaneRequired(const WireDecision& d, const RegionPlane* plane) const {
  std::string required;
  std::string what;
  if (options_.transport == TransportKind::kShm) {
    required = kShmPlaneName;
    what =
        "granted no shared-memory range (another host, no landing segment, or the chunk "
        "does not fit in it)";
  } else if (options_.transport == TransportKind::kNccl && d.in_place) {
    if (GoesByLink(d)) return Status::Ok();
    return FailedPrecondition(
        "kvbus nccl: receiver " + endpoint_ + " " +
        (link_->usable() ? std::string("landed a chunk in place outside a device region, or has "
                                       "not joined the link (its landing is host memory)")
                         : "lost the link (" + link_->error().ToString() + ")"));
  } else if (options_.transport == TransportKind::kCudaIpc && d.in_place) {
    required = kCudaIpcPlaneName;
    what =
        "landed a chunk in place outside a device region (its landing is host memory, or "
        "another host)";
  } else {
    return Status::Ok();
  }
  if (plane != nullptr && plane->name() == required) return Status::Ok();
  const RegionPlane& wanted = *planes_.at(required);
  return FailedPrecondition(
      std::string("kvbus ") + wanted.name() + ": receiver " + endpoint_ + " " +
      (wanted.usable() ? what : "could not be opened here (" + wanted.error().ToString() + ")"));
}

void TcpSender::HandleDecisions(const WireDecisions& m) {
  if (!m.dropped_link.empty() && link_ && link_->usable() && m.dropped_link == link_->id()) {
    RenewLink(Unavailable("the receiver could not join it, or dropped it"));
  }
  WireCancel orphans{m.batch, {}};
  MapRegions(m.regions);
  {
    MutexLock lock(mu_);
    auto it = batches_.find(m.batch);
    for (const WireDecision& d : m.decisions) {
      Batch* batch = it == batches_.end() ? nullptr : &it->second;
      auto slot = batch ? batch->index.find(d.key) : decltype(batch->index)::iterator();
      if (!batch || slot == batch->index.end()) {
        // A grant for a batch this sender gave up on: hand the slot back.
        if (d.kind == WireDecisionKind::kGranted) orphans.keys.push_back(d.key);
        continue;
      }
      Slot& s = batch->slots[slot->second];
      if (s.phase != Phase::kOffered) continue;  // decided already: a repeat is harmless
      switch (d.kind) {
        case WireDecisionKind::kHeld:
          Finish(*batch, slot->second, ChunkOutcome::kSkipped, Status::Ok());
          break;
        case WireDecisionKind::kGranted: {
          // An in-place grant without a region, or into one this sender
          // could not map, takes the whole chunk by tcp (the receiver puts
          // it in place).
          const RegionPlane* plane = MappedPlane(d.region);
          const bool mapped = plane != nullptr;
          if (Status refused = PlaneRequired(d, plane); !refused.ok()) {
            // Cancelled below with the orphans: the receiver frees the grant.
            orphans.keys.push_back(d.key);
            Finish(*batch, slot->second, ChunkOutcome::kFailed, std::move(refused));
            break;
          }
          s.phase = Phase::kGranted;
          Outgoing out{m.batch, slot->second, s.chunk};
          out.linked = !mapped && GoesByLink(d);
          if (mapped || out.linked) {
            out.region = d.region;
            out.offset = d.offset;
            out.extents = d.extents;
          }
          data_.push_back(std::move(out));
          break;
        }
        case WireDecisionKind::kRejected:
          Finish(*batch, slot->second, ChunkOutcome::kFailed, d.status);
          break;
      }
    }
  }
  done_cv_.SignalAll();
  if (!orphans.keys.empty()) {
    Result<zmq::message_t> frame = EncodeWire(orphans);
    if (frame.ok()) control_.push_back(std::move(frame).value());
  }
}

void TcpSender::HandleAcks(const WireAcks& m) {
  for (const WireAck& a : m.acks) {
    if (!a.dropped_link.empty() && link_ && link_->usable() && a.dropped_link == link_->id()) {
      RenewLink(Unavailable("the receiver dropped it: " + a.status.ToString()));
    }
  }
  {
    MutexLock lock(mu_);
    for (const WireAck& a : m.acks) {
      auto it = batches_.find(a.batch);
      if (it == batches_.end()) continue;
      auto slot = it->second.index.find(a.key);
      if (slot == it->second.index.end()) continue;
      Slot& s = it->second.slots[slot->second];
      if (s.phase != Phase::kGranted && s.phase != Phase::kInFlight) continue;
      if (a.status.ok() && !a.duplicate && s.chunk) {
        PlaneStats& p = stats_.planes[s.plane != nullptr ? s.plane : "tcp"];
        p.chunks += 1;
        p.bytes += s.chunk.size();
      }
      Finish(it->second, slot->second, a.status.ok() ? ChunkOutcome::kSent : ChunkOutcome::kFailed,
             a.status);
    }
  }
  done_cv_.SignalAll();
}

void TcpSender::HandlePong(const WirePong& m) {
  // The receiver answered this Ping after every offer sent before it, and
  // after the decisions on them: an offer that is still undecided and whose
  // batch it does not list was dropped (this sender had gone silent for a
  // lease). Likewise a chunk sent before this Ping and still not acked: the
  // bytes or the ack were lost (a dropped connection), so it is offered again
  // too. Offering again is harmless: offers are idempotent by key.
  std::vector<WireOffer> offers;
  {
    MutexLock lock(mu_);
    for (auto& [id, batch] : batches_) {
      if (batch.unfinished == 0) continue;
      const bool waiting =
          std::binary_search(m.waiting_batches.begin(), m.waiting_batches.end(), id);
      for (Slot& slot : batch.slots) {
        if (slot.duplicate) continue;
        const bool lost = slot.phase == Phase::kInFlight && slot.sent_before_ping != 0 &&
                          slot.sent_before_ping <= m.seq;
        const bool dropped =
            !waiting && slot.phase == Phase::kOffered && slot.offered_before_ping <= m.seq;
        if (!lost && !dropped) continue;
        if (lost) {
          slot.phase = Phase::kOffered;
          slot.sent_before_ping = 0;
        }
        if (offers.empty() || offers.back().batch != id ||
            offers.back().entries.size() >= kMaxOfferEntries) {
          offers.push_back(NewOffer(id));
        }
        offers.back().entries.push_back(WireOfferEntry{slot.result.key, slot.chunk.size()});
        slot.offered_before_ping = ping_seq_ + 1;
      }
    }
  }
  for (const WireOffer& offer : offers) {
    Result<zmq::message_t> frame = EncodeWire(offer);
    if (frame.ok()) control_.push_back(std::move(frame).value());
  }
}

Status TcpSender::FlushControl() {
  while (!control_.empty()) {
    KDN_ASSIGN_OR_RETURN(const bool sent, TrySend(socket_, control_.front(), false));
    if (!sent) break;
    control_.pop_front();
  }
  return Status::Ok();
}

Status TcpSender::FlushData() {
  while (!data_.empty()) {
    Outgoing& out = data_.front();
    if (!out.claimed) {
      MutexLock lock(mu_);
      auto it = batches_.find(out.batch);
      if (it == batches_.end() || it->second.slots[out.slot].phase != Phase::kGranted) {
        data_.pop_front();  // decided meanwhile (failed, or acked by a repeat)
        continue;
      }
      it->second.slots[out.slot].phase = Phase::kInFlight;
      out.claimed = true;
    } else if (!out.header_sent) {
      // Failed meanwhile (a silent receiver, a lost connection): nothing of
      // it is read any more, its source (a SourcedChunk's blocks) included.
      MutexLock lock(mu_);
      auto it = batches_.find(out.batch);
      if (it == batches_.end() || it->second.slots[out.slot].phase == Phase::kDone) {
        data_.pop_front();
        continue;
      }
    }
    if (!out.header_sent && options_.faults.withhold_data &&
        options_.faults.withhold_data(out.chunk.key())) {
      data_.pop_front();
      continue;
    }
    bool sent = false;
    KDN_RETURN_IF_ERROR(SendChunk(out, sent));
    if (!sent) break;
    {
      // Pings wait for an empty control queue, so the next one follows these bytes.
      MutexLock lock(mu_);
      auto it = batches_.find(out.batch);
      if (it != batches_.end()) it->second.slots[out.slot].sent_before_ping = ping_seq_ + 1;
    }
    data_.pop_front();
  }
  return Status::Ok();
}

void TcpSender::FailOutgoing(const Outgoing& out, Status why) {
  {
    MutexLock lock(mu_);
    auto it = batches_.find(out.batch);
    if (it != batches_.end()) Finish(it->second, out.slot, ChunkOutcome::kFailed, std::move(why));
  }
  done_cv_.SignalAll();
  // Nothing was sent; the receiver frees the grant.
  Result<zmq::message_t> cancel = EncodeWire(WireCancel{out.batch, {out.chunk.key()}});
  if (cancel.ok()) control_.push_back(std::move(cancel).value());
}

Status TcpSender::LandChunk(Outgoing& out, bool& sent) {
  sent = false;
  const OutChunk& chunk = out.chunk;
  const bool in_place = !out.extents.empty();
  if (!out.header_sent) {
    // Every range is checked before a byte is written.
    const auto t0 = TransportClock::now();
    RegionPlane* plane = MappedPlane(out.region);
    const Status written =
        plane == nullptr
            ? NotFound("region " + std::to_string(out.region) + " is mapped by no plane")
            : plane->Write(
                  chunk, RegionGrant{out.region, out.offset, out.extents},
                  options_.faults.corrupt_data && options_.faults.corrupt_data(chunk.key()));
    if (!written.ok()) {
      FailOutgoing(out,
                   written.WithContext(std::string("kvbus ") + (plane ? plane->name() : "region") +
                                       " grant from " + endpoint_));
      sent = true;  // done with it
      return Status::Ok();
    }
    {
      MutexLock lock(mu_);
      stats_.planes[plane->name()].copy_seconds +=
          std::chrono::duration<double>(TransportClock::now() - t0).count();
      auto it = batches_.find(out.batch);
      if (it != batches_.end()) {
        it->second.slots[out.slot].plane = plane->name();
        it->second.plane = plane->name();
      }
    }
    out.header_sent = true;  // the bytes are in place; only the header is left to go
  }
  WireChunkHeader h{out.batch, chunk.key(), chunk.size(), /*landed=*/true, {}};
  if (in_place) {
    h.header.assign(reinterpret_cast<const char*>(chunk.header().data()), Chunk::kHeaderBytes);
  }
  KDN_ASSIGN_OR_RETURN(zmq::message_t header, EncodeWire(h));
  KDN_ASSIGN_OR_RETURN(sent, TrySend(socket_, header, /*more=*/false));
  return Status::Ok();
}

void TcpSender::RenewLink(const Status& why) {
  Result<std::unique_ptr<LinkPlane>> fresh =
      LinkPlane::Make(*options_.device_ops, LinkTimeout(options_));
  LogWarn("kvbus sender to {}: the nccl link ended ({}); {}", endpoint_, why.ToString(),
          fresh.ok() ? "offering a new one" : "no new one: " + fresh.status().ToString());
  if (!fresh.ok()) return;
  link_ = std::move(fresh).value();
  // Control goes out before data: the receiver reads this before any
  // header sent over the new link (batch 0 is never a sender's).
  Result<zmq::message_t> named = EncodeWire(NewOffer(0));
  if (named.ok()) control_.push_back(std::move(named).value());
}

Status TcpSender::LinkChunk(Outgoing& out, bool& sent) {
  const OutChunk& chunk = out.chunk;
  if (!out.header_sent && !link_->usable()) {
    // The link ended, and no new one could be made.
    FailOutgoing(out, link_->error().WithContext("kvbus nccl to " + endpoint_));
    sent = true;  // done with it
    return Status::Ok();
  }
  if (!out.header_sent) {
    // The header first: the receiver takes the payload off the link when
    // it reads it, onto the extents of the grant.
    WireChunkHeader h{out.batch, chunk.key(), chunk.size(), /*landed=*/true, {}, /*linked=*/true};
    h.header.assign(reinterpret_cast<const char*>(chunk.header().data()), Chunk::kHeaderBytes);
    KDN_ASSIGN_OR_RETURN(zmq::message_t header, EncodeWire(h));
    KDN_ASSIGN_OR_RETURN(sent, TrySend(socket_, header, /*more=*/false));
    if (!sent) return Status::Ok();
    out.header_sent = true;
  }
  sent = true;
  const auto t0 = TransportClock::now();
  const Status st =
      link_->Send(chunk, options_.faults.corrupt_data && options_.faults.corrupt_data(chunk.key()));
  if (!st.ok()) {
    RenewLink(st);
    // The receiver's receive fails too, and it acks the chunk failed.
    FailOutgoing(out, st.WithContext(std::string("kvbus nccl to ") + endpoint_));
    return Status::Ok();
  }
  MutexLock lock(mu_);
  stats_.planes[kLinkPlaneName].copy_seconds +=
      std::chrono::duration<double>(TransportClock::now() - t0).count();
  auto it = batches_.find(out.batch);
  if (it != batches_.end()) {
    it->second.slots[out.slot].plane = kLinkPlaneName;
    it->second.plane = kLinkPlaneName;
  }
  return Status::Ok();
}

Status TcpSender::SendChunk(Outgoing& out, bool& sent) {
  if (out.linked) return LinkChunk(out, sent);
  if (out.region != 0) return LandChunk(out, sent);
  sent = false;
  if (!out.chunk.chunk()) {
    // A sourced chunk goes by tcp from host memory: read it there once.
    Result<std::shared_ptr<const Chunk>> host = out.chunk.InHost();
    if (!host.ok()) {
      FailOutgoing(out, host.status().WithContext("kvbus tcp to " + endpoint_));
      sent = true;  // done with it
      return Status::Ok();
    }
    out.chunk = OutChunk(std::move(host).value());
  }
  const Chunk& chunk = *out.chunk.chunk();
  if (!out.header_sent) {
    KDN_ASSIGN_OR_RETURN(zmq::message_t header,
                         EncodeWire(WireChunkHeader{out.batch, chunk.key(), chunk.size()}));
    KDN_ASSIGN_OR_RETURN(const bool ok, TrySend(socket_, header, /*more=*/true));
    if (!ok) return Status::Ok();
    out.header_sent = true;
  }
  zmq::message_t body;
  if (options_.faults.corrupt_data && options_.faults.corrupt_data(chunk.key())) {
    KDN_ZMQ_RETURN_IF_ERROR(body.rebuild(chunk.bytes().data(), chunk.size()));
    const size_t at =
        chunk.payload().empty() ? 0 : Chunk::kHeaderBytes + chunk.payload().size() / 2;
    static_cast<uint8_t*>(body.data())[at] ^= 0x5a;
  } else {
    // No copy: ZeroMQ reads the chunk's own bytes and drops the reference
    // once they are on the wire or the frame is discarded.
    KDN_ZMQ_RETURN_IF_ERROR(body = ChunkMessage(out.chunk.chunk()));
  }
  // The header went out with "more": ZeroMQ admits the rest of a message it
  // has started, so this does not report a full queue in practice; if it
  // ever did, the body is retried on the next round.
  KDN_ASSIGN_OR_RETURN(sent, TrySend(socket_, body, /*more=*/false));
  return Status::Ok();
}

void TcpSender::CheckPeer(TransportClock::time_point now) {
  if (!busy_) return;
  if (now - last_heard_ > options_.peer_timeout) {
    FailUnfinished(Unavailable("kvbus tcp: no word from receiver " + endpoint_ + " for " +
                               std::to_string(options_.peer_timeout.count()) + " ms"),
                   TransportClock::time_point::max());
    busy_ = false;
    return;
  }
  if (now - last_ping_ >= options_.heartbeat_interval) {
    // Pings wait for an empty control queue (they must follow what is queued);
    // the interval restarts either way, so a queue that cannot drain does not
    // turn the poll timeout to zero and spin this thread.
    if (control_.empty()) {
      Result<zmq::message_t> frame = EncodeWire(WirePing{++ping_seq_});
      if (frame.ok()) control_.push_back(std::move(frame).value());
    }
    last_ping_ = now;
  }
}

}  // namespace kdn::kvbus
