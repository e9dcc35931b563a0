#include "kdn/engine/cuda/cuda_engine.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "kdn/engine/cpu_ops.h"
#include "kdn/engine/cuda/activation.cuh"
#include "kdn/engine/cuda/attention.cuh"
#include "kdn/engine/cuda/cuda_check.h"
#include "kdn/engine/cuda/device_sampler.h"
#include "kdn/engine/cuda/embedding.cuh"
#include "kdn/engine/cuda/flash_attention.h"
#include "kdn/engine/cuda/gemv.cuh"
#include "kdn/engine/cuda/init.cuh"
#include "kdn/engine/cuda/paged_kv.cuh"
#include "kdn/engine/cuda/rmsnorm.cuh"
#include "kdn/engine/cuda/rope.cuh"
#include "kdn/engine/cuda/sampling.cuh"

namespace kdn::engine::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kMaxDecodeSplits = 64;
constexpr int64_t kLogitRows = 1024;  // all_logits is computed this many rows at a time
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// The batch sizes decode graphs are captured for: a batch runs in the
// smallest bucket that holds it, padded with rows that touch only a scratch
// block.
int DecodeBucket(int batch, int max_batch) {
  int b = 1;
  while (b < batch && b < 8) b *= 2;
  if (b < batch) b = (batch + 7) / 8 * 8;
  if (b > 64) b = (batch + 31) / 32 * 32;
  return std::min(b, max_batch);
}

#define KDN_CUBLAS_RETURN_IF_ERROR(expr)                                                   \
  do {                                                                                     \
    const cublasStatus_t _kdn_cublas_st = (expr);                                          \
    if (_kdn_cublas_st != CUBLAS_STATUS_SUCCESS) {                                         \
      return Internal(std::string(#expr) + " failed: " +                                   \
                      cublasGetStatusString(_kdn_cublas_st) + " at " + __FILE__ + ":" +    \
                      std::to_string(__LINE__));                                           \
    }                                                                                      \
  } while (0)

// A device allocation of n elements of T.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr, o.n_ = 0; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DeviceArray() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  Status Allocate(int64_t n) {
    void* p = nullptr;
    KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, std::max<int64_t>(1, n) * sizeof(T)));
    if (p_ != nullptr) (void)cudaFree(p_);
    p_ = static_cast<T*>(p);
    n_ = n;
    return Status::Ok();
  }
  T* get() const { return p_; }
  int64_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  int64_t n_ = 0;
};

struct LayerWeights {
  DeviceArray<bf16> input_norm, post_norm;
  DeviceArray<bf16> qkv;              // [q_dim + 2 * kv_dim][hidden]: q rows, k rows, v rows
  DeviceArray<bf16> o;                // [hidden][q_dim]
  DeviceArray<bf16> qkv_bias, o_bias; // empty when absent
  DeviceArray<bf16> gate_up;          // [2 * ffn][hidden]: gate rows, then up rows
  DeviceArray<bf16> down;             // [hidden][ffn]
};

// A pinned host buffer of n elements of T.
template <typename T>
class PinnedArray {
 public:
  PinnedArray() = default;
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
  ~PinnedArray() {
    if (p_ != nullptr) (void)cudaFreeHost(p_);
  }
  Status Allocate(int64_t n) {
    KDN_CUDA_RETURN_IF_ERROR(
        cudaMallocHost(reinterpret_cast<void**>(&p_), std::max<int64_t>(1, n) * sizeof(T)));
    return Status::Ok();
  }
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
};

}  // namespace

struct CudaEngine::Impl {
  ModelConfig config;
  CudaEngineOptions options;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  int64_t weight_bytes = 0;

  DeviceArray<bf16> embed, lm_head, final_norm;  // lm_head empty when tied
  std::vector<LayerWeights> layers;
  DeviceArray<float> inv_freq;

  // The KV pool: per layer, K and V of num_blocks blocks.
  int num_blocks = 0;
  std::vector<DeviceArray<bf16>> k_cache, v_cache;
  std::vector<int32_t> free_list;

  int32_t scratch_block = -1;  // where decode graphs' padding rows write

  // Activations, sized for max(max_prefill_tokens, max_batch) rows.
  int64_t max_rows = 0;
  DeviceArray<bf16> x, h, qkv, q, attn, gate_up, act;  // q: reference attention only
  DeviceArray<float> logits;
  DeviceArray<int32_t> ids, positions, tables, lengths, bad_id, sampled;
  DeviceArray<int64_t> slots;
  DeviceArray<float> workspace;
  DeviceArray<char> blas_workspace, argmax_workspace;

  // Decode inputs staged in pinned memory; each step waits for its own end,
  // so one set serves every step.
  PinnedArray<int32_t> ids_host, positions_host, sampled_host;
  PinnedArray<int64_t> slots_host;

  std::unique_ptr<FlashAttention> flash;       // null: reference attention
  std::unique_ptr<DeviceSampler> sampler;      // made at the first DecodeSample
  std::map<int, cudaGraphExec_t> decode_graphs;  // by bucket

