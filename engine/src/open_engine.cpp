#include "kdn/engine/open_engine.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <utility>

#include "kdn/engine/cpu_engine.h"
#include "kdn/engine/presets.h"
#if KDN_CUDA
#include "kdn/engine/cuda/cuda_engine.h"
#endif

namespace kdn::engine {

using model::LoadModelConfig;
using model::ModelConfig;

namespace {

// Fewest tokens of KV a memory share must leave room for: a few blocks, or
// the share is a mistake rather than a small pool.
constexpr int64_t kMinPoolTokens = 4 * kKvBlockTokens;

Status CheckOptions(const OpenOptions& o) {
  if (o.kv_tokens <= 0) return InvalidArgument("kv_tokens must be positive");
  if (!(o.gpu_mem_fraction >= 0 && o.gpu_mem_fraction <= 1)) {
    return InvalidArgument("gpu_mem_fraction must be in (0, 1], got " +
                           std::to_string(o.gpu_mem_fraction));
  }
  if (o.device.cuda() && !HasCuda()) {
    return FailedPrecondition("device " + o.device.ToString() +
                              ": this build has no CUDA backend (configure with KDN_CUDA=ON "
                              "where nvcc is installed); use --device cpu");
  }
  return Status::Ok();
}

EngineOptions CpuOptions(const OpenOptions& o) {
  EngineOptions e;
  e.kv_tokens = o.kv_tokens;
  e.threads = o.threads;
  e.kv_pool_memory = o.kv_pool_memory;
  e.weights_dtype = o.weights_dtype;
  return e;
}

#if KDN_CUDA
// The CUDA engine's options for `o`, its KV pool of o.kv_tokens.
cuda::CudaEngineOptions CudaBaseOptions(const ModelConfig& config, const OpenOptions& o) {
  cuda::CudaEngineOptions c;
  c.device = o.device.index;
  c.max_batch = o.max_batch;
  // No prefill is longer than the model's context.
  c.max_prefill_tokens = std::min<int64_t>(o.max_prefill_tokens, config.max_context);
  c.kv_tokens = o.kv_tokens;
  c.kv_pool_memory = o.kv_pool_memory;
  return c;
}

// The same with the pool sized by the memory share, when one is given.
Result<cuda::CudaEngineOptions> CudaOptions(const ModelConfig& config, const OpenOptions& o) {
  cuda::CudaEngineOptions c = CudaBaseOptions(config, o);
  if (o.gpu_mem_fraction > 0) {
    KDN_ASSIGN_OR_RETURN(c.kv_tokens, KvTokensForMemoryShare(config, o));
  }
  return c;
}
#endif

}  // namespace

std::string Device::ToString() const {
  return kind == Kind::kCpu ? "cpu" : "cuda:" + std::to_string(index);
}

Result<Device> ParseDevice(std::string_view name) {
  if (name == "cpu") return Device{};
  if (name == "cuda") return Device{Device::Kind::kCuda, 0};
  if (name.starts_with("cuda:")) {
    const std::string_view n = name.substr(5);
    int index = -1;
    const auto [end, ec] = std::from_chars(n.data(), n.data() + n.size(), index);
    if (ec == std::errc() && end == n.data() + n.size() && !n.empty() && index >= 0) {
      return Device{Device::Kind::kCuda, index};
    }
  }
  return InvalidArgument("device '" + std::string(name) + "': expected cpu, cuda or cuda:N");
}

bool HasCuda() { return KDN_CUDA != 0; }

Result<int64_t> KvTokensForMemoryShare(const ModelConfig& config, const OpenOptions& o) {
#if KDN_CUDA
  if (!o.device.cuda() || !(o.gpu_mem_fraction > 0 && o.gpu_mem_fraction <= 1)) {
    return InvalidArgument("a memory share sizes the KV pool of a cuda device only");
  }
  KDN_ASSIGN_OR_RETURN(const cuda::DeviceMemoryInfo mem, cuda::DeviceMemory(o.device.index));
  cuda::CudaEngineOptions fixed = CudaBaseOptions(config, o);
  fixed.kv_tokens = 0;
  const int64_t share = static_cast<int64_t>(std::floor(o.gpu_mem_fraction * mem.total_bytes));
  const int64_t fixed_bytes = cuda::EstimateDeviceBytes(config, fixed);
  const int64_t rest = share - fixed_bytes;
  const int64_t tokens =
      rest > 0 ? rest / cuda::KvBytesPerToken(config) / kKvBlockTokens * kKvBlockTokens : 0;
  if (tokens < kMinPoolTokens) {
    auto mib = [](int64_t b) { return std::to_string(b / (int64_t{1} << 20)) + " MiB"; };
    return FailedPrecondition(o.device.ToString() + ": a --gpu-mem-fraction of " +
                              std::to_string(o.gpu_mem_fraction) + " is " + mib(share) + " of " +
                              mib(mem.total_bytes) +
                              ", but the model's weights, "
                              "activations and workspaces alone take about " +
                              mib(fixed_bytes) + "; give it a larger share");
  }
  return tokens;
#else
  (void)config;
  (void)o;
  return FailedPrecondition("this build has no CUDA backend");
#endif
}

Result<std::unique_ptr<Engine>> OpenEngine(const std::filesystem::path& dir,
                                           const OpenOptions& options) {
  KDN_RETURN_IF_ERROR(CheckOptions(options));
  KDN_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
#if KDN_CUDA
  // Refuse a device that cannot hold the model before reading gigabytes of
  // weights.
  if (options.device.cuda()) KDN_RETURN_IF_ERROR(CudaOptions(config, options).status());
#endif
  // A GPU takes f32 and uploads its own dtype; the CPU computes in the
  // file's formats unless told f32.
  KDN_ASSIGN_OR_RETURN(
      ModelWeights weights,
      LoadWeights(dir, config, options.device.cuda() ? WeightsDType::kF32 : options.weights_dtype));
  return OpenEngine(config, std::move(weights), options);
}

Result<std::unique_ptr<Engine>> OpenEngine(const ModelConfig& config, ModelWeights weights,
                                           const OpenOptions& options) {
  KDN_RETURN_IF_ERROR(CheckOptions(options));
#if KDN_CUDA
  if (options.device.cuda()) {
    KDN_ASSIGN_OR_RETURN(const cuda::CudaEngineOptions co, CudaOptions(config, options));
    // The GPU uploads from f32: widen matrices a caller kept in their format.
    for (auto& [name, t] : weights) ToF32(&t);
    KDN_ASSIGN_OR_RETURN(auto e, cuda::CudaEngine::Create(config, weights, co));
    return std::unique_ptr<Engine>(std::move(e));
  }
#endif
  KDN_ASSIGN_OR_RETURN(auto e, CpuEngine::Create(config, std::move(weights), CpuOptions(options)));
  return std::unique_ptr<Engine>(std::move(e));
}

Result<std::unique_ptr<Engine>> MaterializeEngine(const ModelConfig& config, uint64_t seed,
                                                  const OpenOptions& options, DType cpu_dtype) {
  KDN_RETURN_IF_ERROR(CheckOptions(options));
#if KDN_CUDA
  if (options.device.cuda()) {
    KDN_ASSIGN_OR_RETURN(const cuda::CudaEngineOptions co, CudaOptions(config, options));
    KDN_ASSIGN_OR_RETURN(auto e, cuda::CudaEngine::Materialize(config, seed, co));
    return std::unique_ptr<Engine>(std::move(e));
  }
#endif
  return OpenEngine(config, GenerateWeights(config, seed, cpu_dtype), options);
}

}  // namespace kdn::engine
