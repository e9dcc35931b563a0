#pragma once
// Private to the tcp transport: the Sender and Receiver implementations and
// the small socket helpers they share. See kdn/kvbus/transport.h for the
// contracts and proto/kvbus_transport.proto for the wire.
//
// Threading: each TcpSender / TcpReceiver owns one ZeroMQ context, one socket
// and one I/O thread; after Start() the socket is touched by that thread only
// (ZeroMQ sockets are not thread-safe). Callers reach the thread through state
// guarded by mu_ and an eventfd that wakes its zmq_poll.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <optional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>
#include <zmq.hpp>

#include "kdn/common/mutex.h"
#include "kdn/kvbus/region.h"
#include "kdn/kvbus/transport.h"
#include "kdn/net/zmq_curve.h"
#include "kdn/net/peer_monitor.h"
#include "planes/receiver_planes.h"
#include "planes/data_plane.h"
#include "kdn/kvbus/shared_segment.h"
#include "kdn/kvbus/wire.h"

namespace kdn::kvbus {

using TransportClock = std::chrono::steady_clock;

// An eventfd that wakes a zmq_poll (RAII: closed on destruction). Signal()
// is thread-safe; Drain() belongs to the polling thread.
class WakeFd {
 public:
  static Result<std::unique_ptr<WakeFd>> Make();
  ~WakeFd();
  WakeFd(const WakeFd&) = delete;
  WakeFd& operator=(const WakeFd&) = delete;

  int fd() const { return fd_; }
  void Signal();
  void Drain();

 private:
  explicit WakeFd(int fd) : fd_(fd) {}
  int fd_;
};

// INVALID_ARGUMENT unless `endpoint` is "tcp://host:port"; port 0 or "*" only
// when `for_bind`. Returns the endpoint to hand to ZeroMQ (":0" becomes ":*").
Result<std::string> NormalizeTcpEndpoint(const std::string& endpoint, bool for_bind);

// Sends one frame without blocking: false when the socket would block (high
// water mark reached, or no peer yet), an error Status for anything else.
Result<bool> TrySend(zmq::socket_t& socket, zmq::message_t& frame, bool more);
// Receives one frame without blocking: false when none is waiting.
Result<bool> TryRecv(zmq::socket_t& socket, zmq::message_t& frame);
// Options both ends set: no linger on close, ZMTP heartbeats.
Status SetCommonSocketOptions(zmq::socket_t& socket, std::chrono::milliseconds heartbeat_interval,
                              std::chrono::milliseconds heartbeat_timeout);

class TcpSender final : public Sender {
 public:
  static Result<std::unique_ptr<Sender>> Start(const std::string& endpoint,
                                               const SenderOptions& options);
  ~TcpSender() override;

  Result<uint64_t> Submit(std::vector<std::shared_ptr<const Chunk>> chunks) override;
  Result<uint64_t> SubmitSourced(std::vector<SourcedChunk> chunks) override;
  Result<BatchStatus> Poll(uint64_t batch) override;
  Result<BatchStatus> Wait(uint64_t batch, std::chrono::milliseconds timeout) override;
  std::string endpoint() const override { return endpoint_; }
  SenderStats Stats() const override;

 private:
  // Where a chunk stands on the sender.
  enum class Phase : uint8_t { kOffered, kGranted, kInFlight, kDone };
  struct Slot {
    OutChunk chunk;
    ChunkResult result;
    Phase phase = Phase::kOffered;
    bool duplicate = false;            // a later copy of a key in its batch: not offered
    uint64_t offered_before_ping = 0;  // the first Ping sent after its latest offer
    uint64_t sent_before_ping = 0;     // the first Ping sent after its bytes (0: not sent)
    const char* plane = nullptr;       // the region plane its bytes went by; null: tcp
    std::vector<uint32_t> copies;      // the indices of its duplicates
  };
  struct Batch {
    TransportClock::time_point submitted;
    const char* plane = nullptr;  // the region plane a chunk of it went by; null: all tcp
    std::vector<Slot> slots;
    std::unordered_map<ChunkKey, uint32_t, ChunkKeyHash> index;  // first copy of each key
    size_t unfinished = 0;
  };
  // A granted chunk waiting for the socket.
  struct Outgoing {
    uint64_t batch = 0;
    uint32_t slot = 0;
    OutChunk chunk;
    bool claimed = false;      // phase set to kInFlight
    bool header_sent = false;  // its header frame is out: its bytes must follow
    uint32_t region = 0;       // granted into the receiver's region (a region plane); 0: tcp
    uint64_t offset = 0;
    std::vector<Extent> extents;  // in place: where in `region` the payload goes
    bool linked = false;          // in place over the link (the nccl plane), not mapped
  };

