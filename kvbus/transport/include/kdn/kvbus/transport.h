#pragma once
// kvbus transports: move KV chunks from one process's memory into another's
// ChunkStore (docs/design.md, "kvbus transports"). One small interface that
// every implementation provides; all pass tests/kvbus/transport_conformance.h.
// The control plane (offers, grants, acks) is always ZeroMQ over the
// receiver's tcp endpoint; the data plane is the transport's:
//   tcp  the chunk's bytes follow its header on the same connection;
//   shm  the receiver grants a range of its shared-memory landing segment
//        (a registered region, kdn/kvbus/region.h), the sender copies the
//        bytes there and sends only the header. Same host only.
//   cuda_ipc  a chunk claimed by a landing site whose region is a device
//        backend's memory (kdn/kvbus/device_ops.h) is written there by the
//        sender through the same backend, its header sent alone. Same host
//        (and, for CUDA, GPUs that can reach each other) only.
//   nccl  a chunk claimed by a landing site whose region is a device
//        backend's memory goes as its header, then its payload over a link
//        of that backend (DeviceLink: NCCL between GPUs) that the receiver
//        joined from the id in the sender's offers; the receiver receives
//        it onto the claimed extents. Any hosts NCCL connects.
// TransportKind::kAuto picks the region plane of each grant's region when
// the two ends share a host and the sender can open it, tcp otherwise
// (docs/kvbus.md).
//
// Landing in place: a receiver given a LandingSite asks it, for each key
// offered, where that chunk's payload goes (the decode worker: the KV
// blocks a request reserved). A claimed chunk's payload is written straight
// there, never into the sink: by the sender itself when it can map the
// site's region (shm, or cuda_ipc for a device region), else by the
// receiver from the tcp frame. Its header
// travels on the control connection, and the receiver verifies the payload
// where it lies (checksum, key, shape) before it tells the site.
//
// Asynchronous and batched: Sender::Submit hands over a batch and returns its
// id at once; Poll or Wait report, per chunk, whether it was sent, skipped
// (the receiver already held it) or failed, with a Status. Under the hood an
// offer/accept handshake: the sender offers the batch's keys and sizes, the
// receiver answers with the keys it holds (never sent) and grants slots for
// the rest under a lease, as far as its slot capacity allows; the rest is
// granted as acks free space. The receiver verifies every chunk
// (Chunk::Parse, and that the key is the one announced) before it Puts it in
// its sink. Idempotent by key: offering or sending a chunk twice is harmless.
//
// Failure: a dead receiver costs only the batches sent to it, and at once.
// The sender watches its connection: when it is lost (the receiver's process
// died or closed) the unfinished chunks of every batch fail with UNAVAILABLE
// "connection lost" straight away, and nothing more is sent for them; while
// the endpoint refuses connections (nothing listens there), a batch that has
// waited SenderOptions::connect_timeout fails with UNAVAILABLE "connection
// refused". A receiver that is alive but silent (hung, or a host that drops
// packets) fails them within SenderOptions::peer_timeout. The sender is not
// broken for good: it reconnects on its own, and a receiver that comes back
// at the endpoint serves later batches. A sender that vanishes leaks nothing
// on the receiver, whose leases expire after ReceiverOptions::lease. A
// failed batch is cancelled there (its slots freed, should the receiver only
// have been slow); chunks already stored stay (they are verified and
// content-addressed).

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/net/curve.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/region.h"

