#pragma once
// Private to the kvbus transports: a sender's data plane for grants into a
// region of the receiver's memory (docs/kvbus.md, "Transports"). TcpSender
// runs the control protocol (offers, grants, acks, liveness) and sends a
// granted chunk's bytes in a frame after its header (the tcp plane); it
// holds one RegionPlane per region kind (kdn/kvbus/device_ops.h), and a
// grant that names a region goes to the plane of that region's kind, which
// writes the bytes there itself before the header goes out marked landed.
// Both region planes are MemoryPlanes over a DeviceOps backend
// (kdn/kvbus/device_ops.h): shm over the host backend's segments (a landing
// segment, or a decode worker's KV pool landed in place), cuda_ipc over a
// device backend's exported memory. The nccl plane (LinkPlane) writes no
// region itself: it sends each payload over a link the receiver joined,
// and the receiver receives it onto the claimed extents.
//
// Not thread-safe: the sender's I/O thread owns its planes.

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/region.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/transport.h"
#include "kdn/kvbus/wire.h"

namespace kdn::kvbus {

// The name of the plane that writes regions of `kind` ("shm", "cuda_ipc"),
// the key of its figures in SenderStats and ReceiverStats.
inline const char* PlaneName(RegionKind kind) {
  switch (kind) {
    case RegionKind::kShm: return "shm";
    case RegionKind::kDevice: return "cuda_ipc";
    case RegionKind::kUnknown: break;
  }
  return "unknown";
}
// The nccl plane's name (a link, whatever its backend).
inline constexpr const char* kLinkPlaneName = "nccl";

// A chunk a sender delivers: one in host memory, or one it reads where it
// lies (SourcedChunk, kdn/kvbus/transport.h). Copies share the bytes.
class OutChunk {
 public:
  OutChunk() = default;
  explicit OutChunk(std::shared_ptr<const Chunk> chunk) : chunk_(std::move(chunk)) {}
  explicit OutChunk(std::shared_ptr<const SourcedChunk> sourced) : sourced_(std::move(sourced)) {}
  explicit operator bool() const { return chunk_ || sourced_; }

  const ChunkKey& key() const { return chunk_ ? chunk_->key() : sourced_->info.key; }
  uint64_t size() const { return chunk_ ? chunk_->size() : sourced_->size(); }
  uint64_t payload_bytes() const { return size() - Chunk::kHeaderBytes; }
  std::span<const uint8_t> header() const {
    return chunk_ ? chunk_->bytes().first(Chunk::kHeaderBytes)
                  : std::span<const uint8_t>(sourced_->header);
  }
  const std::shared_ptr<const Chunk>& chunk() const { return chunk_; }  // null when sourced
  const SourcedChunk* sourced() const { return sourced_.get(); }
  // The chunk in host memory: itself, or its payload read through its
  // backend into a new chunk, which must match its sealed header
  // (CORRUPTION: the source changed since it was sealed).
  Result<std::shared_ptr<const Chunk>> InHost() const;

