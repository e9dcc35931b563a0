#pragma once
// OpenEngine: a backend of the Engine interface (engine.h) picked by a device
// name, so that workers, tools and bench hold an Engine and never name a
// backend. "cpu" is CpuEngine; "cuda" or "cuda:N" is cuda::CudaEngine on
// device N (in a build with CUDA; elsewhere a clear error).
//
// On a GPU the paged-KV pool is sized either by kv_tokens or, with
// gpu_mem_fraction, to fill that share of the device's total memory once the
// weights, activations and workspaces are counted (the engine's own
// estimate), so that several workers can share one GPU.
//
// Thread-safe (functions over values).

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "kdn/common/status.h"
#include "kdn/model/config.h"
#include "kdn/engine/engine.h"
#include "kdn/engine/weights.h"

namespace kdn::engine {

struct Device {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;  // the CUDA device ordinal
  bool cuda() const { return kind == Kind::kCuda; }
  std::string ToString() const;  // "cpu", "cuda:0"
};

// Parses "cpu", "cuda" (device 0) or "cuda:N". INVALID_ARGUMENT otherwise.
Result<Device> ParseDevice(std::string_view name);

struct OpenOptions {
  Device device;
  // Tokens of KV the paged cache holds (its pool), unless gpu_mem_fraction
  // sizes it.
  int64_t kv_tokens = 16384;
  // cuda only: > 0 sizes the KV pool to fill this share (0 < f <= 1) of the
  // device's total memory; FAILED_PRECONDITION when the share does not even
  // hold the weights and activations with a few blocks of KV.
  double gpu_mem_fraction = 0;
  // cpu only: OpenMP/OpenBLAS threads, 0 = all cores.
  int threads = 0;
  // Where the KV pool lives (EngineOptions::kv_pool_memory on the cpu,
  // CudaEngineOptions::kv_pool_memory on cuda: device memory there).
  std::function<Result<uint8_t*>(uint64_t bytes)> kv_pool_memory;
  // cpu only: weight matrices kept in the file's format (quantized dot
  // products) or widened to f32 at load (weights.h).
  WeightsDType weights_dtype = WeightsDType::kNative;
  // cuda only: the longest Prefill call or row pass, and the largest decode
  // batch (they size the activation buffers).
  int64_t max_prefill_tokens = 32768;
  int max_batch = 256;
};

// Whether this build has the CUDA backend.
bool HasCuda();

// Loads a Hugging Face model folder (config.json, safetensors weights) or a
// GGUF file onto options.device: on the CPU as options.weights_dtype says,
// uploaded as bf16 on a GPU.
Result<std::unique_ptr<Engine>> OpenEngine(const std::filesystem::path& dir,
                                           const OpenOptions& options);
// The same from weights in memory (fp32, Hugging Face names).
Result<std::unique_ptr<Engine>> OpenEngine(const model::ModelConfig& config, ModelWeights weights,
                                           const OpenOptions& options);
// A model of `config` with generated weights, for benchmarks of real shapes
// with no weights file: kdn-mkmodel's values from `seed` on the CPU, values
// drawn on the device itself on a GPU (cuda::CudaEngine::Materialize; an 8B
// model never passes through host memory). The two are not the same model.
// On the CPU the values are rounded through `cpu_dtype`, as a folder of that
// dtype would hold them.
Result<std::unique_ptr<Engine>> MaterializeEngine(const model::ModelConfig& config, uint64_t seed,
                                                  const OpenOptions& options,
                                                  DType cpu_dtype = DType::kF32);

// The KV pool, in tokens, that gpu_mem_fraction gives a model of `config` on
// options.device (cuda only; reads the device's total memory).
Result<int64_t> KvTokensForMemoryShare(const model::ModelConfig& config,
                                       const OpenOptions& options);

}  // namespace kdn::engine