namespace kdn::kvbus {

enum class ChunkOutcome : uint8_t {
  kPending = 0,  // not decided yet
  kSent,         // the receiver verified and stored it (or found it held on arrival)
  kSkipped,      // the receiver already held the key: nothing was sent
  kFailed,       // see ChunkResult::status
};
const char* ChunkOutcomeName(ChunkOutcome outcome);

enum class TransportKind : uint8_t {
  kAuto = 0,  // by topology: shm on one host when the receiver offers it, else tcp
  kTcp,       // bytes on the ZeroMQ connection, any host
  kShm,       // only shm: a grant it cannot use fails its chunk
  // Chunks claimed in place only by the device plane (a claim it cannot
  // write fails its chunk); the rest as kAuto. Needs SenderOptions::device_ops.
  kCudaIpc,
  // Chunks claimed in place only over a link of SenderOptions::device_ops
  // (a claim outside a device region, or a receiver that did not join the
  // link, fails its chunk); the rest as kAuto.
  kNccl,
};
const char* TransportKindName(TransportKind kind);
// "auto", "tcp", "shm", "cuda_ipc" or "nccl"; INVALID_ARGUMENT otherwise.
Result<TransportKind> ParseTransportKind(const std::string& name);
// Whether `kind` lands claimed chunks by a device plane (cuda_ipc, nccl),
// which needs a device backend at both ends.
inline bool OverDevicePlane(TransportKind kind) {
  return kind == TransportKind::kCudaIpc || kind == TransportKind::kNccl;
}

struct ChunkResult {
  ChunkKey key;
  ChunkOutcome outcome = ChunkOutcome::kPending;
  Status status;  // not OK exactly when outcome is kFailed
};

// A snapshot of one batch.
struct BatchStatus {
  uint64_t batch = 0;
  bool done = false;                // every chunk has a final outcome
  std::vector<ChunkResult> chunks;  // in submission order

  size_t Count(ChunkOutcome outcome) const;
  // OK when done and nothing failed; the first failed chunk's Status (naming
  // its key) when one failed; DEADLINE_EXCEEDED when not done yet.
  Status ToStatus() const;
};

// Fault injection for tests (leveldb's fault_injection_test style): left
// empty in production. Called on the sender's I/O thread; must be thread-safe.
struct SenderFaults {
  // A granted chunk for which this returns true is never sent, as if the
  // sender died between the grant and the data. Its outcome stays kPending
  // until the receiver goes silent or its connection is lost.
  std::function<bool(const ChunkKey&)> withhold_data;
  // A chunk for which this returns true is sent with one payload byte
  // flipped (the receiver must reject it: kFailed, CORRUPTION).
  std::function<bool(const ChunkKey&)> corrupt_data;
};

struct SenderOptions {
  // A sender with unfinished batches that hears nothing from its receiver for
  // this long fails their unfinished chunks with UNAVAILABLE. Must exceed the
  // time one chunk takes on the wire plus the receiver's slowest sink Put.
  std::chrono::milliseconds peer_timeout{10000};
  // While the receiver's endpoint refuses connections (nothing listens there:
  // not up yet, or dead), a batch that has waited this long since Submit
  // fails with UNAVAILABLE; younger batches wait, so a receiver that comes up
  // within it still gets them. A connection lost while batches are unfinished
  // fails them at once, whatever this is. Must be >= 0 (0: fail at the first
  // refusal).
  std::chrono::milliseconds connect_timeout{1000};
  // While busy, the sender pings at this interval (the receiver answers), and
  // ZeroMQ heartbeats the connection at it. Must be below peer_timeout, and
  // should be well below the receivers' lease (a receiver drops the queued
  // offers of a sender silent for a lease; the sender offers them again on
  // its next ping, which costs a round trip).
  std::chrono::milliseconds heartbeat_interval{1000};
  // SO_SNDBUF of the connection; 0 leaves it to the OS (autotuning). On
  // loopback about 1 MiB roughly doubles throughput over the default; over a
  // long fat link a fixed size can cap it below the bandwidth-delay product.
  int socket_buffer_bytes = 0;
  // Which data plane to use (see TransportKind). With kAuto, a receiver's
  // segment the sender cannot map (another pid namespace) makes it send the
  // bytes by tcp instead, for that chunk and every later one.
  TransportKind transport = TransportKind::kAuto;
  // Set: the sender has a cuda_ipc plane, which opens receivers' device
  // regions and writes them through this backend (borrowed: it must
  // outlive the Sender); with kNccl, the nccl plane instead, a link of
  // this backend. Required by kCudaIpc and kNccl.
  DeviceOps* device_ops = nullptr;
  // Set: the connection runs CURVE as a holder of this key, the receiver's
  // (kdn/net/curve.h). Its control messages and tcp chunks are then
  // encrypted; shm chunks never leave the host's memory (docs/kvbus.md).
  std::optional<net::CurveKeys> curve;
  SenderFaults faults;
};

// What a sender moved over one data plane (its chunks acked as stored), and
// the seconds its batches were in flight there, from Submit to the last
// outcome (a batch counts for the region plane any of its chunks landed by,
// else for tcp); copy_seconds: of those, spent writing into the receivers'
// regions (region planes only).
struct PlaneStats {
  uint64_t chunks = 0, bytes = 0;
  double seconds = 0, copy_seconds = 0;