  ~Impl() {
    for (auto& [bucket, exec] : decode_graphs) (void)cudaGraphExecDestroy(exec);
    if (blas != nullptr) (void)cublasDestroy(blas);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }

  int64_t qkv_dim() const { return config.q_dim() + 2 * config.kv_dim(); }
  bool graphs() const { return flash != nullptr && options.cuda_graphs; }

  PagedKvLayer<bf16> Layer(int l) {
    return {k_cache[l].get(), v_cache[l].get(), config.num_kv_heads, config.head_dim};
  }
  PagedKvLayer<const bf16> ConstLayer(int l) {
    return {k_cache[l].get(), v_cache[l].get(), config.num_kv_heads, config.head_dim};
  }

  // out[rows][out_dim] (= or +=) in[rows][in_dim] . w[out_dim][in_dim]^T.
  // A few rows (a small decode batch) stream the weights through GemvCuda;
  // everything else is cuBLAS.
  Status Gemm(const bf16* in, int64_t rows, int in_dim, const bf16* w, int out_dim, void* out,
              cudaDataType_t out_type, bool accumulate) {
    if (rows <= kGemvMaxRows && GemvFits(in, static_cast<int>(rows), in_dim, w)) {
      const int r = static_cast<int>(rows);
      return out_type == CUDA_R_32F
                 ? GemvCuda<float>(in, r, in_dim, w, out_dim, static_cast<float*>(out),
                                   accumulate, stream)
                 : GemvCuda<bf16>(in, r, in_dim, w, out_dim, static_cast<bf16*>(out), accumulate,
                                  stream);
    }
    return CublasGemm(in, rows, in_dim, w, out_dim, out, out_type, accumulate);
  }

  // out = RMSNorm(x; norm) . w^T, the norm into h first. (Fusing the norm
  // into GemvCuda, each block recomputing its rows' RMS, measured slower at
  // batch 1 on an H100: 6.12 against 6.03 ms a step.)
  Status NormGemm(const bf16* x, int64_t rows, const bf16* norm, const bf16* w, int out_dim,
                  void* out, cudaDataType_t out_type) {
    const int dim = config.hidden_size;
    KDN_RETURN_IF_ERROR(RmsNormCuda<bf16>(x, norm, static_cast<float>(config.rms_norm_eps), rows,
                                          dim, h.get(), stream));
    return Gemm(h.get(), rows, dim, w, out_dim, out, out_type, false);
  }

  Status CublasGemm(const bf16* in, int64_t rows, int in_dim, const bf16* w, int out_dim,
                    void* out, cudaDataType_t out_type, bool accumulate) {
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    KDN_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
        blas, CUBLAS_OP_T, CUBLAS_OP_N, out_dim, static_cast<int>(rows), in_dim, &alpha, w,
        CUDA_R_16BF, in_dim, in, CUDA_R_16BF, in_dim, &beta, out, out_type, out_dim,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return Status::Ok();
  }

