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

}  // namespace

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
