#include "kdn/kvbridge/steer.h"

#include <algorithm>
#include <cstring>

#include "kdn/common/half.h"

namespace kdn::kvbridge {

namespace {

float Load(const uint8_t* p, DType t) {
  uint16_t h;
  switch (t) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kBF16: std::memcpy(&h, p, 2); return Bf16ToF32(h);
    default: std::memcpy(&h, p, 2); return F16ToF32(h);
  }
}

void Store(float f, uint8_t* p, DType t) {
  uint16_t h;
  switch (t) {
    case DType::kF32: std::memcpy(p, &f, 4); return;
    case DType::kBF16: h = F32ToBf16(f); break;
    default: h = F32ToF16(f);
  }
  std::memcpy(p, &h, 2);
}

// The description's words: little-endian u32s.
constexpr uint32_t kDescriptionVersion = 1;

void PutWord(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

void PutIds(std::vector<uint8_t>& out, const std::vector<int32_t>& ids) {
  PutWord(out, static_cast<uint32_t>(ids.size()));
  for (int32_t t : ids) PutWord(out, static_cast<uint32_t>(t));
}

// Reads words off a description, failing once past its end.
class WordReader {
 public:
  explicit WordReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  bool Word(uint32_t* v) {
    if (bytes_.size() - at_ < 4) return false;
    *v = 0;
    for (int i = 3; i >= 0; --i) *v = (*v << 8) | bytes_[at_ + static_cast<size_t>(i)];
    at_ += 4;
    return true;
  }
  // `n` words' worth must remain: bounds a count before anything is sized by it.
  bool Has(uint64_t n) const { return (bytes_.size() - at_) / 4 >= n; }
  bool Ids(std::vector<int32_t>* ids) {
    uint32_t n = 0;
    if (!Word(&n) || !Has(n)) return false;
    ids->resize(n);
    for (uint32_t i = 0; i < n; ++i) {
      uint32_t t = 0;
      Word(&t);
      (*ids)[i] = static_cast<int32_t>(t);
    }
    return true;
  }
  bool Bytes(size_t n, std::string* out) {
    const size_t padded = (n + 3) / 4 * 4;
    if (bytes_.size() - at_ < padded) return false;
    out->assign(reinterpret_cast<const char*>(bytes_.data() + at_), n);
    at_ += padded;
    return true;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  std::span<const uint8_t> bytes_;
  size_t at_ = 0;
};

}  // namespace

Result<std::shared_ptr<const kvbus::Chunk>> SteeringChunk(const SteeringVector& vector,
                                                          int model_layers,
                                                          const kvbus::ChunkKey& key,
                                                          const kvbus::ChunkKey& model_fingerprint) {
  if (vector.layers.empty() || vector.kv_heads <= 0 || vector.head_dim <= 0 ||
      vector.values.size() != vector.layers.size() * vector.row()) {
    return InvalidArgument("steering vector '" + vector.name + "': no layers, or values of " +
                           std::to_string(vector.values.size()) + " not one row per layer");
  }
  for (size_t i = 0; i < vector.layers.size(); ++i) {
    if (vector.layers[i] < 0 || vector.layers[i] >= model_layers ||
        (i > 0 && vector.layers[i] <= vector.layers[i - 1])) {
      return InvalidArgument("steering vector '" + vector.name +
                             "': layers must be ascending, in [0, " +
                             std::to_string(model_layers) + ")");
    }
  }
  kvbus::ChunkInfo info;
  info.key = key;
  info.model_fingerprint = model_fingerprint;
  info.layers = static_cast<uint32_t>(model_layers);
  info.kv_heads = static_cast<uint32_t>(vector.kv_heads);
  info.head_dim = static_cast<uint32_t>(vector.head_dim);
  info.tokens = 1;
  info.dtype = DType::kF32;
  std::vector<uint8_t>& d = info.steering;
  PutWord(d, kDescriptionVersion);
  PutWord(d, static_cast<uint32_t>(vector.name.size()));
  d.insert(d.end(), vector.name.begin(), vector.name.end());
  d.resize((d.size() + 3) / 4 * 4, 0);
  PutWord(d, static_cast<uint32_t>(vector.layers.size()));
  for (int l : vector.layers) PutWord(d, static_cast<uint32_t>(l));
  PutWord(d, static_cast<uint32_t>(vector.pairs.size()));
  for (const auto& [pos, neg] : vector.pairs) {
    PutIds(d, pos);
    PutIds(d, neg);
  }
  info.steering_bytes = static_cast<uint32_t>(d.size());
  const size_t row_bytes = vector.row() * sizeof(float);
  return kvbus::Chunk::Build(info, [&](uint8_t* out) {
    std::memset(out, 0, info.payload_bytes());
    for (size_t i = 0; i < vector.layers.size(); ++i) {
      // Layer l's K row, then its V row.
      uint8_t* v = out + static_cast<size_t>(vector.layers[i]) * 2 * row_bytes + row_bytes;
      std::memcpy(v, vector.values.data() + i * vector.row(), row_bytes);
    }
  });
}

Result<SteeringVector> SteeringFromChunk(const kvbus::Chunk& chunk) {
  const kvbus::ChunkInfo& info = chunk.info();
  if (!info.is_steering()) {
    return InvalidArgument("chunk " + info.key.ToHex() + " is not a steering vector's");
  }
  const auto bad = [&](const std::string& what) {
    return Corruption("steering chunk " + info.key.ToHex() + ": " + what);
  };
  if (info.tokens != 1 || info.dtype != DType::kF32 || chunk.encoded()) {
    return bad("not one f32 token");
  }
  WordReader r(info.steering);
  SteeringVector v;
  uint32_t version = 0, name_bytes = 0, n_layers = 0, n_pairs = 0;
  if (!r.Word(&version) || version != kDescriptionVersion) {
    return bad("description version " + std::to_string(version));
  }
  if (!r.Word(&name_bytes) || !r.Bytes(name_bytes, &v.name)) return bad("a cut name");
  if (!r.Word(&n_layers) || n_layers == 0 || !r.Has(n_layers)) return bad("a cut layer list");
  for (uint32_t i = 0; i < n_layers; ++i) {
    uint32_t l = 0;
    r.Word(&l);
    if (l >= info.layers || (i > 0 && static_cast<int>(l) <= v.layers.back())) {
      return bad("layers not ascending in the chunk's " + std::to_string(info.layers));
    }
    v.layers.push_back(static_cast<int>(l));
  }
  if (!r.Word(&n_pairs) || !r.Has(uint64_t{n_pairs} * 2)) return bad("a cut pair list");
  v.pairs.resize(n_pairs);
  for (auto& [pos, neg] : v.pairs) {
    if (!r.Ids(&pos) || !r.Ids(&neg)) return bad("a cut pair");
  }
  if (!r.done()) return bad("bytes past the pairs");
  v.kv_heads = static_cast<int>(info.kv_heads);
  v.head_dim = static_cast<int>(info.head_dim);
  const size_t row = v.row();
  v.values.resize(v.layers.size() * row);
  const std::span<const uint8_t> kv = chunk.payload();
  for (size_t i = 0; i < v.layers.size(); ++i) {
    std::memcpy(v.values.data() + i * row,
                kv.data() + (static_cast<size_t>(v.layers[i]) * 2 + 1) * row * sizeof(float),
                row * sizeof(float));
  }
  return v;
}

Result<SteeringVector> ValueSteeringVector(
    engine::Engine& model, std::string name,
    std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> pairs,
    std::vector<int> layers) {
  engine::KvCache& cache = model.kv_cache();
  const int num_layers = cache.num_layers();
  if (pairs.empty()) return InvalidArgument("steering vector: no prompt pairs");
  if (layers.empty()) return InvalidArgument("steering vector: no layers");
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] < 0 || layers[i] >= num_layers || (i > 0 && layers[i] <= layers[i - 1])) {
      return InvalidArgument("steering vector: layers must be ascending, in [0, " +
                             std::to_string(num_layers) + ")");
    }
  }
  SteeringVector v;
  v.name = std::move(name);
  v.layers = std::move(layers);
  v.kv_heads = cache.num_kv_heads();
  v.head_dim = cache.head_dim();
  const size_t row = v.row();
  v.values.assign(v.layers.size() * row, 0.0f);
  std::vector<double> sum(v.values.size(), 0.0);
  std::vector<uint8_t> layer_kv(cache.LayerBytes(1, DType::kF32));
  // Adds sign * the value rows of `prompt`'s last token to the sums.
  const auto add = [&](const std::vector<int32_t>& prompt, double sign) -> Status {
    if (prompt.empty()) return InvalidArgument("steering vector: an empty prompt");
    engine::KvSequence seq = cache.NewSequence();
    KDN_RETURN_IF_ERROR(cache.Reserve(seq, static_cast<int64_t>(prompt.size())));
    std::vector<float> logits;
    KDN_RETURN_IF_ERROR(model.Prefill(seq, prompt, {}, &logits));
    for (size_t l = 0; l < v.layers.size(); ++l) {
      // One token's layer: its K row, then its V row.
      KDN_RETURN_IF_ERROR(
          cache.ReadLayers(seq, v.layers[l], 1, seq.length() - 1, 1, DType::kF32, layer_kv));
      const auto* vrow = reinterpret_cast<const float*>(layer_kv.data()) + row;
      for (size_t j = 0; j < row; ++j) sum[l * row + j] += sign * vrow[j];
    }
    return Status::Ok();
  };
  for (const auto& [pos, neg] : pairs) {
    KDN_RETURN_IF_ERROR(add(pos, 1));
    KDN_RETURN_IF_ERROR(add(neg, -1));
  }
  for (size_t j = 0; j < sum.size(); ++j) {
    v.values[j] = static_cast<float>(sum[j] / static_cast<double>(pairs.size()));
  }
  v.pairs = std::move(pairs);
  return v;
}

