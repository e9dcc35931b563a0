#include "kdn/kvbus/shared_segment.h"

#include "kdn/kvbus/transport.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace kdn::kvbus {

const std::string& HostId() {
  static const std::string id = []() -> std::string {
    if (const char* set = std::getenv("KDN_HOST_ID"); set != nullptr && *set != '\0') {
      return std::string("set:") + set;
    }
    std::ifstream in("/proc/sys/kernel/random/boot_id");
    std::string boot;
    if (in >> boot && !boot.empty()) return "boot:" + boot;
    char name[256] = {};
    ::gethostname(name, sizeof(name) - 1);
    return "host:" + std::string(name);
  }();
  return id;
}

Result<std::unique_ptr<SharedSegment>> SharedSegment::Create(uint64_t bytes) {
  const int fd = ::memfd_create("kdn-kvbus-landing", MFD_CLOEXEC);
  if (fd < 0) return IoError(std::string("kvbus shm: memfd_create: ") + std::strerror(errno));
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    return IoError("kvbus shm: sizing the landing segment to " + std::to_string(bytes) +
                   " bytes: " + std::strerror(err));
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    ::close(fd);
    return IoError(std::string("kvbus shm: mapping the landing segment: ") + std::strerror(err));
  }
  std::string handle = "memfd:" + std::to_string(::getpid()) + ":" + std::to_string(fd);
  return std::unique_ptr<SharedSegment>(
      new SharedSegment(fd, static_cast<uint8_t*>(p), bytes, std::move(handle)));
}

Result<std::unique_ptr<SharedSegment>> SharedSegment::Open(const std::string& handle,
                                                           uint64_t bytes) {
  long pid = 0, fd = 0;
  char tail = 0;
  if (std::sscanf(handle.c_str(), "memfd:%ld:%ld%c", &pid, &fd, &tail) != 2 || pid <= 0 || fd < 0) {
    return InvalidArgument("kvbus shm: malformed segment handle '" + handle + "'");
  }
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int f = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (f < 0) {
    return Unavailable("kvbus shm: cannot open the receiver's segment " + path + ": " +
                       std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(f, &st) != 0 || static_cast<uint64_t>(st.st_size) != bytes) {
    ::close(f);
    return InvalidArgument("kvbus shm: segment " + handle + " is not " + std::to_string(bytes) +
                           " bytes");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
  const int err = errno;
  ::close(f);  // the mapping keeps the memory
  if (p == MAP_FAILED) {
    return Unavailable("kvbus shm: cannot map segment " + handle + ": " + std::strerror(err));
  }
  return std::unique_ptr<SharedSegment>(new SharedSegment(-1, static_cast<uint8_t*>(p), bytes, ""));
}

SharedSegment::~SharedSegment() {
  ::munmap(data_, bytes_);
  if (fd_ >= 0) ::close(fd_);
}

RangeAllocator::RangeAllocator(uint64_t bytes) {
  usable_bytes_ = bytes / kAlign * kAlign;
  if (usable_bytes_ > 0) free_.emplace(0, usable_bytes_);
  free_bytes_ = usable_bytes_;
}

std::optional<uint64_t> RangeAllocator::Allocate(uint64_t bytes) {
  const uint64_t need = Round(std::max<uint64_t>(bytes, 1));
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - need;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + need, rest);
    free_bytes_ -= need;
    return offset;
  }
  return std::nullopt;
}

void RangeAllocator::Free(uint64_t offset, uint64_t bytes) {
  uint64_t size = Round(std::max<uint64_t>(bytes, 1));
  free_bytes_ += size;
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + size == next->first) {  // merge with the range after
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {  // and with the range before
      prev->second += size;
      return;
    }
  }
  free_.emplace(offset, size);
}

}  // namespace kdn::kvbus