  PlaneStats& operator+=(const PlaneStats& o) {
    chunks += o.chunks;
    bytes += o.bytes;
    seconds += o.seconds;
    copy_seconds += o.copy_seconds;
    return *this;
  }
};

// Per data plane, by its name ("tcp", "shm"): a plane shows up once used.
struct SenderStats {
  std::map<std::string, PlaneStats> planes;

  // `name`'s figures; zeros when it moved nothing.
  PlaneStats plane(const std::string& name) const {
    const auto it = planes.find(name);
    return it == planes.end() ? PlaneStats{} : it->second;
  }
  SenderStats& operator+=(const SenderStats& o) {
    for (const auto& [name, p] : o.planes) planes[name] += p;
    return *this;
  }
};

// What the transports call this host: equal in two processes exactly when
// they share a kernel (its boot id, else the host name), unless the
// environment variable KDN_HOST_ID names the host instead. The Slurm job sets
// it to the node's name, so that nodes emulated on one machine (several
// slurmd) are told apart as real nodes are. Workers report it.
const std::string& HostId();

// Where a chunk's payload lands in place (see the top of this file).
struct Landing {
  // The site's own name for this claim, handed back to Landed.
  uint64_t ticket = 0;
  // In the landing region (ReceiverOptions::landing_region), in payload
  // order; their bytes add up to the payload's.
  std::vector<Extent> extents;
};

// The receiver's questions to whoever owns the landing region. Called on the
// receiver's I/O thread: thread-safe, quick, and never calling the Receiver.
class LandingSite {
 public:
  virtual ~LandingSite() = default;
  // `key` is offered with a payload of `payload_bytes`: where it lands, or
  // none (it goes to the sink, as without a site). Each claim is filled by
  // a transfer of its own, so a key claimed twice moves twice.
  virtual std::optional<Landing> Claim(const ChunkKey& key, uint64_t payload_bytes) = 0;
  // The end of claim `ticket`. `arrived` holds the chunk's header when its
  // payload landed in the extents and was verified there (key as offered,
  // raw, payload checksum); the site checks the rest (shape, dtype,
  // position, model) and returns OK to accept it, or the error the sender
  // is told. Otherwise `arrived` says why nothing usable landed (the bytes
  // failed verification, the sender cancelled, the lease ran out) and the
  // result is ignored. After a failure a slow sender may still be writing
  // to the extents until one more lease has passed.
  virtual Status Landed(uint64_t ticket, const Result<ChunkInfo>& arrived) = 0;
};

struct ReceiverOptions {
  // Bytes of granted but not yet arrived chunks the receiver allows at once
  // (the memory it commits to transfers in flight). A chunk larger than this
  // is refused with RESOURCE_EXHAUSTED. Must be > 0.
  uint64_t slot_capacity_bytes = uint64_t{1} << 30;
  // A granted slot whose chunk has not arrived this long after the grant is
  // freed (a late chunk is still accepted). Offers waiting for slots are
  // dropped once their sender has been silent this long (a live sender offers
  // them again). Keep it well above the senders' heartbeat_interval.
  std::chrono::milliseconds lease{30000};
  // ZeroMQ heartbeat interval on the receiver's connections.
  std::chrono::milliseconds heartbeat_interval{1000};
  // SO_RCVBUF of its connections; 0 leaves it to the OS (see SenderOptions).
  int socket_buffer_bytes = 0;
  // Size of the shared-memory segment shm senders on this host write into;
  // 0: none (every sender uses tcp). Granted chunks hold a range of it from
  // the grant until their bytes are verified and copied out; a chunk that
  // finds no room is granted for tcp instead.
  uint64_t shm_landing_bytes = 0;
  // Set: the socket runs CURVE and admits only senders holding this key.
  std::optional<net::CurveKeys> curve;
  // Landing in place (see the top of this file): the site that claims
  // chunks, and the memory its extents address, which senders on this host
  // with a plane of landing_kind open: kShm for the host backend's memory
  // (the shm plane), kDevice for a device backend's (the cuda_ipc plane;
  // or the host backend standing in for a device). Both or neither;
  // borrowed, they must outlive the Receiver. Claimed chunks take no slot
  // capacity (their memory is the site's), but no chunk larger than it is
  // claimed. Payloads are verified, and tcp frames put in place, through
  // the region's backend (DeviceMemory::ops).
  LandingSite* landing = nullptr;
  const DeviceMemory* landing_region = nullptr;
  RegionKind landing_kind = RegionKind::kShm;
  // The region plane senders write the landing region with, by name
  // (kdn/kvbus/region_plane.h); empty: landing_kind's ("shm" or
  // "cuda_ipc"). One not registered is refused (INVALID_ARGUMENT, naming it).
  std::string landing_plane;
  // Whether senders on this host may write the landing region themselves;
  // false: claimed chunks all come by tcp and the receiver puts them in
  // place (a decode worker started with --kv-transport tcp).
  bool landing_by_plane = true;
};

struct ReceiverStats {
  // Chunks that arrived (valid or not) and their bytes, by the data plane
  // that carried them ("tcp", "shm", "cuda_ipc"; seconds unused): a plane
  // shows up once used.
  std::map<std::string, PlaneStats> planes;
  uint64_t offers = 0;  // offer messages handled
  uint64_t chunks_offered = 0;
  uint64_t chunks_held = 0;  // offered keys the sink already held (skipped)
  uint64_t chunks_granted = 0;
  uint64_t chunks_received = 0;  // chunk frames that arrived, valid or not
  uint64_t bytes_received = 0;   // their bytes
  uint64_t chunks_stored = 0;    // verified and Put into the sink
  uint64_t duplicates = 0;       // verified but already held on arrival
  uint64_t chunks_rejected = 0;  // failed verification: never stored
  uint64_t put_failures = 0;     // the sink refused a verified chunk
  uint64_t bad_messages = 0;     // undecodable frames, dropped
  uint64_t leases_expired = 0;
  uint64_t leases_cancelled = 0;
  uint64_t leased_bytes = 0;  // granted and not yet arrived, now
  uint64_t peak_leased_bytes = 0;
  uint64_t waiting_chunks = 0;  // offered, waiting for a slot, now
  // Of chunks_received, those whose bytes landed in the shm segment.
  uint64_t shm_chunks = 0;
  uint64_t shm_bytes = 0;
  uint64_t shm_landing_bytes = 0;  // the segment's size (0: no shm)
  uint64_t shm_landed_bytes = 0;   // of it, granted or quarantined now
  // Landing in place: claims granted, and chunks verified in place (of
  // them, written there by the sender through a region plane, shm or
  // cuda_ipc as landing_kind says; the rest came by tcp and the receiver
  // copied their payloads).
  uint64_t in_place_claims = 0;
  uint64_t in_place_chunks = 0, in_place_bytes = 0;
  uint64_t in_place_plane_chunks = 0;
};

// A chunk the sender reads where it lies rather than from a Chunk in host
// memory: a layer slice of the sender's own KV pool, whose payload is
// extents of memory of a DeviceOps backend, in payload order. Made by
// MakeSourcedChunk; see Sender::SubmitSourced.
struct SourcedChunk {
  ChunkInfo info;  // raw; the payload is info.payload_bytes()
  // Sealed over the payload where it lies (Chunk::SealedHeader).
  std::array<uint8_t, Chunk::kHeaderBytes> header{};
  const DeviceMemory* memory = nullptr;  // borrowed
  std::vector<Extent> extents;
  uint64_t size() const { return Chunk::kHeaderBytes + info.payload_bytes(); }
};

// The chunk `info` whose payload is `extents` of `memory`: checksummed
// through the memory's backend, its header sealed. INVALID_ARGUMENT for an
// encoded info, an extent outside the memory, or extents that do not hold
// the payload exactly.
Result<SourcedChunk> MakeSourcedChunk(const ChunkInfo& info, const DeviceMemory& memory,
                                      std::vector<Extent> extents);

// The sending end of one connection to one receiver. Thread-safe: Submit,
// Poll and Wait may be called from any threads. One background I/O thread
// per Sender; the destructor stops it (unfinished chunks are abandoned, and
// the receiver's leases for them expire). Must not be destroyed while
// another thread is inside one of its calls.
class Sender {
 public:
  virtual ~Sender() = default;

