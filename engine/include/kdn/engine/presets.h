#pragma once
// Generated models: named shapes (presets) and deterministic weights.
//
// Every tensor is drawn from its own stream, seeded by (seed, tensor name),
// so a tensor's values do not depend on which others are generated or in what
// order, and a large model can be written piece by piece.

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/model/config.h"
#include "kdn/engine/tensor.h"
#include "kdn/engine/weights.h"

namespace kdn::engine {

struct Preset {
  std::string name;
  std::string description;
  model::ModelConfig config;
  DType dtype;  // what the folder stores by default
};

const std::vector<Preset>& Presets();
Result<Preset> FindPreset(const std::string& name);

// Fills `n` values of tensor `spec` starting at element `offset`.
void FillTensor(const model::ModelConfig& config, const TensorSpec& spec, uint64_t seed,
                int64_t offset, int64_t n, float* out);

// All tensors of the model, in memory (fp32), rounded through `dtype` so they
// equal what a folder written with that dtype loads back.
ModelWeights GenerateWeights(const model::ModelConfig& config, uint64_t seed, DType dtype);

// Writes config.json, model.safetensors, tokenizer.json and
// tokenizer_config.json into `dir` (created if needed). `progress` (may be
// empty) is called with bytes written and total.
Status WriteModelFolder(const std::filesystem::path& dir, const model::ModelConfig& config,
                        uint64_t seed, DType dtype,
                        const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace kdn::engine
