// The host backend of kvbus's device operations (kdn/kvbus/device_ops.h):
// memfd segments, streaming stores, XXH3 in place.

#include <cstdlib>
#include <cstring>
#include <vector>

#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/copy_plan.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/shared_segment.h"
#include "planes/host_link.h"
#include "planes/stream_copy.h"

namespace kdn::kvbus {

const char* RegionKindName(RegionKind kind) {
  switch (kind) {
    case RegionKind::kUnknown: return "unknown";
    case RegionKind::kShm: return "shm";
    case RegionKind::kDevice: return "device";
  }
  return "?";
}

namespace {

class HostMemory final : public DeviceMemory {
 public:
  HostMemory(std::unique_ptr<SharedSegment> segment, std::string handle, DeviceOps& ops)
      : segment_(std::move(segment)), handle_(std::move(handle)), ops_(ops) {}
  uint8_t* data() const override { return segment_->data(); }
  uint64_t bytes() const override { return segment_->bytes(); }
  const std::string& handle() const override { return handle_; }
  DeviceOps& ops() const override { return ops_; }

 private:
  std::unique_ptr<SharedSegment> segment_;
  std::string handle_;  // the creator's, also for an opened segment
  DeviceOps& ops_;
};

class HostOps final : public DeviceOps {
 public:
  const char* name() const override { return "host"; }
  MemoryKind memory_kind() const override { return MemoryKind::kHost; }
  int device() const override { return -1; }

  Result<std::unique_ptr<DeviceMemory>> Allocate(uint64_t bytes) override {
    if (bytes == 0) return InvalidArgument("kvbus host memory: cannot allocate 0 bytes");
    KDN_ASSIGN_OR_RETURN(std::unique_ptr<SharedSegment> segment, SharedSegment::Create(bytes));
    std::string handle = segment->handle();
    return std::unique_ptr<DeviceMemory>(
        std::make_unique<HostMemory>(std::move(segment), std::move(handle), *this));
  }

  Result<std::unique_ptr<DeviceMemory>> Open(const std::string& handle, uint64_t bytes) override {
    KDN_ASSIGN_OR_RETURN(std::unique_ptr<SharedSegment> segment,
                         SharedSegment::Open(handle, bytes));
    return std::unique_ptr<DeviceMemory>(
        std::make_unique<HostMemory>(std::move(segment), handle, *this));
  }

  Status Upload(const uint8_t* host, uint8_t* base, std::span<const Extent> extents) override {
    for (const Extent& x : extents) {
      StreamCopy(base + x.offset, host, x.bytes);
      host += x.bytes;
    }
    return Status::Ok();
  }

  Status Copy(const uint8_t* src_base, std::span<const Extent> src, uint8_t* dst_base,
              std::span<const Extent> dst) override {
    std::vector<CopyPiece> pieces;
    KDN_RETURN_IF_ERROR(SplitExtents(src, dst, ~uint64_t{0}, &pieces));
    for (const CopyPiece& p : pieces) {
      StreamCopy(dst_base + p.dst_offset, src_base + p.src_offset, p.bytes);
    }
    return Status::Ok();
  }

  Status Download(const uint8_t* base, std::span<const Extent> extents, uint8_t* host) override {
    for (const Extent& x : extents) {
      std::memcpy(host, base + x.offset, x.bytes);
      host += x.bytes;
    }
    return Status::Ok();
  }

  Result<uint64_t> Checksum(const uint8_t* base, std::span<const Extent> extents) override {
    return PayloadChecksum(base, extents);
  }

  Result<std::string> NewLinkId() override { return NewHostLinkId(); }
  Result<std::unique_ptr<DeviceLink>> JoinLink(const std::string& id, int rank,
                                               std::chrono::milliseconds timeout) override {
    return JoinHostLink(id, rank, timeout);
  }
};

}  // namespace

DeviceOps& HostDeviceOps() {
  static HostOps ops;
  return ops;
}

DeviceOps* StandInDeviceOps() {
  const char* v = std::getenv("KDN_DEVICE_OPS");
  return v != nullptr && std::strcmp(v, "host") == 0 ? &HostDeviceOps() : nullptr;
}

}  // namespace kdn::kvbus
