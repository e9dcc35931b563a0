#pragma once
// The sending end of a kvbus transport: its options, its figures, the
// Sender and Connect (kdn/kvbus/transport.h has the overview).

#include "kdn/kvbus/transport_types.h"

namespace kdn::kvbus {

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

// Connects to a receiver at `endpoint` ("tcp://host:port"). Connecting is
// asynchronous: a receiver that is not up yet gets the data once it is, as
// long as it comes within the batch's connect_timeout; while nothing listens
// there, batches fail after connect_timeout (a host that does not answer at
// all: after peer_timeout). INVALID_ARGUMENT for a malformed endpoint or
// options.
Result<std::unique_ptr<Sender>> Connect(const std::string& endpoint,
                                        const SenderOptions& options = {});

}  // namespace kdn::kvbus
