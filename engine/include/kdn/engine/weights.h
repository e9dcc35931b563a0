#pragma once
// The tensors of a Llama-family model, named as Hugging Face names them, and
// the loader that fills them from a model folder's safetensors files.

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/model/config.h"
#include "kdn/model/tensors.h"
#include "kdn/engine/tensor.h"

namespace kdn::engine {

// Every tensor a model with `config` must have (kdn/model/tensors.h).
using model::ExpectedTensors;
using model::TensorSpec;

// Name -> tensor (fp32, or a matrix in its stored format, HostTensor). The
// engine's backends take their own layouts from it.
using ModelWeights = std::map<std::string, HostTensor>;

// How LoadWeights hands over weight matrices: all as fp32, or each in the
// format the file stores it in where the CPU engine computes in that format
// (GGUF's Q8_0, Q4_0, Q4_1, F16, BF16; safetensors' F16 and BF16; quant.h).
// Vectors (norms, biases) are fp32 either way.
enum class WeightsDType { kF32, kNative };
// "f32" or "native"; InvalidArgument naming both otherwise.
Result<WeightsDType> ParseWeightsDType(const std::string& name);
const char* WeightsDTypeName(WeightsDType d);

// Turns a tensor kept in its stored format into fp32 values (a no-op for
// fp32 ones).
void ToF32(HostTensor* tensor);

// Loads every expected tensor from DIR/model.safetensors, or from the shards
// DIR/model.safetensors.index.json lists, converting bf16/fp16/fp32 to fp32.
// Errors name the file and the tensor (missing, wrong shape, unsupported
// dtype, truncated data). Tensors the model does not use are ignored. Where
// `dir` is a GGUF file (model::IsGgufPath), its tensors are read instead
// (LoadGgufWeights, kdn/engine/gguf_weights.h).
Result<ModelWeights> LoadWeights(const std::filesystem::path& dir, const model::ModelConfig& config,
                                 WeightsDType dtype = WeightsDType::kF32);

}  // namespace kdn::engine
