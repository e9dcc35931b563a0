#pragma once
// Private to the kvbus transports: the allocator of a landing segment's
// ranges (the segment itself: kdn/kvbus/shared_segment.h).

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "kdn/common/status.h"
#include "kdn/kvbus/shared_segment.h"

namespace kdn::kvbus {

// First-fit ranges of a segment, page-aligned, coalesced on free. Not
// thread-safe (the receiver's I/O thread owns it).
class RangeAllocator {
 public:
  static constexpr uint64_t kAlign = 4096;
  explicit RangeAllocator(uint64_t bytes);
  // The offset of a free range of `bytes` (rounded up to kAlign), or none.
  std::optional<uint64_t> Allocate(uint64_t bytes);
  // Gives back a range Allocate returned, with the size it was asked for.
  void Free(uint64_t offset, uint64_t bytes);
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t used_bytes() const { return usable_bytes_ - free_bytes_; }

 private:
  static uint64_t Round(uint64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
  std::map<uint64_t, uint64_t> free_;  // offset -> size
  uint64_t usable_bytes_ = 0;          // whole pages of the segment
  uint64_t free_bytes_ = 0;
};

}  // namespace kdn::kvbus
