#include "kdn/model/gguf.h"

#include <cstring>
#include <fstream>

namespace kdn::model {

namespace {

constexpr uint64_t kDefaultAlignment = 32;
constexpr int kMaxDims = 4;        // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;  // arrays of arrays, as deep as anyone writes them
// Array elements in all the metadata together. A value takes ~80 bytes in
// memory and as little as 1 in the file, so the file's size alone does not
// bound the memory; the largest real vocabularies (token strings, types,
// scores and merges) come to about a million.
constexpr uint64_t kMaxArrayElements = uint64_t{1} << 22;

constexpr GgmlTypeInfo kTypes[] = {
    {"F32", 1, 4},        {"F16", 1, 2},       {"Q4_0", 32, 18},     {"Q4_1", 32, 20},
    {nullptr, 0, 0},      {nullptr, 0, 0},     {"Q5_0", 32, 22},     {"Q5_1", 32, 24},
    {"Q8_0", 32, 34},     {"Q8_1", 32, 40},    {"Q2_K", 256, 84},    {"Q3_K", 256, 110},
    {"Q4_K", 256, 144},   {"Q5_K", 256, 176},  {"Q6_K", 256, 210},   {"Q8_K", 256, 292},
    {"IQ2_XXS", 256, 66}, {"IQ2_XS", 256, 74}, {"IQ3_XXS", 256, 98}, {"IQ1_S", 256, 50},
    {"IQ4_NL", 32, 18},   {"IQ3_S", 256, 110}, {"IQ2_S", 256, 82},   {"IQ4_XS", 256, 136},
    {"I8", 1, 1},         {"I16", 1, 2},       {"I32", 1, 4},        {"I64", 1, 8},
    {"F64", 1, 8},        {"IQ1_M", 256, 56},  {"BF16", 1, 2},       {nullptr, 0, 0},
    {nullptr, 0, 0},      {nullptr, 0, 0},     {"TQ1_0", 256, 54},   {"TQ2_0", 256, 66},
};

// A cursor over the file's bytes; every read is checked against the end.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, std::string where)
      : data_(data), size_(size), where_(std::move(where)) {}

  size_t offset() const { return pos_; }
  // Counts `n` more array elements against kMaxArrayElements.
  bool TakeElements(uint64_t n) {
    if (n > kMaxArrayElements - elements_) return false;
    elements_ += n;
    return true;
  }
  size_t left() const { return size_ - pos_; }

  template <typename T>
  Status Read(T* out, const char* what) {
    if (left() < sizeof(T)) return Truncated(what);
    std::memcpy(out, data_ + pos_, sizeof(T));  // GGUF is little-endian, as are kdn's hosts
    pos_ += sizeof(T);
    return Status::Ok();
  }