  Status Setup() {
    KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    KDN_CUBLAS_RETURN_IF_ERROR(cublasCreate(&blas));
    KDN_CUBLAS_RETURN_IF_ERROR(cublasSetStream(blas, stream));
    // A workspace of our own, so that cuBLAS allocates nothing while a decode
    // graph is captured.
    KDN_RETURN_IF_ERROR(blas_workspace.Allocate(kCublasWorkspaceBytes));
    KDN_CUBLAS_RETURN_IF_ERROR(
        cublasSetWorkspace(blas, blas_workspace.get(), kCublasWorkspaceBytes));
    const ModelConfig& c = config;
    const std::vector<float> freq = RopeInvFreq(c);
    KDN_RETURN_IF_ERROR(inv_freq.Allocate(static_cast<int64_t>(freq.size())));
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpy(inv_freq.get(), freq.data(), freq.size() * sizeof(float),
                                        cudaMemcpyHostToDevice));
    // One block more than asked for: the scratch block of graph padding.
    num_blocks = static_cast<int>((options.kv_tokens + 15) / 16) + 1;
    const int64_t block_elems = int64_t{16} * c.kv_dim();
    k_cache.resize(c.num_layers);
    v_cache.resize(c.num_layers);
    for (int l = 0; l < c.num_layers; ++l) {
      KDN_RETURN_IF_ERROR(k_cache[l].Allocate(num_blocks * block_elems));
      KDN_RETURN_IF_ERROR(v_cache[l].Allocate(num_blocks * block_elems));
    }
    free_list.resize(num_blocks);
    for (int b = 0; b < num_blocks; ++b) free_list[b] = num_blocks - 1 - b;
    scratch_block = free_list.back();
    free_list.pop_back();
    max_rows = std::max<int64_t>(options.max_prefill_tokens, options.max_batch);
    const int64_t R = max_rows;
    const AttentionShape shape = Shape();
    if (options.flash_attention && FlashAttention::Supports(shape)) {
      // Every block once, and the scratch block once more per padding row.
      KDN_ASSIGN_OR_RETURN(flash, FlashAttention::Create(shape, options.max_batch, R,
                                                         num_blocks + options.max_batch));
    } else {
      KDN_RETURN_IF_ERROR(q.Allocate(R * c.q_dim()));
    }
    KDN_RETURN_IF_ERROR(x.Allocate(R * c.hidden_size));
    KDN_RETURN_IF_ERROR(h.Allocate(R * c.hidden_size));
    KDN_RETURN_IF_ERROR(qkv.Allocate(R * qkv_dim()));
    KDN_RETURN_IF_ERROR(attn.Allocate(R * c.q_dim()));
    KDN_RETURN_IF_ERROR(gate_up.Allocate(R * 2 * int64_t{c.intermediate_size}));
    KDN_RETURN_IF_ERROR(act.Allocate(R * c.intermediate_size));
    KDN_RETURN_IF_ERROR(logits.Allocate(std::max<int64_t>(kLogitRows, options.max_batch) *
                                        c.vocab_size));
    KDN_RETURN_IF_ERROR(ids.Allocate(R));
    KDN_RETURN_IF_ERROR(positions.Allocate(R));
    KDN_RETURN_IF_ERROR(lengths.Allocate(options.max_batch));
    KDN_RETURN_IF_ERROR(slots.Allocate(R));
    KDN_RETURN_IF_ERROR(bad_id.Allocate(1));
    KDN_RETURN_IF_ERROR(sampled.Allocate(options.max_batch));
    KDN_RETURN_IF_ERROR(argmax_workspace.Allocate(
        static_cast<int64_t>(ArgmaxWorkspaceBytes(options.max_batch))));
    KDN_RETURN_IF_ERROR(ids_host.Allocate(options.max_batch));
    KDN_RETURN_IF_ERROR(positions_host.Allocate(options.max_batch));
    KDN_RETURN_IF_ERROR(slots_host.Allocate(options.max_batch));
    KDN_RETURN_IF_ERROR(sampled_host.Allocate(options.max_batch));
    const int64_t max_table = (c.max_context + 15) / 16;
    KDN_RETURN_IF_ERROR(tables.Allocate(std::max<int64_t>(max_table, 1) * options.max_batch));
    if (flash == nullptr) {
      KDN_RETURN_IF_ERROR(workspace.Allocate(static_cast<int64_t>(
          DecodeAttentionWorkspaceBytes(options.max_batch, shape, kMaxDecodeSplits) /
          sizeof(float))));
    }
    return Status::Ok();
  }

  AttentionShape Shape() const {
    return {config.num_heads, config.num_kv_heads, config.head_dim,
            1.0f / std::sqrt(static_cast<float>(config.head_dim))};
  }

  // Uploads `n` floats as bf16 into `dst` (allocated here).
  Status Upload(const float* src, int64_t n, DeviceArray<bf16>* dst) {
    std::vector<bf16> host(n);
    for (int64_t i = 0; i < n; ++i) host[i] = __float2bfloat16_rn(src[i]);
    KDN_RETURN_IF_ERROR(dst->Allocate(n));
    KDN_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(dst->get(), host.data(), n * sizeof(bf16), cudaMemcpyHostToDevice));
    weight_bytes += n * static_cast<int64_t>(sizeof(bf16));
    return Status::Ok();
  }

  Status UploadTensor(const ModelWeights& w, const std::string& name, DeviceArray<bf16>* dst) {
    auto it = w.find(name);
    if (it == w.end()) return InvalidArgument("CudaEngine: tensor " + name + " is missing");
    return Upload(it->second.data.data(), it->second.numel(), dst);
  }

  // Tensors stacked row-wise into one (a fused projection's weight or bias).
  Status UploadConcat(const ModelWeights& w, std::initializer_list<std::string> names,
                      DeviceArray<bf16>* dst) {
    std::vector<float> fused;
    for (const std::string& name : names) {
      auto it = w.find(name);
      if (it == w.end()) return InvalidArgument("CudaEngine: tensor " + name + " is missing");
      fused.insert(fused.end(), it->second.data.begin(), it->second.data.end());
    }
    return Upload(fused.data(), static_cast<int64_t>(fused.size()), dst);
  }

  Status UploadWeights(const ModelWeights& w) {
    KDN_RETURN_IF_ERROR(UploadTensor(w, "model.embed_tokens.weight", &embed));
    KDN_RETURN_IF_ERROR(UploadTensor(w, "model.norm.weight", &final_norm));
    if (!config.tie_word_embeddings) KDN_RETURN_IF_ERROR(UploadTensor(w, "lm_head.weight", &lm_head));
    layers.resize(config.num_layers);
    for (int l = 0; l < config.num_layers; ++l) {
      const std::string p = "model.layers." + std::to_string(l) + ".";
      LayerWeights& L = layers[l];
      KDN_RETURN_IF_ERROR(UploadTensor(w, p + "input_layernorm.weight", &L.input_norm));
      KDN_RETURN_IF_ERROR(UploadTensor(w, p + "post_attention_layernorm.weight", &L.post_norm));
      KDN_RETURN_IF_ERROR(UploadConcat(w, {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                           p + "self_attn.v_proj.weight"}, &L.qkv));
      KDN_RETURN_IF_ERROR(UploadTensor(w, p + "self_attn.o_proj.weight", &L.o));
      if (config.qkv_bias) {
        KDN_RETURN_IF_ERROR(UploadConcat(w, {p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias",
                                             p + "self_attn.v_proj.bias"}, &L.qkv_bias));
      }
      if (config.o_bias) KDN_RETURN_IF_ERROR(UploadTensor(w, p + "self_attn.o_proj.bias", &L.o_bias));
      KDN_RETURN_IF_ERROR(
          UploadConcat(w, {p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}, &L.gate_up));
      KDN_RETURN_IF_ERROR(UploadTensor(w, p + "mlp.down_proj.weight", &L.down));
    }
    return Status::Ok();
  }

  // Device-side random weights: each tensor its own hash stream.
  Status MaterializeWeights(uint64_t seed) {
    uint64_t stream_id = 0;
    auto fill = [&](int64_t n, DeviceArray<bf16>* dst) -> Status {
      KDN_RETURN_IF_ERROR(dst->Allocate(n));
      weight_bytes += n * static_cast<int64_t>(sizeof(bf16));
      return FillUniformCuda<bf16>(dst->get(), n, seed, stream_id++, 0.02f, stream);
    };
    std::vector<float> ones(config.hidden_size, 1.0f);
    const ModelConfig& c = config;
    const int64_t d = c.hidden_size, ff = c.intermediate_size;
    KDN_RETURN_IF_ERROR(fill(int64_t{c.vocab_size} * d, &embed));
    KDN_RETURN_IF_ERROR(Upload(ones.data(), d, &final_norm));
    if (!c.tie_word_embeddings) KDN_RETURN_IF_ERROR(fill(int64_t{c.vocab_size} * d, &lm_head));
    layers.resize(c.num_layers);
    for (LayerWeights& L : layers) {
      KDN_RETURN_IF_ERROR(Upload(ones.data(), d, &L.input_norm));
      KDN_RETURN_IF_ERROR(Upload(ones.data(), d, &L.post_norm));
      KDN_RETURN_IF_ERROR(fill(qkv_dim() * d, &L.qkv));
      KDN_RETURN_IF_ERROR(fill(d * c.q_dim(), &L.o));
      if (c.qkv_bias) KDN_RETURN_IF_ERROR(fill(qkv_dim(), &L.qkv_bias));
      if (c.o_bias) KDN_RETURN_IF_ERROR(fill(d, &L.o_bias));
      KDN_RETURN_IF_ERROR(fill(2 * ff * d, &L.gate_up));
      KDN_RETURN_IF_ERROR(fill(d * ff, &L.down));
    }
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    return Status::Ok();
  }

  // The layer's attention for `rows` rows of x: norm, the fused QKV product,
  // RoPE with the new K and V written to their slots (on the device), then
  // attention over the cache into attn. `decode`: one row per sequence of a
  // decode batch (lengths/tables on the device for the reference kernel);
  // otherwise the rows are one sequence's, from position `start`.
  Status Attend(int l, int64_t rows, bool decode, int64_t start, int64_t table_stride,
                int64_t max_len) {
    const ModelConfig& c = config;
    LayerWeights& L = layers[l];
    const int qkv_out = static_cast<int>(qkv_dim());
    KDN_RETURN_IF_ERROR(NormGemm(x.get(), rows, L.input_norm.get(), L.qkv.get(), qkv_out,
                                 qkv.get(), CUDA_R_16BF));
    if (c.qkv_bias) {
      KDN_RETURN_IF_ERROR(AddBiasCuda<bf16>(qkv.get(), L.qkv_bias.get(), rows, qkv_out, stream));
    }
    KDN_RETURN_IF_ERROR(RopeQkvToCacheCuda<bf16>(qkv.get(), rows, c.num_heads, c.num_kv_heads,
                                                 c.head_dim, positions.get(), inv_freq.get(),
                                                 slots.get(), Layer(l), stream));
    if (flash != nullptr) {
      return flash->Run(qkv.get(), qkv_out, ConstLayer(l), attn.get(), stream);
    }
    // The reference kernels take contiguous queries.
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
        q.get(), c.q_dim() * sizeof(bf16), qkv.get(), qkv_out * sizeof(bf16),
        c.q_dim() * sizeof(bf16), rows, cudaMemcpyDeviceToDevice, stream));
    const AttentionShape shape = Shape();
    if (decode) {
      return DecodeAttentionCuda<bf16>(q.get(), ConstLayer(l), tables.get(), table_stride,
                                       lengths.get(), rows, max_len, shape, kMaxDecodeSplits,
                                       workspace.get(), attn.get(), stream);
    }
    return PrefillAttentionCuda<bf16>(q.get(), rows, start, ConstLayer(l), tables.get(), shape,
                                      attn.get(), stream);
  }

  // After attention (in attn): output projection into the residual, then the MLP.
  Status Finish(int l, int64_t rows) {
    const ModelConfig& c = config;
    LayerWeights& L = layers[l];
    KDN_RETURN_IF_ERROR(Gemm(attn.get(), rows, c.q_dim(), L.o.get(), c.hidden_size, x.get(),
                             CUDA_R_16BF, true));
    if (c.o_bias) {
      KDN_RETURN_IF_ERROR(AddBiasCuda<bf16>(x.get(), L.o_bias.get(), rows, c.hidden_size, stream));
    }
    KDN_RETURN_IF_ERROR(RmsNormCuda<bf16>(x.get(), L.post_norm.get(),
                                          static_cast<float>(c.rms_norm_eps), rows, c.hidden_size,
                                          h.get(), stream));
    if (rows <= kGemvMaxRows &&
        GemvFits(h.get(), static_cast<int>(rows), c.hidden_size, L.gate_up.get())) {
      // A small batch: the gate/up product and the SwiGLU gate in one pass.
      KDN_RETURN_IF_ERROR(GemvSwiGluCuda(h.get(), static_cast<int>(rows), c.hidden_size,
                                         L.gate_up.get(), c.intermediate_size, act.get(), stream));
    } else {
      KDN_RETURN_IF_ERROR(Gemm(h.get(), rows, c.hidden_size, L.gate_up.get(),
                               2 * c.intermediate_size, gate_up.get(), CUDA_R_16BF, false));
      KDN_RETURN_IF_ERROR(SiluMulCuda<bf16>(gate_up.get(), rows, c.intermediate_size, act.get(),
                                            stream));
    }
    KDN_RETURN_IF_ERROR(Gemm(act.get(), rows, c.intermediate_size, L.down.get(), c.hidden_size,
                             x.get(), CUDA_R_16BF, true));
    return Status::Ok();
  }

  // Final norm and LM head for rows [first, first + rows) of x, appended to
  // *out as fp32.
  Status Logits(int64_t first, int64_t rows, std::vector<float>* out) {
    const ModelConfig& c = config;
    const bf16* head = c.tie_word_embeddings ? embed.get() : lm_head.get();
    for (int64_t r0 = 0; r0 < rows; r0 += kLogitRows) {
      const int64_t n = std::min(kLogitRows, rows - r0);
      KDN_RETURN_IF_ERROR(NormGemm(x.get() + (first + r0) * c.hidden_size, n, final_norm.get(),
                                   head, c.vocab_size, logits.get(), CUDA_R_32F));
      const size_t at = out->size();
      out->resize(at + n * c.vocab_size);
      KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(out->data() + at, logits.get(),
                                               n * c.vocab_size * sizeof(float),
                                               cudaMemcpyDeviceToHost, stream));
      KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    }
    return Status::Ok();
  }

  // The embeddings of the n ids already in `ids` (device).
  Status Embed(int64_t n) {
    return EmbedCuda<bf16>(embed.get(), config.vocab_size, config.hidden_size, ids.get(), n,
                           x.get(), bad_id.get(), stream);
  }

  // A decode step's device work for `rows` rows whose ids, positions and
  // slots are on the device (and, for the reference attention, lengths and
  // tables): every layer, then the logits of every row and their argmax. No
  // host synchronization, so a graph can capture it.
  Status DecodeBody(int64_t rows, int64_t table_stride, int64_t max_len) {
    const ModelConfig& c = config;
    KDN_RETURN_IF_ERROR(Embed(rows));
    for (int l = 0; l < c.num_layers; ++l) {
      KDN_RETURN_IF_ERROR(Attend(l, rows, /*decode=*/true, 0, table_stride, max_len));
      KDN_RETURN_IF_ERROR(Finish(l, rows));
    }
    const bf16* head = c.tie_word_embeddings ? embed.get() : lm_head.get();
    KDN_RETURN_IF_ERROR(NormGemm(x.get(), rows, final_norm.get(), head, c.vocab_size,
                                 logits.get(), CUDA_R_32F));
    return ArgmaxCuda(logits.get(), rows, c.vocab_size, sampled.get(), stream,
                      argmax_workspace.get());
  }

  // The captured graph of DecodeBody for `bucket` rows, captured on first use.
  Result<cudaGraphExec_t> DecodeGraph(int bucket) {
    auto it = decode_graphs.find(bucket);
    if (it != decode_graphs.end()) return it->second;
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    Status body = DecodeBody(bucket, 0, 0);
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
    if (!body.ok()) {
      if (graph != nullptr) (void)cudaGraphDestroy(graph);
      return body;
    }
    KDN_CUDA_RETURN_IF_ERROR(ended);
    cudaGraphExec_t exec = nullptr;
    const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    KDN_CUDA_RETURN_IF_ERROR(made);
    decode_graphs.emplace(bucket, exec);
    return exec;
  }

  Status Decode(std::span<CudaKvSequence* const> seqs, std::span<const int32_t> tokens,
                std::vector<float>* logits_out, std::vector<int32_t>* next_out,
                std::span<Sampler* const> samplers = {});

  Status CheckTokens(std::span<const int32_t> tokens) const {
    for (int32_t t : tokens) {
      if (t < 0 || t >= config.vocab_size) {
        return InvalidArgument("token id " + std::to_string(t) + " is outside the vocabulary");
      }
    }
    return Status::Ok();
  }
};