  TcpSender(std::string endpoint, const SenderOptions& options);
  Result<uint64_t> Enqueue(std::vector<OutChunk> chunks);
  // Fails the chunk `out` names with `why` (nothing of it was sent) and
  // asks the receiver to free its grant.
  void FailOutgoing(const Outgoing& out, Status why);

  void Run();  // the I/O thread
  Status RunOnce();
  Status OfferNewBatches();
  Status ReceiveAll();
  WireOffer NewOffer(uint64_t batch) const;  // with the shm fields as options_ allow
  void HandleDecisions(const WireDecisions& m);
  // FAILED_PRECONDITION when the transport asked for says `d` must go by a
  // region plane (kShm: every grant; kCudaIpc: in-place ones by the device
  // plane) and `plane`, the one that mapped its region, is not that one.
  Status PlaneRequired(const WireDecision& d, const RegionPlane* plane) const;
  void HandleAcks(const WireAcks& m);
  void HandlePong(const WirePong& m);
  Status FlushControl();
  Status FlushData();
  Status SendChunk(Outgoing& out, bool& sent);
  // Has the region plane write the chunk into its granted range (its
  // payload into its extents, in place) and sends the landed header.
  Status LandChunk(Outgoing& out, bool& sent);
  // Sends the chunk's header marked linked, then its payload over the link.
  Status LinkChunk(Outgoing& out, bool& sent);
  // A new link, of a new id, in place of one that ended (`why`), named at
  // once in an offer of no chunks ahead of any data: the receiver joins it
  // before the next linked chunk comes (it never joins a failed one again).
  void RenewLink(const Status& why);
  // Whether an in-place grant `d` into a region no plane mapped goes over
  // the link: a device region, the link up.
  bool GoesByLink(const WireDecision& d) const;
  // Maps the regions a Decisions names (I/O thread). A region that cannot
  // be mapped is left out of regions_ (auto: its grants go by tcp).
  void MapRegions(const std::vector<WireRegion>& regions);
  void CheckPeer(TransportClock::time_point now);
  // Fail fast (sender_liveness.cpp): watches the connection before it is
  // made; then, each round, fails what a lost or refused connection dooms.
  Status WatchConnection();
  Status CheckConnection(TransportClock::time_point now);
  // Fails the unfinished chunks of the batches submitted at or before
  // `submitted_by` with `status`, sends nothing more for them and asks the
  // receiver to cancel them. For a silent receiver and a dead connection.
  void FailUnfinished(const Status& status, TransportClock::time_point submitted_by);

  void Finish(Batch& batch, uint32_t slot, ChunkOutcome outcome, Status status) KDN_REQUIRES(mu_);
  void FailAllLocked(const Status& status) KDN_REQUIRES(mu_);
  BatchStatus SnapshotLocked(uint64_t id, const Batch& batch) const KDN_REQUIRES(mu_);

  // Constant after construction.
  const std::string endpoint_;
  const SenderOptions options_;
  zmq::context_t context_;
  zmq::socket_t socket_;  // the I/O thread's after Start()
  std::unique_ptr<WakeFd> wake_;
  std::thread thread_;
  // socket_'s connection events; the I/O thread's after Start().
  std::unique_ptr<net::PeerMonitor> monitor_;