  Status ReadString(std::string* out, const char* what) {
    uint64_t n = 0;
    KDN_RETURN_IF_ERROR(Read(&n, what));
    if (n > left()) {
      return Corruption(where_ + ": " + what + " of " + std::to_string(n) + " bytes at offset " +
                        std::to_string(pos_) + " runs past the end of the file (" +
                        std::to_string(size_) + " bytes; truncated?)");
    }
    out->assign(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return Status::Ok();
  }

  Status Truncated(const char* what) const {
    return Corruption(where_ + ": the file ends at byte " + std::to_string(size_) + " inside " +
                      what + " (truncated?)");
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  uint64_t elements_ = 0;
  std::string where_;
};

// The fewest bytes one value of `t` takes in the file (an array's header).
uint64_t MinBytes(GgufValueType t) {
  switch (t) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool: return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16: return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32: return 4;
    case GgufValueType::kString:
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64: return 8;
    case GgufValueType::kArray: return 12;
  }
  return 1;
}

bool KnownValueType(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::kFloat64); }

bool IsInteger(GgufValueType t) {
  return t != GgufValueType::kFloat32 && t != GgufValueType::kFloat64 &&
         t != GgufValueType::kString && t != GgufValueType::kArray && t != GgufValueType::kBool;
}

Status ReadValue(Reader& r, GgufValueType type, int depth, const std::string& key, GgufValue* v) {
  v->type = type;
  const char* what = "a metadata value";
  switch (type) {
    case GgufValueType::kUint8: {
      uint8_t x = 0;
      KDN_RETURN_IF_ERROR(r.Read(&x, what));
      v->bits = x;
      break;
    }
    case GgufValueType::kInt8: {
      int8_t x = 0;
      KDN_RETURN_IF_ERROR(r.Read(&x, what));
      v->bits = static_cast<uint64_t>(int64_t{x});
      break;
    }
    case GgufValueType::kUint16: {
      uint16_t x = 0;
      KDN_RETURN_IF_ERROR(r.Read(&x, what));
      v->bits = x;
      break;
    }
    case GgufValueType::kInt16: {
      int16_t x = 0;
      KDN_RETURN_IF_ERROR(r.Read(&x, what));
      v->bits = static_cast<uint64_t>(int64_t{x});
      break;
    }
    case GgufValueType::kUint32: {
      uint32_t x = 0;
      KDN_RETURN_IF_ERROR(r.Read(&x, what));
      v->bits = x;
      break;
    }
    case GgufValueType::kInt32: {
      int32_t x = 0;
      KDN_RETURN_IF_ERROR(r.Read(&x, what));
      v->bits = static_cast<uint64_t>(int64_t{x});
      break;
    }
    case GgufValueType::kUint64: {
      KDN_RETURN_IF_ERROR(r.Read(&v->bits, what));
      break;
    }
    case GgufValueType::kInt64: {
      KDN_RETURN_IF_ERROR(r.Read(&v->bits, what));
      break;
    }
    case GgufValueType::kFloat32: {
      float x = 0;
      KDN_RETURN_IF_ERROR(r.Read(&x, what));
      v->f = x;
      break;
    }
    case GgufValueType::kFloat64: {
      KDN_RETURN_IF_ERROR(r.Read(&v->f, what));
      break;
    }
    case GgufValueType::kBool: {
      uint8_t x = 0;
      KDN_RETURN_IF_ERROR(r.Read(&x, what));
      v->bits = x != 0;
      break;
    }
    case GgufValueType::kString: KDN_RETURN_IF_ERROR(r.ReadString(&v->s, "a string value")); break;
    case GgufValueType::kArray: {
      if (depth >= kMaxArrayDepth) {
        return Corruption("key \"" + key + "\": arrays nested more than " +
                          std::to_string(kMaxArrayDepth) + " deep");
      }
      uint32_t elem = 0;
      uint64_t n = 0;
      KDN_RETURN_IF_ERROR(r.Read(&elem, "an array's type"));
      KDN_RETURN_IF_ERROR(r.Read(&n, "an array's length"));
      if (!KnownValueType(elem)) {
        return Corruption("key \"" + key + "\": unknown array element type " +
                          std::to_string(elem));
      }
      v->elem = static_cast<GgufValueType>(elem);
      // Refuse a count the rest of the file cannot hold before reserving it.
      if (n > r.left() / MinBytes(v->elem)) {
        return Corruption("key \"" + key + "\": an array of " + std::to_string(n) + " " +
                          GgufValueTypeName(v->elem) + " values cannot fit in the " +
                          std::to_string(r.left()) + " bytes left (truncated or corrupt)");
      }
      if (!r.TakeElements(n)) {
        return Corruption("key \"" + key + "\": the metadata's arrays hold more than " +
                          std::to_string(kMaxArrayElements) + " values in all");
      }
      v->items.resize(n);
      for (GgufValue& item : v->items) {
        KDN_RETURN_IF_ERROR(ReadValue(r, v->elem, depth + 1, key, &item));
      }
      break;
    }
  }
  return Status::Ok();
}

}  // namespace

const char* GgufValueTypeName(GgufValueType t) {
  static constexpr const char* kNames[] = {"uint8",  "int8",    "uint16", "int16",  "uint32",
                                           "int32",  "float32", "bool",   "string", "array",
                                           "uint64", "int64",   "float64"};
  const auto i = static_cast<uint32_t>(t);
  return i < std::size(kNames) ? kNames[i] : "unknown";
}

const GgmlTypeInfo* FindGgmlType(uint32_t type) {
  if (type >= std::size(kTypes) || kTypes[type].name == nullptr) return nullptr;
  return &kTypes[type];
}

int64_t GgufTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

Result<std::unique_ptr<GgufFile>> GgufFile::Open(const std::filesystem::path& path) {
  KDN_ASSIGN_OR_RETURN(auto mapped, MappedFile::Open(path));
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->file_ = std::move(mapped);
  KDN_RETURN_IF_ERROR(f->Parse());
  return f;
}

std::string GgufFile::Where(const std::string& what) const {
  return file_->path().string() + ": " + what;
}