CudaEngine::CudaEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaEngine::~CudaEngine() = default;

Result<std::unique_ptr<CudaEngine>> CudaEngine::Create(const ModelConfig& config,
                                                     const ModelWeights& weights,
                                                     const CudaEngineOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->options = options;
  KDN_RETURN_IF_ERROR(impl->Setup());
  KDN_RETURN_IF_ERROR(impl->UploadWeights(weights));
  return std::unique_ptr<CudaEngine>(new CudaEngine(std::move(impl)));
}

Result<std::unique_ptr<CudaEngine>> CudaEngine::Materialize(const ModelConfig& config, uint64_t seed,
                                                          const CudaEngineOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->options = options;
  KDN_RETURN_IF_ERROR(impl->Setup());
  KDN_RETURN_IF_ERROR(impl->MaterializeWeights(seed));
  return std::unique_ptr<CudaEngine>(new CudaEngine(std::move(impl)));
}

const ModelConfig& CudaEngine::config() const { return impl_->config; }
int CudaEngine::free_blocks() const { return static_cast<int>(impl_->free_list.size()); }
int64_t CudaEngine::weight_bytes() const { return impl_->weight_bytes; }

Status CudaEngine::Reserve(CudaKvSequence& seq, int64_t tokens) {
  const int64_t need = (tokens + 15) / 16 - static_cast<int64_t>(seq.blocks.size());
  if (need <= 0) return Status::Ok();
  if (need > static_cast<int64_t>(impl_->free_list.size())) {
    return ResourceExhausted("KV pool: " + std::to_string(need) + " blocks needed, " +
                             std::to_string(impl_->free_list.size()) + " free");
  }
  for (int64_t i = 0; i < need; ++i) {
    seq.blocks.push_back(impl_->free_list.back());
    impl_->free_list.pop_back();
  }
  return Status::Ok();
}