  // Queues `chunks` (non-null; a key may repeat: later copies share the first
  // one's outcome) for delivery and returns the batch's id at once. The
  // sender keeps the chunks alive until they are sent or the batch ends.
  // INVALID_ARGUMENT for a null chunk; the I/O thread's fatal error if it died.
  virtual Result<uint64_t> Submit(std::vector<std::shared_ptr<const Chunk>> chunks) = 0;

  // A snapshot of `batch`. Once a Poll or Wait has reported the batch done,
  // the sender forgets it and later calls give NOT_FOUND.
  virtual Result<BatchStatus> Poll(uint64_t batch) = 0;

  // Blocks until `batch` is done or `timeout` passes, then returns as Poll
  // does (done is false on a timeout). Never blocks longer than `timeout`.
  virtual Result<BatchStatus> Wait(uint64_t batch, std::chrono::milliseconds timeout) = 0;

  // As Submit, for chunks read where they lie. A region plane of the
  // source's backend copies each payload straight from its extents into
  // the receiver's region (DeviceOps::Copy: no host copy); a plane of
  // another backend, or tcp, reads it into host memory first (the bytes
  // read must match the sealed header, else the chunk fails with
  // CORRUPTION). The source's memory must outlive the batch, and its bytes
  // stay unchanged until the batch is done. INVALID_ARGUMENT for a chunk
  // without memory.
  virtual Result<uint64_t> SubmitSourced(std::vector<SourcedChunk> chunks) = 0;

