#pragma once
// A shared-memory segment: host memory that kvbus senders on the same host
// map and write into (docs/kvbus.md, "Transports"): a receiver's landing
// segment, or a decode worker's whole KV pool, where layer slices land in
// place ("Landing in place").
//
// The segment is a memfd: it needs no name in /dev/shm (so nothing is left
// behind when a process dies, and /dev/shm's size limit in containers does
// not apply), and a peer of the same user on the same host maps it through
// /proc/<pid>/fd/<fd>. A peer that cannot (another host, another pid
// namespace, another user) finds out when Open fails.
//
// Thread-safe (immutable once made; the bytes are the users' to order).

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "kdn/common/status.h"

namespace kdn::kvbus {

class SharedSegment {
 public:
  // A new segment of `bytes`, mapped read-write, zero-filled. IO_ERROR if
  // the kernel refuses.
  static Result<std::unique_ptr<SharedSegment>> Create(uint64_t bytes);
  // Maps the segment another process created, by its handle(); `bytes` must
  // be its size. UNAVAILABLE when it cannot be reached from here;
  // INVALID_ARGUMENT for a malformed handle or a size that differs.
  static Result<std::unique_ptr<SharedSegment>> Open(const std::string& handle, uint64_t bytes);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  // "memfd:<pid>:<fd>"; empty for an opened (not created) segment.
  const std::string& handle() const { return handle_; }

 private:
  SharedSegment(int fd, uint8_t* data, uint64_t bytes, std::string handle)
      : fd_(fd), data_(data), bytes_(bytes), handle_(std::move(handle)) {}
  int fd_;  // -1 for an opened segment (closed once mapped)
  uint8_t* data_;
  uint64_t bytes_;
  std::string handle_;
};

// A landing segment's ranges, given out first-fit, page-aligned, coalesced on free. Not
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