 private:
  std::shared_ptr<const Chunk> chunk_;
  std::shared_ptr<const SourcedChunk> sourced_;
};

// Where a grant puts a chunk: the whole chunk at `offset` of `region`, or (in
// place) its payload over `extents` of it, in order.
struct RegionGrant {
  uint32_t region = 0;
  uint64_t offset = 0;
  std::vector<Extent> extents;
};

class RegionPlane {
 public:
  virtual ~RegionPlane() = default;
  virtual const char* name() const = 0;  // its stats' key (SenderStats::planes)
  virtual RegionKind kind() const = 0;
  // Maps the regions of its kind a Decisions message names (those already mapped are
  // kept; one whose handle changed, a new receiver's, is mapped again). A
  // region that cannot be mapped from here is left out, and usable() turns
  // false with the reason in error().
  virtual void Map(const std::vector<WireRegion>& regions) = 0;
  virtual bool Mapped(uint32_t region) const = 0;
  virtual bool usable() const = 0;
  virtual const Status& error() const = 0;
  // Writes `chunk` where `grant` says, every range checked against the
  // mapped region before a byte moves (nothing written on error: NOT_FOUND
  // for a region not mapped, INVALID_ARGUMENT for a range outside it or
  // extents that do not add up to the payload). A sourced chunk of this
  // plane's backend is copied from where it lies; one of another backend
  // is read into host memory first. `corrupt` flips one payload byte where
  // it lands (SenderFaults::corrupt_data).
  virtual Status Write(const OutChunk& chunk, const RegionGrant& grant, bool corrupt) = 0;
};

// The plane of memory a DeviceOps backend opens by handle (every region
// plane: shm is the host backend's memfd segments, cuda_ipc a device
// backend's exported memory, or the host backend standing in for one).
// Ranges are checked against the opened region's bounds in a RegionTable;
// the bytes are written with the backend's Upload.
class MemoryPlane final : public RegionPlane {
 public:
  MemoryPlane(RegionKind kind, DeviceOps& ops) : name_(PlaneName(kind)), kind_(kind), ops_(ops) {}
  const char* name() const override { return name_; }
  RegionKind kind() const override { return kind_; }
  void Map(const std::vector<WireRegion>& regions) override;
  bool Mapped(uint32_t region) const override { return table_ids_.count(region) != 0; }
  bool usable() const override { return error_.ok(); }
  const Status& error() const override { return error_; }
  Status Write(const OutChunk& chunk, const RegionGrant& grant, bool corrupt) override;

 private:
  struct PeerRegion {
    std::string handle;
    std::unique_ptr<DeviceMemory> memory;
  };
  // Where each range of `grant` lies here, one address per range, and the
  // ranges as extents of the region's base.
  Result<std::pair<uint8_t*, std::vector<Extent>>> Resolve(const OutChunk& chunk,
                                                           const RegionGrant& grant) const;

  const char* const name_;
  const RegionKind kind_;
  DeviceOps& ops_;
  std::map<uint32_t, PeerRegion> regions_;  // by the receiver's region id
  RegionTable table_;                       // their bounds (kdn/kvbus/region.h)
  std::map<uint32_t, uint32_t> table_ids_;  // receiver's region id -> table_ id
  Status error_;                            // why a region could not be mapped
};

// The nccl plane's sending half: a link of a DeviceOps backend this sender
// made and joined as rank 0, its id named in the sender's offers. The
// receiver joins it as rank 1; an in-place grant into its device region
// then goes as the chunk's header, marked linked, and the payload as one
// message over the link: from where a sourced chunk of this backend lies,
// else from host memory (a device backend's through a staging buffer). A
// sourced payload goes as it lies now: the receiver checks it against the
// sealed header where it lands.
class LinkPlane {
 public:
  // `timeout` bounds the peer's join and each message.
  static Result<std::unique_ptr<LinkPlane>> Make(DeviceOps& ops, std::chrono::milliseconds timeout);

  const std::string& id() const { return id_; }
  bool usable() const { return error_.ok(); }
  const Status& error() const { return error_; }  // why the link ended
  // Sends `chunk`'s payload as the next message (`corrupt`: one byte
  // flipped, SenderFaults::corrupt_data). Any failure ends the link (the
  // receiver, waiting for the message, is out of step with it).
  Status Send(const OutChunk& chunk, bool corrupt);

 private:
  Status SendPayload(const OutChunk& chunk, bool corrupt);
  LinkPlane(DeviceOps& ops, std::string id, std::unique_ptr<DeviceLink> link)
      : ops_(ops), id_(std::move(id)), link_(std::move(link)) {}

  DeviceOps& ops_;
  const std::string id_;
  std::unique_ptr<DeviceLink> link_;
  std::unique_ptr<DeviceMemory> stage_;  // a device backend's: host payloads go through it
  Status error_;
};

}  // namespace kdn::kvbus