void CudaEngine::Free(CudaKvSequence& seq) {
  impl_->free_list.insert(impl_->free_list.end(), seq.blocks.begin(), seq.blocks.end());
  seq.blocks.clear();
  seq.length = 0;
}

Status CudaEngine::Prefill(CudaKvSequence& seq, std::span<const int32_t> tokens,
                          const PrefillOptions& options, std::vector<float>* logits) {
  Impl& m = *impl_;
  const ModelConfig& c = m.config;
  const auto n = static_cast<int64_t>(tokens.size());
  if (n == 0) return InvalidArgument("prefill: no tokens");
  if (n > m.max_rows) {
    return InvalidArgument("prefill: " + std::to_string(n) + " tokens in one call; at most " +
                           std::to_string(m.max_rows) + " (CudaEngineOptions::max_prefill_tokens)");
  }
  const int64_t start = seq.length;
  if (start + n > c.max_context) {
    return InvalidArgument("prefill: " + std::to_string(start + n) +
                           " tokens exceed the model's context of " +
                           std::to_string(c.max_context));
  }
  KDN_RETURN_IF_ERROR(m.CheckTokens(tokens));
  KDN_RETURN_IF_ERROR(Reserve(seq, start + n));
  std::vector<int32_t> pos(n);
  std::vector<int64_t> slot(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = start + i;
    pos[i] = static_cast<int32_t>(p);
    slot[i] = int64_t{seq.blocks[p / 16]} * 16 + p % 16;
  }
  auto up = [&](void* dst, const void* src, size_t bytes) {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, m.stream);
  };
  KDN_CUDA_RETURN_IF_ERROR(up(m.ids.get(), tokens.data(), n * sizeof(int32_t)));
  KDN_CUDA_RETURN_IF_ERROR(up(m.positions.get(), pos.data(), n * sizeof(int32_t)));
  KDN_CUDA_RETURN_IF_ERROR(up(m.slots.get(), slot.data(), n * sizeof(int64_t)));
  if (m.flash != nullptr) {
    const AttentionSequence one{static_cast<int32_t>(n), start + n, seq.blocks.data(),
                                static_cast<int64_t>(seq.blocks.size())};
    KDN_RETURN_IF_ERROR(m.flash->Plan(&one, 1, /*graph=*/false, m.stream));
  } else {
    KDN_CUDA_RETURN_IF_ERROR(
        up(m.tables.get(), seq.blocks.data(), seq.blocks.size() * sizeof(int32_t)));
  }
  KDN_RETURN_IF_ERROR(m.Embed(n));
  for (int l = 0; l < c.num_layers; ++l) {
    KDN_RETURN_IF_ERROR(m.Attend(l, n, /*decode=*/false, start, 0, 0));
    KDN_RETURN_IF_ERROR(m.Finish(l, n));
    if (options.on_layer) {
      KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream));
      seq.length = start + n;  // the hook may read the layer's KV
      Status st = options.on_layer(l);
      seq.length = start;
      if (!st.ok()) return st;
    }
  }
  logits->clear();
  KDN_RETURN_IF_ERROR(options.all_logits ? m.Logits(0, n, logits) : m.Logits(n - 1, 1, logits));
  seq.length = start + n;
  return Status::Ok();
}