  // The receiver's endpoint this sender delivers to.
  virtual std::string endpoint() const = 0;

  virtual SenderStats Stats() const = 0;
};

// The receiving end: accepts connections from any number of senders and
// delivers verified chunks into the sink given at creation, which must
// outlive the Receiver. Thread-safe: endpoint() and Stats() from any thread.
// One background I/O thread; the destructor stops it and closes the socket
// (senders then see the receiver as gone).
class Receiver {
 public:
  virtual ~Receiver() = default;
  // The endpoint senders connect to, with the port the OS chose if port 0
  // was asked for (e.g. "tcp://127.0.0.1:40123").
  virtual std::string endpoint() const = 0;
  virtual ReceiverStats Stats() const = 0;
  // OK while the I/O thread serves; the error that stopped it otherwise (the
  // socket stays open, so senders only notice by their peer timeout: owners
  // should check this, e.g. in a health endpoint).
  virtual Status Health() const = 0;
};

// Connects to a receiver at `endpoint` ("tcp://host:port"). Connecting is
// asynchronous: a receiver that is not up yet gets the data once it is, as
// long as it comes within the batch's connect_timeout; while nothing listens
// there, batches fail after connect_timeout (a host that does not answer at
// all: after peer_timeout). INVALID_ARGUMENT for a malformed endpoint or
// options.
Result<std::unique_ptr<Sender>> Connect(const std::string& endpoint,
                                        const SenderOptions& options = {});

// Binds `endpoint` ("tcp://host:port"; port 0 or * picks a free one, see
// Receiver::endpoint) and delivers into `sink`; creates the shm landing
// segment when options ask for one. UNAVAILABLE if the address cannot be
// bound (in use), INVALID_ARGUMENT if malformed, IO_ERROR if the segment
// cannot be made.
Result<std::unique_ptr<Receiver>> Listen(const std::string& endpoint, ChunkStore& sink,
                                         const ReceiverOptions& options = {});

}  // namespace kdn::kvbus
