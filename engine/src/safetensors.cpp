#include "kdn/engine/safetensors.h"

#include <cerrno>
#include <cstring>

#include <nlohmann/json.hpp>

namespace kdn::engine {

using nlohmann::json;

namespace {

bool ParseDType(const std::string& s, DType* out) {
  if (s == "F32")
    *out = DType::kF32;
  else if (s == "F16")
    *out = DType::kF16;
  else if (s == "BF16")
    *out = DType::kBF16;
  else
    return false;
  return true;
}

// Parses the header and fills `tensors`; every range is checked against
// `data_size`, the bytes after the header.
Status ParseHeader(const std::string& where, const json& header, const uint8_t* data,
                   size_t data_size, std::map<std::string, SafetensorsEntry>* tensors) {
  if (!header.is_object()) return Corruption(where + ": header is not a JSON object");
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string at = where + ": tensor \"" + it.key() + "\"";
    const json& t = it.value();
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") ||
        !t.contains("data_offsets") || !t["dtype"].is_string() || !t["shape"].is_array() ||
        !t["data_offsets"].is_array() || t["data_offsets"].size() != 2) {
      return Corruption(at + ": malformed header entry");
    }
    SafetensorsEntry e;
    const std::string dt = t["dtype"].get<std::string>();
    if (!ParseDType(dt, &e.dtype)) {
      return Unimplemented(at + ": dtype " + dt + " is not supported (F32, F16, BF16)");
    }
    // The shape's size in bytes, refused when it does not fit in 64 bits
    // (it would wrap to a small count that some data range matches) or a
    // dimension does not fit in an int64_t.
    uint64_t shape_bytes = DTypeSize(e.dtype);
    for (const json& d : t["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > uint64_t{INT64_MAX} ||
          __builtin_mul_overflow(shape_bytes, d.get<uint64_t>(), &shape_bytes)) {
        return Corruption(at + ": bad shape " + t["shape"].dump());
      }
      e.shape.push_back(d.get<int64_t>());
    }
    const json& off = t["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      return Corruption(at + ": bad data_offsets");
    }
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return Corruption(at + ": data [" + std::to_string(begin) + ", " + std::to_string(end) +
                        ") lies beyond the file's " + std::to_string(data_size) +
                        " data bytes (truncated file?)");
    }
    if (end - begin != shape_bytes) {
      return Corruption(at + ": " + std::to_string(end - begin) + " bytes for shape " +
                        ShapeToString(e.shape) + " of " + dt);
    }
    e.data = data + begin;
    e.bytes = end - begin;
    (*tensors)[it.key()] = std::move(e);
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::filesystem::path& path) {
  const std::string where = path.string();
  KDN_ASSIGN_OR_RETURN(auto mapped, MappedFile::Open(path));
  const size_t size = mapped->size();
  if (size < 8) {
    return Corruption(where + ": " + std::to_string(size) +
                      " bytes, too short for a safetensors file");
  }
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  const uint8_t* bytes = mapped->data();
  f->file_ = std::move(mapped);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];
  if (header_len > size - 8) {
    return Corruption(where + ": header length " + std::to_string(header_len) +
                      " exceeds the file size " + std::to_string(size) + " (truncated file?)");
  }
  json header = json::parse(bytes + 8, bytes + 8 + header_len, nullptr, false);
  if (header.is_discarded()) return Corruption(where + ": header is not valid JSON");
  try {
    KDN_RETURN_IF_ERROR(
        ParseHeader(where, header, bytes + 8 + header_len, size - 8 - header_len, &f->tensors_));
  } catch (const json::exception& e) {
    return Corruption(where + ": malformed header: " + e.what());
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() = default;

const SafetensorsEntry* SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (file_ != nullptr) {
    std::fclose(file_);
    std::error_code ec;
    std::filesystem::remove(tmp_path_, ec);
  }
}

void SafetensorsWriter::Declare(const std::string& name, DType dtype, std::vector<int64_t> shape) {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  decls_.push_back({name, dtype, std::move(shape), n * DTypeSize(dtype)});
}

Status SafetensorsWriter::Begin() {
  json header = json::object();
  size_t offset = 0;
  for (const Decl& d : decls_) {
    header[d.name] = {{"dtype", SafetensorsDTypeName(d.dtype)},
                      {"shape", d.shape},
                      {"data_offsets", {offset, offset + d.bytes}}};
    offset += d.bytes;
  }
  header["__metadata__"] = {{"format", "pt"}};
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');  // keep data 8-byte aligned
  tmp_path_ = path_;
  tmp_path_ += ".tmp";
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  if (file_ == nullptr) return IoError(tmp_path_.string() + ": " + std::strerror(errno));
  uint8_t len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  if (std::fwrite(len, 1, 8, file_) != 8 || std::fwrite(text.data(), 1, n, file_) != n) {
    return IoError(tmp_path_.string() + ": write failed: " + std::strerror(errno));
  }
  current_ = 0;
  written_in_current_ = 0;
  return Status::Ok();
}

Status SafetensorsWriter::Append(const float* src, size_t n) {
  while (n > 0) {
    if (current_ >= decls_.size()) return Internal(path_.string() + ": more data than declared");
    const Decl& d = decls_[current_];
    const size_t esize = DTypeSize(d.dtype);
    const size_t room = (d.bytes - written_in_current_) / esize;
    const size_t take = std::min(room, n);
    scratch_.resize(take * esize);
    FromFloat(d.dtype, src, take, scratch_.data());
    if (std::fwrite(scratch_.data(), 1, scratch_.size(), file_) != scratch_.size()) {
      return IoError(tmp_path_.string() + ": write failed: " + std::strerror(errno));
    }
    src += take;
    n -= take;
    written_in_current_ += take * esize;
    if (written_in_current_ == d.bytes) {
      ++current_;
      written_in_current_ = 0;
      // Skip zero-sized tensors.
      while (current_ < decls_.size() && decls_[current_].bytes == 0) ++current_;
    }
  }
  return Status::Ok();
}

Status SafetensorsWriter::Finish() {
  if (file_ == nullptr) return Internal(path_.string() + ": Finish before Begin");
  if (current_ != decls_.size()) {
    return Internal(path_.string() + ": tensor \"" + decls_[current_].name +
                    "\" not fully written");
  }
  const bool ok = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  std::fclose(file_);
  file_ = nullptr;
  std::error_code ec;
  if (!ok) {
    std::filesystem::remove(tmp_path_, ec);
    return IoError(tmp_path_.string() + ": flush failed");
  }
  std::filesystem::rename(tmp_path_, path_, ec);
  if (ec) return IoError(path_.string() + ": rename: " + ec.message());
  return Status::Ok();
}

}  // namespace kdn::engine
