#include "kdn/common/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kdn {

Result<std::unique_ptr<MappedFile>> MappedFile::Open(const std::filesystem::path& path) {
  const std::string where = path.string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return NotFound(where + ": no such file");
    return IoError(where + ": " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return IoError(where + ": " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument(where + ": not a regular file");
  }
  std::unique_ptr<MappedFile> f(new MappedFile());
  f->path_ = path;
  f->size_ = static_cast<size_t>(st.st_size);
  if (f->size_ > 0) {
    void* map = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    if (map == MAP_FAILED) {
      ::close(fd);
      return IoError(where + ": mmap: " + std::strerror(err));
    }
    f->map_ = map;
  }
  ::close(fd);
  return f;
}

MappedFile::~MappedFile() {
  if (map_ != nullptr) ::munmap(map_, size_);
}

}  // namespace kdn