Status CudaEngine::DecodeStep(std::span<CudaKvSequence* const> seqs,
                             std::span<const int32_t> tokens, std::vector<float>* logits) {
  return impl_->Decode(seqs, tokens, logits, nullptr);
}

Status CudaEngine::DecodeGreedy(std::span<CudaKvSequence* const> seqs,
                               std::span<const int32_t> tokens, std::vector<int32_t>* next) {
  return impl_->Decode(seqs, tokens, nullptr, next);
}

Status CudaEngine::DecodeSample(std::span<CudaKvSequence* const> seqs,
                               std::span<const int32_t> tokens,
                               std::span<Sampler* const> samplers, std::vector<int32_t>* next) {
  if (samplers.size() != seqs.size()) {
    return InvalidArgument("decode: one sampler per sequence");
  }
  for (Sampler* s : samplers) {
    if (s == nullptr) return InvalidArgument("decode: a null sampler");
    KDN_RETURN_IF_ERROR(ValidateSamplingParams(s->params()));
  }
  return impl_->Decode(seqs, tokens, nullptr, next, samplers);
}

bool CudaEngine::uses_flash_attention() const { return impl_->flash != nullptr; }
bool CudaEngine::uses_cuda_graphs() const { return impl_->graphs(); }

Status CudaEngine::Impl::Decode(std::span<CudaKvSequence* const> seqs,
                               std::span<const int32_t> tokens, std::vector<float>* logits_out,
                               std::vector<int32_t>* next_out,
                               std::span<Sampler* const> samplers) {
  const ModelConfig& c = config;
  const auto batch = static_cast<int64_t>(seqs.size());
  if (batch == 0 || static_cast<int64_t>(tokens.size()) != batch) {
    return InvalidArgument("decode: one token per sequence, at least one sequence");
  }
  if (batch > options.max_batch) {
    return InvalidArgument("decode: batch of " + std::to_string(batch) + " beyond max_batch " +
                           std::to_string(options.max_batch));
  }
  KDN_RETURN_IF_ERROR(CheckTokens(tokens));
  for (CudaKvSequence* s : seqs) {
    if (s->length + 1 > c.max_context) return InvalidArgument("decode: the context is full");
  }
  // Blocks for the new tokens; on failure, give back what this step took.
  std::vector<size_t> had(batch);
  for (int64_t b = 0; b < batch; ++b) had[b] = seqs[b]->blocks.size();
  for (int64_t b = 0; b < batch; ++b) {
    CudaKvSequence& s = *seqs[b];
    const int64_t need = (s.length + 1 + 15) / 16 - static_cast<int64_t>(s.blocks.size());
    if (need > static_cast<int64_t>(free_list.size())) {
      for (int64_t u = 0; u < b; ++u) {
        CudaKvSequence& t = *seqs[u];
        free_list.insert(free_list.end(), t.blocks.begin() + had[u], t.blocks.end());
        t.blocks.resize(had[u]);
      }
      return ResourceExhausted("KV pool: " + std::to_string(need) + " blocks needed, " +
                               std::to_string(free_list.size()) + " free");
    }
    for (int64_t i = 0; i < need; ++i) {
      s.blocks.push_back(free_list.back());
      free_list.pop_back();
    }
  }
  const bool use_graph = graphs();
  const int64_t rows = use_graph ? DecodeBucket(static_cast<int>(batch), options.max_batch) : batch;
  int64_t max_len = 0, stride = 0;
  std::vector<AttentionSequence> attn_seqs(rows);
  for (int64_t b = 0; b < rows; ++b) {
    if (b < batch) {
      const CudaKvSequence& s = *seqs[b];
      ids_host.get()[b] = tokens[b];
      positions_host.get()[b] = static_cast<int32_t>(s.length);
      slots_host.get()[b] = int64_t{s.blocks[s.length / 16]} * 16 + s.length % 16;
      attn_seqs[b] = {1, s.length + 1, s.blocks.data(), static_cast<int64_t>(s.blocks.size())};
      max_len = std::max(max_len, s.length + 1);
      stride = std::max(stride, static_cast<int64_t>(s.blocks.size()));
    } else {  // padding: token 0 at position 0 of the scratch block
      ids_host.get()[b] = 0;
      positions_host.get()[b] = 0;
      slots_host.get()[b] = int64_t{scratch_block} * 16;
      attn_seqs[b] = {1, 1, &scratch_block, 1};
    }
  }
  auto up = [&](void* dst, const void* src, size_t bytes) {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream);
  };
  // From here on a failure gives back this step's blocks (below).
  auto inputs = [&]() -> Status {
    KDN_CUDA_RETURN_IF_ERROR(up(ids.get(), ids_host.get(), rows * sizeof(int32_t)));
    KDN_CUDA_RETURN_IF_ERROR(up(positions.get(), positions_host.get(), rows * sizeof(int32_t)));
    KDN_CUDA_RETURN_IF_ERROR(up(slots.get(), slots_host.get(), rows * sizeof(int64_t)));
    if (flash != nullptr) return flash->Plan(attn_seqs.data(), static_cast<int>(rows), use_graph, stream);
    std::vector<int32_t> lens(batch), table(batch * stride, 0);
    for (int64_t b = 0; b < batch; ++b) {
      lens[b] = static_cast<int32_t>(seqs[b]->length + 1);
      std::copy(seqs[b]->blocks.begin(), seqs[b]->blocks.end(), table.begin() + b * stride);
    }
    KDN_CUDA_RETURN_IF_ERROR(up(lengths.get(), lens.data(), batch * sizeof(int32_t)));
    // From pageable memory: the copies have read the vectors when they return.
    KDN_CUDA_RETURN_IF_ERROR(up(tables.get(), table.data(), table.size() * sizeof(int32_t)));
    return Status::Ok();
  };
  Status st = inputs();
  if (st.ok() && use_graph) {
    auto exec = DecodeGraph(static_cast<int>(rows));
    st = exec.ok() ? Status::Ok() : exec.status();
    if (st.ok()) {
      const cudaError_t launched = cudaGraphLaunch(*exec, stream);
      if (launched != cudaSuccess) st = Internal(std::string("cudaGraphLaunch: ") +
                                                 cudaGetErrorString(launched));
    }
  } else if (st.ok()) {
    st = DecodeBody(rows, stride, max_len);
  }
  // Sampled rows: their draws from their own streams (kept to restore on
  // failure), then the device sampler over the step's logits.
  std::vector<Sampler> saved;
  if (st.ok() && !samplers.empty()) {
    std::vector<DeviceSamplingRow> rows_params(batch);
    bool any = false;
    for (int64_t b = 0; b < batch; ++b) {
      saved.push_back(*samplers[b]);
      const SamplingParams& p = samplers[b]->params();
      const double u = samplers[b]->NextDraw();
      rows_params[b] = {u < 0.0 ? 0.0f : p.temperature, p.top_k, p.top_p, u < 0.0 ? 0.0 : u};
      any = any || u >= 0.0;
    }
    if (any && sampler == nullptr) {
      auto made = DeviceSampler::Create(options.max_batch, c.vocab_size);
      if (made.ok()) sampler = std::move(made).value();
      else st = made.status();
    }
    if (st.ok() && any) {
      st = sampler->Sample(logits.get(), rows_params.data(), static_cast<int>(batch), sampled.get(),
                           stream);
    }
  }
  if (st.ok() && logits_out != nullptr) {
    logits_out->resize(batch * c.vocab_size);
    const cudaError_t e = cudaMemcpyAsync(logits_out->data(), logits.get(),
                                          batch * c.vocab_size * sizeof(float),
                                          cudaMemcpyDeviceToHost, stream);
    if (e != cudaSuccess) st = Internal(std::string("logits copy: ") + cudaGetErrorString(e));
  }
  if (st.ok() && next_out != nullptr) {
    const cudaError_t e = cudaMemcpyAsync(sampled_host.get(), sampled.get(),
                                          batch * sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
    if (e != cudaSuccess) st = Internal(std::string("token copy: ") + cudaGetErrorString(e));
  }
  const cudaError_t synced = cudaStreamSynchronize(stream);
  if (st.ok() && synced != cudaSuccess) st = Internal(cudaGetErrorString(synced));
  if (!st.ok()) {
    for (int64_t b = 0; b < batch; ++b) {
      CudaKvSequence& t = *seqs[b];
      free_list.insert(free_list.end(), t.blocks.begin() + had[b], t.blocks.end());
      t.blocks.resize(had[b]);
    }
    for (size_t b = 0; b < saved.size(); ++b) *samplers[b] = saved[b];
    return st;
  }
  if (next_out != nullptr) next_out->assign(sampled_host.get(), sampled_host.get() + batch);
  for (CudaKvSequence* s : seqs) ++s->length;
  return Status::Ok();
}

