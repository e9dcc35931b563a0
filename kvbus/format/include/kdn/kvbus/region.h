#pragma once
// Registered memory regions: the address space a kvbus transfer names
// (docs/kvbus.md, "Regions and landing"). A process registers the memory a
// peer may be granted to write into (host memory, pinned host memory, or
// device memory with its device id) and resolves every (region, offset,
// bytes) a transfer names against the table before a byte moves: an
// unknown region, a range past its end or a region of the wrong kind or
// device is refused with a clear error and nothing is written.
//
// Thread-safe.

#include <cstdint>
#include <map>

#include "kdn/common/kv_block.h"
#include "kdn/common/mutex.h"
#include "kdn/common/status.h"

namespace kdn::kvbus {

enum class MemoryKind : uint8_t { kHost = 0, kPinnedHost = 1, kDevice = 2 };
const char* MemoryKindName(MemoryKind kind);

// A byte range of a region: [offset, offset + bytes). A chunk's payload
// landed in place is a list of them, filled in order (a layer slice: its K
// rows block by block, then its V rows).
using Extent = ByteRange;

struct Region {
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;  // the device's id for kDevice; -1 otherwise
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
};

class RegionTable {
 public:
  // The region's id (ids start at 1 and are not reused). INVALID_ARGUMENT
  // for a null base, zero bytes, a device region without a device id or a
  // host region with one.
  Result<uint32_t> Register(const Region& region);
  // NOT_FOUND when `id` is not registered.
  Status Unregister(uint32_t id);
  // The address of [offset, offset + bytes) of region `id`, which must be
  // of `kind` (and on `device` for kDevice). NOT_FOUND for an unknown
  // region; INVALID_ARGUMENT for a range that does not lie inside it or a
  // region of another kind or device.
  Result<uint8_t*> Resolve(uint32_t id, uint64_t offset, uint64_t bytes, MemoryKind kind,
                           int device = -1) const;
  size_t size() const;

 private:
  mutable Mutex mu_;
  std::map<uint32_t, Region> regions_ KDN_GUARDED_BY(mu_);
  uint32_t next_id_ KDN_GUARDED_BY(mu_) = 1;
};

}  // namespace kdn::kvbus
