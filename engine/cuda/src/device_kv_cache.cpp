// The device KV cache's reads, writes and rotations, and what a CudaEngine
// needs of its device (cuda_engine.h: DeviceCount, EstimateDeviceBytes).
#include <cstring>

#include "cuda_engine_impl.h"
#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {

namespace {

// Workspaces not sized by the options: FlashInfer's plans and split-KV
// buffers (two sets on Hopper: the row pass's shared keys plan apart), the
// device sampler, cuBLAS's own. Generous, so that a start that
// passes the check does not fail at its first long prompt.
constexpr int64_t kFixedWorkspaceBytes = int64_t{1024} << 20;

}  // namespace

int DeviceCount() { return ::kdn::CudaDevices(); }

int64_t KvBytesPerToken(const ModelConfig& c) {
  return int64_t{c.num_layers} * 2 * c.kv_dim() * static_cast<int64_t>(sizeof(bf16));
}

int64_t EstimateDeviceBytes(const ModelConfig& c, const CudaEngineOptions& o) {
  const int64_t e = sizeof(bf16);
  const int64_t weights = c.ParameterCount() * e;
  const int64_t kv = ((o.kv_tokens + 15) / 16 + 1) * 16 * KvBytesPerToken(c);
  const int64_t rows = std::max<int64_t>(o.max_prefill_tokens, o.max_batch);
  const int64_t per_row = (2 * int64_t{c.hidden_size} + c.q_dim() + 2 * c.kv_dim() + c.q_dim() +
                           3 * int64_t{c.intermediate_size} + c.q_dim()) *
                              e +
                          16;
  const int64_t logits = std::max<int64_t>(1024, o.max_batch) * c.vocab_size * 4;
  return weights + kv + rows * per_row + logits + kFixedWorkspaceBytes;
}

Result<DeviceMemoryInfo> DeviceMemory(int device) {
  const int count = DeviceCount();
  if (count == 0) {
    return FailedPrecondition(
        "cuda: no CUDA device is visible (driver missing, or "
        "CUDA_VISIBLE_DEVICES empty); use --device cpu");
  }
  if (device < 0 || device >= count) {
    return FailedPrecondition("cuda: no device " + std::to_string(device) + "; this machine has " +
                              std::to_string(count) + " (0.." + std::to_string(count - 1) + ")");
  }
  KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  size_t free_bytes = 0, total_bytes = 0;
  KDN_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  return DeviceMemoryInfo{static_cast<int64_t>(free_bytes), static_cast<int64_t>(total_bytes)};
}

Status internal::CheckDevice(const ModelConfig& config, const CudaEngineOptions& options) {
  KDN_ASSIGN_OR_RETURN(const DeviceMemoryInfo mem, DeviceMemory(options.device));
  const int64_t need = EstimateDeviceBytes(config, options);
  if (need > mem.free_bytes) {
    auto mib = [](int64_t b) { return std::to_string(b / (int64_t{1} << 20)) + " MiB"; };
    return FailedPrecondition(
        "cuda:" + std::to_string(options.device) + ": the model needs about " + mib(need) +
        " (weights " + mib(config.ParameterCount() * 2) + ", KV for " +
        std::to_string(options.kv_tokens) + " tokens " +
        mib(options.kv_tokens * KvBytesPerToken(config)) + ") but only " + mib(mem.free_bytes) +
        " of " + mib(mem.total_bytes) +
        " are free; give it fewer KV tokens, a smaller --gpu-mem-fraction share or a GPU "
        "of its own");
  }
  return Status::Ok();
}

DeviceKvCache::~DeviceKvCache() {
  // The pools (k_, v_ and the staging arrays) are freed after this, on the
  // device made current here.
  (void)UseDevice(device_);
  if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
}

Status DeviceKvCache::Allocate(const std::function<Result<uint8_t*>(uint64_t bytes)>& memory) {
  KDN_RETURN_IF_ERROR(UseDevice(device_));
  KDN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  const uint64_t bytes = StorageBytes(num_layers(), num_kv_heads(), head_dim(), num_blocks());
  if (memory) {
    KDN_ASSIGN_OR_RETURN(uint8_t * p, memory(bytes));
    pool_ = reinterpret_cast<bf16*>(p);
  } else {
    KDN_RETURN_IF_ERROR(own_.Allocate(static_cast<int64_t>(bytes / sizeof(bf16))));
    pool_ = own_.get();
  }
  const int64_t layer = int64_t{num_blocks()} * block_stride();
  k_.resize(num_layers());
  v_.resize(num_layers());
  for (int l = 0; l < num_layers(); ++l) {
    k_[l] = pool_ + 2 * l * layer;
    v_[l] = k_[l] + layer;
  }
  return Status::Ok();
}

KvPoolMemory DeviceKvCache::Memory() const {
  return {reinterpret_cast<uint8_t*>(pool_),
          StorageBytes(num_layers(), num_kv_heads(), head_dim(), num_blocks()), device_,
          DType::kBF16};
}

uint64_t DeviceKvCache::BlockOffset(int layer, bool value, int32_t block) const {
  const bf16* at = (value ? v_ : k_)[layer] + static_cast<int64_t>(block) * block_stride();
  return static_cast<uint64_t>(at - pool_) * sizeof(bf16);
}

