#include "kdn/kvbus/steering.h"

#include <xxhash.h>

#include <climits>
#include <cstring>
#include <span>

namespace kdn::kvbus {

namespace {

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
  bool Bytes(uint32_t n, std::string* out) {
    const uint64_t padded = (uint64_t{n} + 3) / 4 * 4;
    if (bytes_.size() - at_ < padded) return false;
    out->assign(reinterpret_cast<const char*>(bytes_.data() + at_), n);
    at_ += static_cast<size_t>(padded);
    return true;
  }
  bool done() const { return at_ == bytes_.size(); }

 private:
  std::span<const uint8_t> bytes_;
  size_t at_ = 0;
};

}  // namespace

Result<std::shared_ptr<const Chunk>> SteeringChunk(const SteeringVector& vector, int model_layers,
                                                   const ChunkKey& key,
                                                   const ChunkKey& model_fingerprint) {
  if (vector.layers.empty() || vector.kv_heads <= 0 || vector.head_dim <= 0 ||
      vector.values.size() != vector.layers.size() * vector.row()) {
    return InvalidArgument("steering vector '" + vector.name + "': no layers, or values of " +
                           std::to_string(vector.values.size()) + " not one row per layer");
  }
  for (size_t i = 0; i < vector.layers.size(); ++i) {
    if (vector.layers[i] < 0 || vector.layers[i] >= model_layers ||
        (i > 0 && vector.layers[i] <= vector.layers[i - 1])) {
      return InvalidArgument("steering vector '" + vector.name +
                             "': layers must be ascending, in [0, " + std::to_string(model_layers) +
                             ")");
    }
  }
  ChunkInfo info;
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
  return Chunk::Build(info, [&](uint8_t* out) {
    std::memset(out, 0, info.payload_bytes());
    for (size_t i = 0; i < vector.layers.size(); ++i) {
      // Layer l's K row, then its V row.
      uint8_t* v = out + static_cast<size_t>(vector.layers[i]) * 2 * row_bytes + row_bytes;
      std::memcpy(v, vector.values.data() + i * vector.row(), row_bytes);
    }
  });
}

Result<SteeringVector> SteeringFromChunk(const Chunk& chunk) {
  const ChunkInfo& info = chunk.info();
  if (!info.is_steering()) {
    return InvalidArgument("chunk " + info.key.ToHex() + " is not a steering vector's");
  }
  const auto bad = [&](const std::string& what) {
    return Corruption("steering chunk " + info.key.ToHex() + ": " + what);
  };
  if (info.tokens != 1 || info.dtype != DType::kF32 || chunk.encoded()) {
    return bad("not one f32 token");
  }
  if (info.kv_heads > INT_MAX || info.head_dim > INT_MAX) return bad("an impossible shape");
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

ChunkKey SteeringVectorId(const Chunk& chunk) {
  const std::span<const uint8_t> b = chunk.bytes().subspan(Chunk::kHeaderBytes);
  XXH3_state_t* st = XXH3_createState();
  XXH3_128bits_reset_withSeed(st, kChunkKeyVersion);
  XXH3_128bits_update(st, "steer-id", 8);
  XXH3_128bits_update(st, b.data(), b.size());
  const XXH128_hash_t h = XXH3_128bits_digest(st);
  XXH3_freeState(st);
  return ChunkKey{h.high64, h.low64};
}

}  // namespace kdn::kvbus