Status GgufFile::Parse() {
  const std::string where = file_->path().string();
  Reader r(file_->data(), file_->size(), where);
  char magic[4];
  if (file_->size() < 4 || std::memcmp(file_->data(), "GGUF", 4) != 0) {
    return Corruption(where + ": not a GGUF file (it does not begin with \"GGUF\")");
  }
  KDN_RETURN_IF_ERROR(r.Read(&magic, "the magic"));
  KDN_RETURN_IF_ERROR(r.Read(&version_, "the version"));
  if (version_ != 2 && version_ != 3) {
    return Unimplemented(where + ": GGUF version " + std::to_string(version_) +
                         " (kdn reads versions 2 and 3)");
  }
  uint64_t n_tensors = 0, n_kv = 0;
  KDN_RETURN_IF_ERROR(r.Read(&n_tensors, "the tensor count"));
  KDN_RETURN_IF_ERROR(r.Read(&n_kv, "the metadata count"));
  // Each pair takes at least 8 (key length) + 4 (type) + 1 bytes, each tensor
  // description at least 8 + 4 + 4 + 8.
  if (n_kv > r.left() / 13 || n_tensors > r.left() / 24) {
    return Corruption(where + ": " + std::to_string(n_kv) + " metadata pairs and " +
                      std::to_string(n_tensors) + " tensors cannot fit in a file of " +
                      std::to_string(file_->size()) + " bytes");
  }
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key;
    uint32_t type = 0;
    KDN_RETURN_IF_ERROR(r.ReadString(&key, "a metadata key"));
    KDN_RETURN_IF_ERROR(r.Read(&type, "a metadata type"));
    if (!KnownValueType(type)) {
      return Corruption(where + ": key \"" + key + "\" has unknown value type " +
                        std::to_string(type));
    }
    GgufValue v;
    Status s = ReadValue(r, static_cast<GgufValueType>(type), 0, key, &v);
    if (!s.ok()) return Status(s.code(), where + ": " + s.message());
    if (!metadata_.emplace(key, std::move(v)).second) {
      return Corruption(where + ": key \"" + key + "\" appears twice");
    }
  }

  uint64_t alignment = kDefaultAlignment;
  if (Find("general.alignment") != nullptr) {
    KDN_ASSIGN_OR_RETURN(const int64_t a, Int("general.alignment"));
    // A power of two, and at least 8 as the format requires (so that every
    // tensor's data is aligned for the widest element the engine reads).
    if (a < 8 || (a & (a - 1)) != 0 || a > (int64_t{1} << 30)) {
      return Corruption(where + ": general.alignment " + std::to_string(a) +
                        " is not a power of two from 8 to 2^30");
    }
    alignment = static_cast<uint64_t>(a);
  }

  // Not reserved from the count: a corrupt count is refused only once the
  // descriptions run out of bytes.
  std::vector<uint64_t> offsets;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    uint32_t n_dims = 0;
    KDN_RETURN_IF_ERROR(r.ReadString(&t.name, "a tensor's name"));
    KDN_RETURN_IF_ERROR(r.Read(&n_dims, "a tensor's dimension count"));
    const std::string at = where + ": tensor \"" + t.name + "\"";
    if (n_dims == 0 || n_dims > kMaxDims) {
      return Corruption(at + ": " + std::to_string(n_dims) + " dimensions (1 to 4)");
    }
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t n = 0;
      KDN_RETURN_IF_ERROR(r.Read(&n, "a tensor's dimensions"));
      if (n == 0 || n > uint64_t{INT64_MAX}) {
        return Corruption(at + ": dimension " + std::to_string(d) + " is " + std::to_string(n));
      }
      t.dims.push_back(static_cast<int64_t>(n));
    }
    uint64_t offset = 0;
    KDN_RETURN_IF_ERROR(r.Read(&t.type, "a tensor's type"));
    KDN_RETURN_IF_ERROR(r.Read(&offset, "a tensor's offset"));
    const GgmlTypeInfo* info = FindGgmlType(t.type);
    if (info == nullptr) {
      return Unimplemented(at + ": unknown ggml type " + std::to_string(t.type));
    }
    if (t.dims[0] % info->block_elements != 0) {
      return Corruption(at + ": its rows of " + std::to_string(t.dims[0]) +
                        " values are not whole blocks of " + info->name + " (" +
                        std::to_string(info->block_elements) + ")");
    }
    // Bytes: rows * (row / block) * block_bytes, refused where it overflows.
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(t.dims[0] / info->block_elements),
                               static_cast<uint64_t>(info->block_bytes), &bytes)) {
      return Corruption(at + ": its size overflows 64 bits");
    }
    for (size_t d = 1; d < t.dims.size(); ++d) {
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(t.dims[d]), &bytes)) {
        return Corruption(at + ": its size overflows 64 bits");
      }
    }
    if (offset % alignment != 0) {
      return Corruption(at + ": data offset " + std::to_string(offset) +
                        " is not a multiple of the alignment " + std::to_string(alignment));
    }
    t.bytes = bytes;
    if (tensor_index_.count(t.name) != 0) return Corruption(at + ": appears twice");
    tensor_index_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
    offsets.push_back(offset);
  }

  // The data section begins at the next multiple of the alignment.
  const uint64_t data_start = (r.offset() + alignment - 1) / alignment * alignment;
  const uint64_t size = file_->size();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    GgufTensor& t = tensors_[i];
    const uint64_t begin = offsets[i];
    if (data_start > size || begin > size - data_start || t.bytes > size - data_start - begin) {
      return Corruption(where + ": tensor \"" + t.name + "\": data [" + std::to_string(begin) +
                        ", +" + std::to_string(t.bytes) + ") lies beyond the file's " +
                        std::to_string(size > data_start ? size - data_start : 0) +
                        " data bytes (truncated file?)");
    }
    t.data = file_->data() + data_start + begin;
  }
  return Status::Ok();
}

