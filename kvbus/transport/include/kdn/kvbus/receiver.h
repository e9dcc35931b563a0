#pragma once
// The receiving end of a kvbus transport: landing in place (the site and
// its claims), its options, its figures, the Receiver and Listen
// (kdn/kvbus/transport.h has the overview).

#include "kdn/kvbus/transport_types.h"

namespace kdn::kvbus {

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
  // "cuda_ipc"). One not registered is refused (INVALID_ARGUMENT, naming it),
  // as are cuda_ipc for host memory and any other for device memory.
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

// Binds `endpoint` ("tcp://host:port"; port 0 or * picks a free one, see
// Receiver::endpoint) and delivers into `sink`; creates the shm landing
// segment when options ask for one. UNAVAILABLE if the address cannot be
// bound (in use), INVALID_ARGUMENT if malformed, IO_ERROR if the segment
// cannot be made.
Result<std::unique_ptr<Receiver>> Listen(const std::string& endpoint, ChunkStore& sink,
                                         const ReceiverOptions& options = {});

}  // namespace kdn::kvbus