  mutable Mutex mu_;
  CondVar done_cv_;
  std::map<uint64_t, Batch> batches_ KDN_GUARDED_BY(mu_);
  std::vector<uint64_t> to_offer_ KDN_GUARDED_BY(mu_);
  uint64_t next_batch_ KDN_GUARDED_BY(mu_) = 1;
  size_t unfinished_ KDN_GUARDED_BY(mu_) = 0;
  Status fatal_ KDN_GUARDED_BY(mu_);
  bool stop_ KDN_GUARDED_BY(mu_) = false;

  // The I/O thread's only.
  std::deque<zmq::message_t> control_;
  std::deque<Outgoing> data_;
  bool busy_ = false;
  TransportClock::time_point last_heard_;
  TransportClock::time_point last_ping_;
  uint64_t ping_seq_ = 0;
  // The region planes (kdn/kvbus/region_plane.h), by name, and the plane
  // each region the receiver named is written by. A plane is not usable
  // once a region of its cannot be mapped (auto falls back to tcp).
  std::map<std::string, std::unique_ptr<RegionPlane>> planes_;
  std::map<uint32_t, std::string> region_planes_;
  // The plane of `region`, if it has mapped it; null: none (tcp).
  RegionPlane* MappedPlane(uint32_t region);
  // The nccl plane (kNccl only): a link named in every offer while up.
  std::unique_ptr<LinkPlane> link_;
  TransportClock::time_point next_link_try_;  // when a link that could not be renewed is retried

  // Bytes sent per data plane, counted when acked.
  SenderStats stats_ KDN_GUARDED_BY(mu_);
};

class TcpReceiver final : public Receiver {
 public:
  static Result<std::unique_ptr<Receiver>> Start(const std::string& endpoint, ChunkStore& sink,
                                                 const ReceiverOptions& options);
  ~TcpReceiver() override;

  std::string endpoint() const override { return endpoint_; }
  ReceiverStats Stats() const override;
  Status Health() const override;

 private:
  struct LeaseKey {
    std::string peer;
    uint64_t batch = 0;
    ChunkKey key;
    friend auto operator<=>(const LeaseKey&, const LeaseKey&) = default;
  };
  struct Lease {
    uint64_t bytes = 0;
    TransportClock::time_point deadline;
    bool landing = false;         // granted a range of the shm segment:
    uint64_t landing_offset = 0;  // [landing_offset, +bytes)
    // Claimed by the landing site (kdn/kvbus/transport.h, "Landing in
    // place"); takes no slot capacity. in_region: the sender was told to
    // write the payload into the site's region itself.
    std::optional<Landing> in_place;
    bool in_region = false;
  };
  struct WaitingOffer {
    LeaseKey id;
    uint64_t bytes = 0;
  };
  struct Outbox {
    std::map<uint64_t, std::vector<WireDecision>> decisions;  // by batch
    std::vector<WireAck> acks;
    bool pong = false;
    uint64_t pong_seq = 0;
    std::string dropped_link;  // a link of the peer's it could not join, or dropped
  };

  TcpReceiver(ChunkStore& sink, const ReceiverOptions& options);

