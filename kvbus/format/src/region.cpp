#include "kdn/kvbus/region.h"

#include <string>

namespace kdn::kvbus {

const char* MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost: return "host";
    case MemoryKind::kPinnedHost: return "pinned host";
    case MemoryKind::kDevice: return "device";
  }
  return "?";
}

Result<uint32_t> RegionTable::Register(const Region& region) {
  if (region.base == nullptr || region.bytes == 0) {
    return InvalidArgument("kvbus region: a region needs a base address and a size");
  }
  if ((region.kind == MemoryKind::kDevice) != (region.device >= 0)) {
    return InvalidArgument(std::string("kvbus region: a ") + MemoryKindName(region.kind) +
                           " region with device " + std::to_string(region.device) +
                           " (device regions name their device, others none)");
  }
  MutexLock lock(mu_);
  const uint32_t id = next_id_++;
  regions_.emplace(id, region);
  return id;
}

Status RegionTable::Unregister(uint32_t id) {
  MutexLock lock(mu_);
  if (regions_.erase(id) == 0)
    return NotFound("kvbus region " + std::to_string(id) + " is not registered");
  return Status::Ok();
}

Result<uint8_t*> RegionTable::Resolve(uint32_t id, uint64_t offset, uint64_t bytes, MemoryKind kind,
                                      int device) const {
  MutexLock lock(mu_);
  auto it = regions_.find(id);
  if (it == regions_.end())
    return NotFound("kvbus region " + std::to_string(id) + " is not registered");
  const Region& r = it->second;
  const std::string what = "kvbus region " + std::to_string(id) + " (" + MemoryKindName(r.kind) +
                           (r.kind == MemoryKind::kDevice ? " " + std::to_string(r.device) : "") +
                           ", " + std::to_string(r.bytes) + " bytes)";
  if (r.kind != kind || (kind == MemoryKind::kDevice && r.device != device)) {
    return InvalidArgument(what + " addressed as " + MemoryKindName(kind) +
                           (kind == MemoryKind::kDevice ? " " + std::to_string(device) : ""));
  }
  if (offset > r.bytes || bytes > r.bytes - offset) {
    return InvalidArgument(what + ": " + std::to_string(bytes) + " bytes at offset " +
                           std::to_string(offset) + " lie outside it");
  }
  return r.base + offset;
}

size_t RegionTable::size() const {
  MutexLock lock(mu_);
  return regions_.size();
}

}  // namespace kdn::kvbus
