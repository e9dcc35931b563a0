#pragma once
// A whole file mapped read-only into memory (RAII). The model readers
// (safetensors, GGUF) read tensors straight from the mapping. Thread-safe
// after Open: the bytes never change while the object lives.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>

#include "kdn/common/status.h"

namespace kdn {

class MappedFile {
 public:
  // NotFound when there is no such file, InvalidArgument when it is not a
  // regular file, IoError when it cannot be opened or mapped. An empty file maps to data() ==
  // nullptr and size() == 0.
  static Result<std::unique_ptr<MappedFile>> Open(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const uint8_t* data() const { return static_cast<const uint8_t*>(map_); }
  size_t size() const { return size_; }

 private:
  MappedFile() = default;
  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t size_ = 0;
};

}  // namespace kdn