  void Run();  // the I/O thread
  Status RunOnce();
  Status ReceiveOne(bool& got);
  void Handle(const std::string& peer, const zmq::message_t& head, const zmq::message_t* data);
  void HandleOffer(const std::string& peer, const WireOffer& m);
  void HandleChunk(const std::string& peer, const WireChunkHeader& h, const zmq::message_t* data);
  // Landing in place (in_place.cpp): grants a claim, and has the
  // region's plane (receiver_planes.h) verify, or fill from a tcp frame, a
  // claimed chunk's payload where it lands.
  void GrantInPlace(const std::string& peer, uint64_t batch, const WireOfferEntry& e, Landing claim,
                    std::vector<WireDecision>& out);
  WireDecision InPlaceDecision(const ChunkKey& key, const Lease& lease) const;
  void HandleInPlace(const std::string& peer, const WireChunkHeader& h, const zmq::message_t* data,
                     const Lease& lease);
  // A linked chunk's payload taken off `peer`'s link onto `claim`, then
  // verified there. A link that fails is dropped, its id in `*dropped`.
  Result<ChunkInfo> ReceiveLinked(const std::string& peer, const WireChunkHeader& h,
                                  const Landing& claim, std::string* dropped);
  // The site hears how an in-place lease ended, if it was one.
  void EndClaim(const Lease& lease, const Status& status);
  // Verifies `bytes` bytes at `data` as the chunk `h` announced and Puts them
  // into the sink; the ack's status says how it went.
  void Deliver(const WireChunkHeader& h, std::shared_ptr<const uint8_t> data, size_t bytes,
               WireAck& ack);
  void HandleCancel(const std::string& peer, const WireCancel& m);
  void GrantWaiting(TransportClock::time_point now);
  void ExpireLeases(TransportClock::time_point now);
  void ForgetSilentPeers(TransportClock::time_point now);
  // Removes the lease, if there is one, and returns it; its landing range
  // is the caller's to free.
  std::optional<Lease> TakeLease(const LeaseKey& id);
  // Frees a landing range now, or (`quarantine`) once a further lease has
  // passed: a sender whose grant expired may still be writing to it.
  void FreeLanding(const Lease& lease, bool quarantine, TransportClock::time_point now);
  Status Flush();
  void Publish();

  // Constant after construction.
  std::string endpoint_;  // set in Start(), before the thread
  const ReceiverOptions options_;
  ChunkStore& sink_;
  zmq::context_t context_;
  zmq::socket_t socket_;                           // the I/O thread's after Start()
  std::unique_ptr<net::CurveAuthenticator> auth_;  // with CURVE; closed before context_
  std::unique_ptr<WakeFd> wake_;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  mutable Mutex mu_;
  ReceiverStats published_ KDN_GUARDED_BY(mu_);  // a copy of stats_ after each round
  Status health_ KDN_GUARDED_BY(mu_);            // what stopped the I/O thread, if anything
  uint64_t round_bytes_ = 0;                     // I/O thread only: bytes received this round

  // The I/O thread's only.
  ReceiverStats stats_;
  std::map<LeaseKey, Lease> leases_;
  std::set<std::pair<TransportClock::time_point, LeaseKey>> lease_deadlines_;  // of leases_
  std::unordered_map<ChunkKey, int, ChunkKeyHash> leased_keys_;  // keys with a lease, counted
  std::list<WaitingOffer> waiting_;
  std::unordered_map<std::string, TransportClock::time_point> last_seen_;
  TransportClock::time_point next_peer_check_;
  std::map<std::string, Outbox> outbox_;
  // The receiving halves of the region planes (receiver_planes.h): the shm
  // landing segment (none when options_.shm_landing_bytes is 0) and the
  // landing site's region (none without a site).
  std::unique_ptr<ShmLanding> shm_;
  std::unique_ptr<RegionLanding> in_place_;
  // The region planes each peer on this host can write with (its offers').
  std::unordered_map<std::string, std::vector<std::string>> peer_planes_;
  // The nccl plane's receiving halves: the link each peer's offers named,
  // joined as rank 1 through the landing region's backend, and the id of
  // each peer's last link that failed (not joined again: the sender names
  // a new one once it hears).
  // A link outlives its peer's silences (a sender idle for a while keeps
  // its link); it ends when it fails, or when kMaxLinks are joined and its
  // peer was heard from least recently.
  static constexpr size_t kMaxLinks = 64;
  struct PeerLink {
    std::string id;
    std::unique_ptr<DeviceLink> link;
  };
  std::unordered_map<std::string, PeerLink> links_;
  std::unordered_map<std::string, std::string> failed_links_;  // by peer
  void JoinLink(const std::string& peer, const std::string& id);
  DeviceLink* PeerLinkOf(const std::string& peer);
  // Ends `peer`'s link, never to be joined again; its id ("" if none).
  std::string DropLink(const std::string& peer);
  // Whether `peer` on this host can write regions of plane `plane` itself.
  bool PeerWrites(const std::string& peer, const std::string& plane) const;
};

}  // namespace kdn::kvbus
