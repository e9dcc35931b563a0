#pragma once
// A kvbus sender's region planes, and their registry (docs/kvbus.md,
// "Transports"). The sender runs the control protocol (offers, grants,
// acks, liveness) and sends a granted chunk's bytes in a frame after its
// header (the tcp plane). A grant may instead name a region of the
// receiver's memory; the region names the plane that writes it, and the
// sender's plane of that name writes the bytes there itself before the
// header goes out marked landed.
//
// Planes are registered by name: "shm" (the host backend's shared
// segments: a landing segment, or a decode worker's KV pool landed in
// place) and "cuda_ipc" (a device backend's exported memory) come built in;
// a new plane is a RegionPlane and one RegisterRegionPlane call. The name is
// what a receiver's regions carry on the wire (proto RegionInfo.plane),
// what a sender offers (Offer.planes), and the key of the plane's figures
// in SenderStats and ReceiverStats. The nccl plane is no region plane: it
// sends over a link (data_plane.h, LinkPlane).
//
// The registry is thread-safe; a plane is not (the sender's I/O thread owns
// its planes).

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/region.h"
#include "kdn/kvbus/transport.h"
#include "kdn/kvbus/wire.h"

namespace kdn::kvbus {

// The built-in planes' names.
inline constexpr const char* kShmPlaneName = "shm";
inline constexpr const char* kCudaIpcPlaneName = "cuda_ipc";
// The nccl plane's name (a link, whatever its backend).
inline constexpr const char* kLinkPlaneName = "nccl";
// The plane that writes a region of memory of `kind` by default: "shm" or
// "cuda_ipc" ("" for kUnknown).
const char* DefaultPlaneOf(RegionKind kind);

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
  virtual const char* name() const = 0;  // its registered name, its stats' key
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
  MemoryPlane(std::string name, RegionKind kind, DeviceOps& ops)
      : name_(std::move(name)), kind_(kind), ops_(ops) {}
  const char* name() const override { return name_.c_str(); }
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

  const std::string name_;
  const RegionKind kind_;
  DeviceOps& ops_;
  std::map<uint32_t, PeerRegion> regions_;  // by the receiver's region id
  RegionTable table_;                       // their bounds (kdn/kvbus/region.h)
  std::map<uint32_t, uint32_t> table_ids_;  // receiver's region id -> table_ id
  Status error_;                            // why a region could not be mapped
};

// Makes a sender's plane for its options, or none (nullptr) where it has
// none for them (a device plane without SenderOptions::device_ops, say).
using RegionPlaneFactory = std::function<std::unique_ptr<RegionPlane>(const SenderOptions&)>;
// Registers `factory` under `name`: every sender started afterwards makes
// that plane, offers it, and writes the regions that name it.
// INVALID_ARGUMENT for an empty name or "tcp"/"nccl"; FAILED_PRECONDITION
// for a name taken.
Status RegisterRegionPlane(const std::string& name, RegionPlaneFactory factory);
// The registered names, sorted (the built-in ones included).
std::vector<std::string> RegionPlaneNames();
// OK for a registered name; INVALID_ARGUMENT naming it and the registered
// ones otherwise.
Status CheckRegionPlane(const std::string& name);
// Every registered plane that makes one for `options`, by name.
std::map<std::string, std::unique_ptr<RegionPlane>> MakeRegionPlanes(const SenderOptions& options);

}  // namespace kdn::kvbus