Status DeviceKvCache::Stage(std::span<const int32_t> blocks, int layer0, int layers, int64_t first,
                            int64_t count, bool gather) const {
  // The table from the first position's block on, so positions shift to it.
  const int64_t b0 = first / kKvBlockTokens, b1 = (first + count - 1) / kKvBlockTokens + 1;
  const int64_t layer_rows = 2 * count * token_stride();
  if (table_.size() < b1 - b0) KDN_RETURN_IF_ERROR(table_.Allocate(b1 - b0));
  if (rows_.size() < layers * layer_rows) KDN_RETURN_IF_ERROR(rows_.Allocate(layers * layer_rows));
  KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(table_.get(), blocks.data() + b0,
                                           (b1 - b0) * sizeof(int32_t), cudaMemcpyHostToDevice,
                                           stream_));
  const int64_t at = first - b0 * kKvBlockTokens;
  for (int i = 0; i < layers; ++i) {
    const int l = layer0 + i;
    const PagedKvLayer<bf16> pool{k_[l], v_[l], num_kv_heads(), head_dim()};
    bf16* rows = rows_.get() + i * layer_rows;
    KDN_RETURN_IF_ERROR(gather ? GatherKvCuda<bf16>(pool, table_.get(), at, count, rows, stream_)
                               : ScatterKvCuda<bf16>(rows, count, table_.get(), at, pool, stream_));
  }
  return Status::Ok();
}

Status DeviceKvCache::ReadRows(std::span<const int32_t> blocks, int layer0, int layers,
                               int64_t first, int64_t count, DType dtype, uint8_t* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  KDN_RETURN_IF_ERROR(UseDevice(device_));
  KDN_RETURN_IF_ERROR(Stage(blocks, layer0, layers, first, count, /*gather=*/true));
  const size_t n = static_cast<size_t>(layers * 2 * count * token_stride());
  // bf16 goes straight to the caller's buffer; other types through host_.
  void* dst = out;
  if (dtype != DType::kBF16) {
    host_.resize(n);
    dst = host_.data();
  }
  KDN_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, rows_.get(), n * sizeof(bf16), cudaMemcpyDeviceToHost, stream_));
  KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  if (dtype != DType::kBF16) {
    std::vector<float> f(n);
    ToFloat(DType::kBF16, host_.data(), n, f.data());
    FromFloat(dtype, f.data(), n, out);
  }
  return Status::Ok();
}

Status DeviceKvCache::WriteRows(std::span<const int32_t> blocks, int layer0, int layers,
                                int64_t first, int64_t count, DType dtype, const uint8_t* in) {
  std::lock_guard<std::mutex> lock(mu_);
  KDN_RETURN_IF_ERROR(UseDevice(device_));
  const size_t n = static_cast<size_t>(layers * 2 * count * token_stride());
  const void* src = in;
  if (dtype != DType::kBF16) {
    std::vector<float> f(n);
    ToFloat(dtype, in, n, f.data());
    host_.resize(n);
    FromFloat(DType::kBF16, f.data(), n, host_.data());
    src = host_.data();
  }
  if (rows_.size() < static_cast<int64_t>(n)) {
    KDN_RETURN_IF_ERROR(rows_.Allocate(static_cast<int64_t>(n)));
  }
  KDN_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(rows_.get(), src, n * sizeof(bf16), cudaMemcpyHostToDevice, stream_));
  KDN_RETURN_IF_ERROR(Stage(blocks, layer0, layers, first, count, /*gather=*/false));
  KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

Status DeviceKvCache::CopyBlock(int32_t from, int32_t to) {
  std::lock_guard<std::mutex> lock(mu_);
  KDN_RETURN_IF_ERROR(UseDevice(device_));
  const size_t bytes = static_cast<size_t>(block_stride()) * sizeof(bf16);
  for (int l = 0; l < num_layers(); ++l) {
    for (bf16* pool : {k_[l], v_[l]}) {
      KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pool + to * block_stride(),
                                               pool + from * block_stride(), bytes,
                                               cudaMemcpyDeviceToDevice, stream_));
    }
  }
  KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

Status DeviceKvCache::RotateKeys(std::span<const int32_t> blocks, int layer, int64_t first,
                                 int64_t count, int64_t delta, const float* inv_freq) {
  std::lock_guard<std::mutex> lock(mu_);
  KDN_RETURN_IF_ERROR(UseDevice(device_));
  // Gather, turn the K rows by delta positions (RoPE of position delta is
  // the rotation by delta), scatter back; V goes back as it came.
  KDN_RETURN_IF_ERROR(Stage(blocks, layer, 1, first, count, /*gather=*/true));
  if (positions_.size() < count) KDN_RETURN_IF_ERROR(positions_.Allocate(count));
  const std::vector<int32_t> deltas(count, static_cast<int32_t>(delta));
  KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(positions_.get(), deltas.data(), count * sizeof(int32_t),
                                           cudaMemcpyHostToDevice, stream_));
  KDN_RETURN_IF_ERROR(ApplyRopeCuda<bf16>(rows_.get(), count, num_kv_heads(), head_dim(),
                                          positions_.get(), inv_freq, stream_));
  KDN_RETURN_IF_ERROR(Stage(blocks, layer, 1, first, count, /*gather=*/false));
  // The host vector of deltas must outlive its copy.
  KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

}  // namespace kdn::engine::cuda