Result<std::shared_ptr<const kvbus::Chunk>> SteerChunkValues(const kvbus::Chunk& chunk,
                                                             const SteeringVector& vector,
                                                             float strength, int64_t first,
                                                             int64_t count,
                                                             const kvbus::ChunkKey& key) {
  const kvbus::ChunkInfo& info = chunk.info();
  if (chunk.encoded()) return InvalidArgument("steer: an encoded chunk (decode it first)");
  if (static_cast<int>(info.kv_heads) != vector.kv_heads ||
      static_cast<int>(info.head_dim) != vector.head_dim ||
      vector.values.size() != vector.layers.size() * vector.row()) {
    return InvalidArgument("steer: the vector '" + vector.name + "' is not of this chunk's shape");
  }
  for (int l : vector.layers) {
    if (l < 0 || l >= static_cast<int>(info.layers)) {
      return InvalidArgument("steer: layer " + std::to_string(l) + " is not in a chunk of " +
                             std::to_string(info.layers));
    }
  }
  if (first < 0 || count <= 0 || first + count > static_cast<int64_t>(info.tokens)) {
    return InvalidArgument("steer: tokens [" + std::to_string(first) + ", " +
                           std::to_string(first + count) + ") are not all in a chunk of " +
                           std::to_string(info.tokens));
  }
  kvbus::ChunkInfo out_info = info;
  out_info.key = key;
  const std::span<const uint8_t> in = chunk.payload();
  const size_t elem = DTypeSize(info.dtype);
  const size_t row = vector.row();
  const size_t row_bytes = row * elem;
  const size_t half = static_cast<size_t>(info.tokens) * row_bytes;  // a layer's K (or V) rows
  return kvbus::Chunk::Build(out_info, [&](uint8_t* out) {
    std::memcpy(out, in.data(), info.payload_bytes());
    for (size_t i = 0; i < vector.layers.size(); ++i) {
      const float* delta = vector.values.data() + i * row;
      uint8_t* values = out + static_cast<size_t>(vector.layers[i]) * 2 * half + half;
      for (int64_t t = first; t < first + count; ++t) {
        uint8_t* r = values + static_cast<size_t>(t) * row_bytes;
        for (size_t j = 0; j < row; ++j) {
          Store(Load(r + j * elem, info.dtype) + strength * delta[j], r + j * elem, info.dtype);
        }
      }
    }
  });
}

}  // namespace kdn::kvbridge
