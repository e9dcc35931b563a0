#include "kdn/engine/weights.h"

#include <fstream>
#include <memory>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kdn/engine/gguf_weights.h"
#include "kdn/engine/quant.h"
#include "kdn/engine/safetensors.h"
#include "kdn/model/gguf.h"

namespace kdn::engine {

namespace {

// Which file holds each tensor: one model.safetensors, or the shards an index
// lists.
Result<std::map<std::string, std::string>> WeightMap(const std::filesystem::path& dir) {
  const auto single = dir / "model.safetensors";
  const auto index = dir / "model.safetensors.index.json";
  std::map<std::string, std::string> map;
  if (std::filesystem::exists(index)) {
    std::ifstream in(index);
    std::stringstream ss;
    ss << in.rdbuf();
    auto j = nlohmann::json::parse(ss.str(), nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
        !j["weight_map"].is_object()) {
      return Corruption(index.string() + ": not a safetensors index (no \"weight_map\" object)");
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string()) {
        return Corruption(index.string() + ": weight_map entry \"" + it.key() +
                          "\" is not a file name");
      }
      const std::string file = it.value().get<std::string>();
      if (file.find('/') != std::string::npos || file == "..") {
        return Corruption(index.string() + ": shard name \"" + file +
                          "\" is not a plain file name");
      }
      map[it.key()] = file;
    }
    return map;
  }
  if (!std::filesystem::exists(single)) {
    return NotFound(dir.string() + ": neither model.safetensors nor model.safetensors.index.json");
  }
  return map;  // empty: everything is in model.safetensors
}

}  // namespace

Result<WeightsDType> ParseWeightsDType(const std::string& name) {
  if (name == "f32") return WeightsDType::kF32;
  if (name == "native") return WeightsDType::kNative;
  return InvalidArgument("weights dtype \"" + name + "\": expected f32 or native");
}

const char* WeightsDTypeName(WeightsDType d) { return d == WeightsDType::kF32 ? "f32" : "native"; }

void ToF32(HostTensor* t) {
  if (t->type == model::GgmlType::kF32) return;
  const QuantTraits* traits = FindQuantTraits(t->type);
  t->data.resize(static_cast<size_t>(t->numel()));
  traits->to_float(t->bytes.data(), t->numel(), t->data.data());
  t->type = model::GgmlType::kF32;
  t->bytes = {};
}

Result<ModelWeights> LoadWeights(const std::filesystem::path& dir, const model::ModelConfig& config,
                                 WeightsDType dtype) {
  if (model::IsGgufPath(dir)) {
    KDN_ASSIGN_OR_RETURN(auto file, model::GgufFile::Open(dir));
    return LoadGgufWeights(*file, config, dtype);
  }
  KDN_ASSIGN_OR_RETURN(auto weight_map, WeightMap(dir));
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files;
  auto open = [&](const std::string& name) -> Result<SafetensorsFile*> {
    auto it = files.find(name);
    if (it != files.end()) return it->second.get();
    KDN_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(dir / name));
    SafetensorsFile* raw = f.get();
    files[name] = std::move(f);
    return raw;
  };

  ModelWeights weights;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    std::string file = "model.safetensors";
    if (!weight_map.empty()) {
      auto it = weight_map.find(spec.name);
      if (it == weight_map.end()) {
        return NotFound((dir / "model.safetensors.index.json").string() + ": tensor \"" +
                        spec.name + "\" is not in weight_map");
      }
      file = it->second;
    }
    KDN_ASSIGN_OR_RETURN(SafetensorsFile * f, open(file));
    const SafetensorsEntry* e = f->Find(spec.name);
    if (e == nullptr) {
      return NotFound(f->path().string() + ": tensor \"" + spec.name + "\" is missing");
    }
    if (e->shape != spec.shape) {
      return InvalidArgument(f->path().string() + ": tensor \"" + spec.name + "\" has shape " +
                             ShapeToString(e->shape) + ", config.json implies " +
                             ShapeToString(spec.shape));
    }
    HostTensor t;
    t.shape = spec.shape;
    if (dtype == WeightsDType::kNative && spec.shape.size() == 2 && e->dtype != DType::kF32) {
      // F16 or BF16 matrices stay 16-bit.
      t.type = e->dtype == DType::kF16 ? model::GgmlType::kF16 : model::GgmlType::kBF16;
      t.bytes.assign(e->data, e->data + t.numel() * 2);
    } else {
      t.data.resize(t.numel());
      ToFloat(e->dtype, e->data, t.data.size(), t.data.data());
    }
    weights.emplace(spec.name, std::move(t));
  }
  return weights;
}

}  // namespace kdn::engine
