#pragma once
// Reading and writing the safetensors format (an 8-byte little-endian header
// length, a JSON header mapping tensor names to dtype, shape and byte range,
// then the data). The reader memory-maps the file and checks every range
// against the file's size, so a truncated or malformed file is a Status that
// names the file and the tensor, never a crash.

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kdn/common/mapped_file.h"
#include "kdn/common/status.h"
#include "kdn/engine/tensor.h"

namespace kdn::engine {

struct SafetensorsEntry {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the mapping; valid while the file lives
  size_t bytes = 0;
};

// A read-only, memory-mapped safetensors file. Thread-safe after Open.
class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::map<std::string, SafetensorsEntry>& tensors() const { return tensors_; }
  // nullptr when the file holds no tensor of that name.
  const SafetensorsEntry* Find(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  std::unique_ptr<MappedFile> file_;
  std::map<std::string, SafetensorsEntry> tensors_;
};

// Streams tensors into a safetensors file: declare every tensor first (so the
// header can be written), then write their data in declaration order, in as
// many pieces as the caller likes. The file appears under its final name only
// when Finish succeeds. Not thread-safe.
class SafetensorsWriter {
 public:
  explicit SafetensorsWriter(std::filesystem::path path) : path_(std::move(path)) {}
  ~SafetensorsWriter();

  void Declare(const std::string& name, DType dtype, std::vector<int64_t> shape);
  // Writes the header. Call after the last Declare.
  Status Begin();
  // Appends `n` floats, converted to the current tensor's dtype.
  Status Append(const float* src, size_t n);
  Status Finish();

 private:
  struct Decl {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    size_t bytes;
  };
  std::filesystem::path path_;
  std::filesystem::path tmp_path_;
  std::vector<Decl> decls_;
  std::FILE* file_ = nullptr;
  size_t current_ = 0;             // index of the tensor being written
  size_t written_in_current_ = 0;  // bytes of it written so far
  std::vector<uint8_t> scratch_;
};

}  // namespace kdn::engine