Status CudaEngine::ReadKv(const CudaKvSequence& seq, int layer, int64_t first, int64_t count,
                         std::vector<float>* out) {
  Impl& m = *impl_;
  if (layer < 0 || layer >= m.config.num_layers || first < 0 || count < 0 ||
      first + count > seq.length) {
    return InvalidArgument("ReadKv: layer or positions outside the sequence");
  }
  const int64_t row = m.config.kv_dim();
  DeviceArray<bf16> buf;
  DeviceArray<int32_t> table;
  KDN_RETURN_IF_ERROR(buf.Allocate(2 * count * row));
  KDN_RETURN_IF_ERROR(table.Allocate(static_cast<int64_t>(seq.blocks.size())));
  KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(table.get(), seq.blocks.data(),
                                           seq.blocks.size() * sizeof(int32_t),
                                           cudaMemcpyHostToDevice, m.stream));
  KDN_RETURN_IF_ERROR(GatherKvCuda<bf16>(m.Layer(layer), table.get(), first, count, buf.get(),
                                         m.stream));
  std::vector<bf16> host(2 * count * row);
  KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host.data(), buf.get(), host.size() * sizeof(bf16),
                                           cudaMemcpyDeviceToHost, m.stream));
  KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream));
  out->resize(host.size());
  for (size_t i = 0; i < host.size(); ++i) (*out)[i] = __bfloat162float(host[i]);
  return Status::Ok();
}

}  // namespace kdn::engine::cuda
