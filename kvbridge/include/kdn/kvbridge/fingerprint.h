#pragma once
// The model fingerprint that every chunk key covers (docs/kvbus.md, "Model
// fingerprint"), from the model's config, the tensors it implies
// (kdn/model/tensors.h) and its files: the library kdn_fingerprint, which
// links kvbus and model but not the engine. Thread-safe: pure functions.

#include <cstdint>
#include <filesystem>
#include <string_view>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/key.h"
#include "kdn/model/config.h"

namespace kdn::kvbridge {

// Covers the model config (architecture and every shape and RoPE field),
// every weight tensor's name and shape, the weights' dtype, the KV dtype and
// a digest of the weights' contents (WeightsDigest), so two models that could
// produce different KV never share a chunk: not even two fine-tunes of one
// architecture, which shapes and dtypes alone would confuse.
kvbus::ChunkKey ModelFingerprint(const model::ModelConfig& config, std::string_view weight_dtype,
                                 std::string_view kv_dtype, uint64_t weights_digest);

// XXH3-64 over the bytes of the model folder's safetensors files, in the
// order of their names, or of the whole GGUF file where `model_dir` is one
// (so a Q4_1 file's chunks never mix with another quantization's); streamed,
// ~10 GB/s, so ~2 s for 16 GB.
Result<uint64_t> WeightsDigest(const std::filesystem::path& model_dir);

// The fingerprint of the model at `model_dir` (a folder or a GGUF file),
// whose config is `config`, with its KV kept as `kv_dtype`: ModelFingerprint
// over its WeightsDigest and its config's torch_dtype ("unknown" where the
// config names none). What kdn's workers and the C client key chunks under.
Result<kvbus::ChunkKey> FolderFingerprint(const std::filesystem::path& model_dir,
                                          const model::ModelConfig& config, kdn::DType kv_dtype);

}  // namespace kdn::kvbridge
