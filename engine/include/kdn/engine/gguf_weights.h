#pragma once
// A Llama model's tensors read from a GGUF file (kdn/model/gguf.h) into the
// engine's ModelWeights, under Hugging Face's names, so that both backends
// take them as they take a folder's safetensors: fp32, or the matrices in
// their stored format (WeightsDType::kNative) for the CPU engine.
//
// Tensor types read: F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (quant.h's table);
// dequantized, each value is bit for bit what the `gguf` package's
// dequantize gives (fp32 arithmetic, no fused multiply-add). Other types are refused naming the
// tensor and the type. llama.cpp's converter stores Llama's Q and K projections with each head's
// rows interleaved for its RoPE (rows j and j + head_dim/2 of a head side by side); the loader puts
// their rows back in Hugging Face's order, in either form. Thread-safe (functions over values).

#include <cstdint>
#include <string>

#include "kdn/common/status.h"
#include "kdn/engine/weights.h"
#include "kdn/model/config.h"
#include "kdn/model/gguf.h"

namespace kdn::engine {

// Whether DequantizeGguf reads ggml type `type`.
bool CanDequantize(uint32_t type);

// Writes the `n` values (a whole number of the type's blocks) stored at `src`
// in ggml type `type` to `dst` as floats. Unimplemented for a type
// CanDequantize refuses; InvalidArgument when n is not whole blocks.
Status DequantizeGguf(uint32_t type, const uint8_t* src, int64_t n, float* dst);

// The GGUF name of a tensor ExpectedTensors names ("model.layers.3.mlp.up_proj.weight"
// -> "blk.3.ffn_up.weight"); empty for a name it does not know.
std::string GgufTensorName(const std::string& hf_name);

// Every tensor ExpectedTensors(config) names, from `file`. Errors name the
// file and the tensor (missing, wrong shape, a type not read).
Result<ModelWeights> LoadGgufWeights(const model::GgufFile& file, const model::ModelConfig& config,
                                     WeightsDType dtype = WeightsDType::kF32);

}  // namespace kdn::engine
