#pragma once
// The operations a kvbus device plane needs from the memory it moves KV
// between (docs/kvbus.md, "Device planes"), behind one small interface so
// that the planes' code is one path with two backends:
//   host  plain memory in memfd segments (kdn/kvbus/shared_segment.h),
//         written with streaming stores and checksummed in place: the shm
//         plane's memory, and the stand-in that lets the CPU suite run the
//         cuda_ipc plane (sender, receiver, claims, bounds, expiry, cancel,
//         dead peers) without a GPU;
//   cuda  device memory exported with CUDA IPC (kvbus/cuda/).
//
// A receiver exports memory (Allocate, or a backend's own export of memory
// it already holds) and names it by handle() in its grants; a sender on
// the same host opens the handle and writes layer slices into extents of
// it; the receiver verifies them where they landed with Checksum. Over
// the nccl plane (any hosts) the two join a link instead (NCCL for cuda,
// a loopback socket for the host backend): the sender sends each slice
// from extents of its memory, the receiver receives it onto the claimed
// extents of its own and verifies it there.
//
// Thread-safe: a backend's calls may come from any thread.

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kdn/common/status.h"
#include "kdn/kvbus/region.h"

namespace kdn::kvbus {

class DeviceOps;

// The kind of a receiver's region, which names the data plane that writes
// it (the values of proto/kvbus_transport.proto's RegionKind). A sender
// keeps regions of a kind it has no plane for unmapped: grants into them go
// by tcp.
enum class RegionKind : uint8_t {
  kUnknown = 0,  // a kind of a newer receiver
  kShm = 1,      // host memory shared on one host: the shm plane
  kDevice = 2,   // memory of a device backend, opened by handle: the cuda_ipc plane
};
const char* RegionKindName(RegionKind kind);

// Memory of one backend, allocated (and exported) by this process or opened
// from a peer's handle. Freed or unmapped on destruction; an opened peer's
// memory stays the peer's.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // In this process's address space (device memory for cuda: not to be
  // dereferenced on the host).
  virtual uint8_t* data() const = 0;
  virtual uint64_t bytes() const = 0;
  // What a peer's DeviceOps::Open takes (ASCII, one line).
  virtual const std::string& handle() const = 0;
  virtual DeviceOps& ops() const = 0;
};

// One direction of a link between two processes (the nccl plane's): rank 0
// sends messages, rank 1 receives them, in order, each from and onto
// extents of memory of the link's backend. Made by DeviceOps::JoinLink.
// Any failed Send or Recv aborts the link (a message half-sent leaves the
// stream unusable); after Abort every call answers FAILED_PRECONDITION.
// Not thread-safe: one caller at a time.
class DeviceLink {
 public:
  virtual ~DeviceLink() = default;
  // Rank 0: sends the bytes of `extents` of `base` (memory of this
  // backend: its own or host memory for the host backend) as one message.
  virtual Status Send(const uint8_t* base, std::span<const Extent> extents) = 0;
  // Rank 1: receives the next message onto `extents` of `base`, which must
  // hold exactly its bytes (INVALID_ARGUMENT, the link aborted, when they
  // do not; NCCL cannot tell, and its wait runs into the deadline).
  virtual Status Recv(uint8_t* base, std::span<const Extent> extents) = 0;
  virtual void Abort() = 0;
  virtual bool aborted() const = 0;
};

class DeviceOps {
 public:
  virtual ~DeviceOps() = default;
  virtual const char* name() const = 0;  // "host", "cuda"
  // How a region table holds this backend's memory (kdn/kvbus/region.h).
  virtual MemoryKind memory_kind() const = 0;
  virtual int device() const = 0;  // -1 for host memory

  // `bytes` of fresh memory, zero-filled, that peers may open.
  // INVALID_ARGUMENT for 0 bytes; IO_ERROR or UNAVAILABLE when the
  // backend refuses.
  virtual Result<std::unique_ptr<DeviceMemory>> Allocate(uint64_t bytes) = 0;
  // Maps a peer's memory by its handle; `bytes` must be its size.
  // INVALID_ARGUMENT for a malformed handle or a size that differs;
  // UNAVAILABLE when it cannot be reached from here (another host, another
  // pid namespace, another GPU).
  virtual Result<std::unique_ptr<DeviceMemory>> Open(const std::string& handle, uint64_t bytes) = 0;

  // Writes the bytes at `host` (host memory, as many as `extents` hold)
  // onto `extents` of `base`, memory of this backend, in order. When it
  // returns OK the bytes are visible to the memory's owner. The caller has
  // checked the extents against the memory's bounds.
  virtual Status Upload(const uint8_t* host, uint8_t* base, std::span<const Extent> extents) = 0;
  // Copies the bytes of `src` extents of `src_base` onto `dst` extents of
  // `dst_base` (both memory of this backend: its own or a peer's opened
  // here), in order, the two lists cut anywhere but holding the same total.
  // Done (visible to the destination's owner) when it returns OK.
  // INVALID_ARGUMENT, nothing copied, when the totals differ.
  virtual Status Copy(const uint8_t* src_base, std::span<const Extent> src, uint8_t* dst_base,
                      std::span<const Extent> dst) = 0;
  // Reads the bytes of `extents` of `base` (memory of this backend), in
  // order, into `host` (host memory, as many bytes as they hold).
  virtual Status Download(const uint8_t* base, std::span<const Extent> extents, uint8_t* host) = 0;
  // XXH3-64 of the bytes of `extents` of `base`, in order: equal to
  // PayloadChecksum (kdn/kvbus/chunk.h) of the same bytes in host memory.
  virtual Result<uint64_t> Checksum(const uint8_t* base, std::span<const Extent> extents) = 0;

  // A fresh link id (ASCII, one line) whose rank 0 is this process, to be
  // carried to the peer over kdn's authenticated control channel.
  virtual Result<std::string> NewLinkId() = 0;
  // Joins link `id` as `rank` (0: the process that made the id, which
  // sends; 1: the peer, which receives). Returns at once: the first Send
  // or Recv waits for the other side to have joined. `timeout` bounds
  // that wait and each message (a dead or silent peer: DEADLINE_EXCEEDED,
  // the link aborted). INVALID_ARGUMENT for a malformed id or rank, or
  // (host backend) a rank-0 id this process did not make or joined already;
  // NCCL finds those at the join.
  virtual Result<std::unique_ptr<DeviceLink>> JoinLink(const std::string& id, int rank,
                                                       std::chrono::milliseconds timeout) = 0;
};

// The host backend (one per process).
DeviceOps& HostDeviceOps();

// The host backend standing in for a device (the cuda_ipc plane with no
// GPU), when the environment variable KDN_DEVICE_OPS is "host": workers'
// test mode (docs/kvbus.md, "Device planes"); null otherwise.
DeviceOps* StandInDeviceOps();

}  // namespace kdn::kvbus