const GgufTensor* GgufFile::FindTensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufValue* GgufFile::Find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {

Status WrongType(const GgufFile& f, const std::string& key, const GgufValue& v, const char* want) {
  std::string got = GgufValueTypeName(v.type);
  if (v.type == GgufValueType::kArray) got += std::string(" of ") + GgufValueTypeName(v.elem);
  return InvalidArgument(f.Where(key + " is " + got + ", not " + want));
}

Result<int64_t> AsInt(const GgufFile& f, const std::string& key, const GgufValue& v) {
  if (!IsInteger(v.type)) return WrongType(f, key, v, "an integer");
  if (v.type == GgufValueType::kUint64 && v.bits > uint64_t{INT64_MAX}) {
    return InvalidArgument(f.Where(key + " = " + std::to_string(v.bits) + " is out of range"));
  }
  return static_cast<int64_t>(v.bits);
}

Result<double> AsFloat(const GgufFile& f, const std::string& key, const GgufValue& v) {
  if (v.type != GgufValueType::kFloat32 && v.type != GgufValueType::kFloat64) {
    return WrongType(f, key, v, "a float");
  }
  return v.f;
}

}  // namespace

#define KDN_GGUF_FIND(v, key)     \
  const GgufValue* v = Find(key); \
  if (v == nullptr) return NotFound(Where("no metadata key " + key))

Result<int64_t> GgufFile::Int(const std::string& key) const {
  KDN_GGUF_FIND(v, key);
  return AsInt(*this, key, *v);
}

Result<double> GgufFile::Float(const std::string& key) const {
  KDN_GGUF_FIND(v, key);
  return AsFloat(*this, key, *v);
}

Result<bool> GgufFile::Bool(const std::string& key) const {
  KDN_GGUF_FIND(v, key);
  if (v->type != GgufValueType::kBool) return WrongType(*this, key, *v, "a bool");
  return v->bits != 0;
}

Result<std::string> GgufFile::String(const std::string& key) const {
  KDN_GGUF_FIND(v, key);
  if (v->type != GgufValueType::kString) return WrongType(*this, key, *v, "a string");
  return v->s;
}

Result<std::vector<std::string>> GgufFile::Strings(const std::string& key) const {
  KDN_GGUF_FIND(v, key);
  if (v->type != GgufValueType::kArray || v->elem != GgufValueType::kString) {
    return WrongType(*this, key, *v, "an array of strings");
  }
  std::vector<std::string> out;
  out.reserve(v->items.size());
  for (const GgufValue& item : v->items) out.push_back(item.s);
  return out;
}

Result<std::vector<int64_t>> GgufFile::Ints(const std::string& key) const {
  KDN_GGUF_FIND(v, key);
  if (v->type != GgufValueType::kArray || !IsInteger(v->elem)) {
    return WrongType(*this, key, *v, "an array of integers");
  }
  std::vector<int64_t> out;
  out.reserve(v->items.size());
  for (const GgufValue& item : v->items) {
    KDN_ASSIGN_OR_RETURN(const int64_t x, AsInt(*this, key, item));
    out.push_back(x);
  }
  return out;
}

Result<std::vector<double>> GgufFile::Floats(const std::string& key) const {
  KDN_GGUF_FIND(v, key);
  if (v->type != GgufValueType::kArray ||
      (v->elem != GgufValueType::kFloat32 && v->elem != GgufValueType::kFloat64)) {
    return WrongType(*this, key, *v, "an array of floats");
  }
  std::vector<double> out;
  out.reserve(v->items.size());
  for (const GgufValue& item : v->items) out.push_back(item.f);
  return out;
}

#undef KDN_GGUF_FIND

bool IsGgufPath(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return false;
  if (path.extension() == ".gguf") return true;
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

}  // namespace kdn::model
