#pragma once
// CudaEngine's private parts, shared by cuda_engine.cpp (load, prefill,
// decode) and cuda_row_pass.cpp (the per-layer calls of blend); the buffers
// and the device KV cache they build on are in device_kv_cache.h.

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "kdn/engine/cpu_ops.h"
#include "kdn/engine/cuda/activation.cuh"
#include "kdn/engine/cuda/attention.cuh"
#include "kdn/common/cuda_status.h"
#include "kdn/engine/cuda/cuda_engine.h"
#include "kdn/engine/cuda/device_sampler.h"
#include "kdn/engine/cuda/embedding.cuh"
#include "kdn/engine/cuda/flash_attention.h"
#include "kdn/engine/cuda/gemv.cuh"
#include "kdn/engine/cuda/init.cuh"
#include "kdn/engine/cuda/paged_kv.cuh"
#include "kdn/engine/cuda/rmsnorm.cuh"
#include "kdn/engine/cuda/rope.cuh"
#include "kdn/engine/cuda/sampling.cuh"
#include "device_bias.h"
#include "device_kv_cache.h"

namespace kdn::engine::cuda {

using model::ModelConfig;
using model::SamplingParams;

namespace internal {

using bf16 = __nv_bfloat16;

constexpr int kMaxDecodeSplits = 64;
constexpr int64_t kLogitRows = 1024;  // all_logits is computed this many rows at a time
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

// The batch sizes decode graphs are captured for: a batch runs in the
// smallest bucket that holds it, padded with rows that touch only a scratch
// block.
inline int DecodeBucket(int batch, int max_batch) {
  int b = 1;
  while (b < batch && b < 8) b *= 2;
  if (b < batch) b = (batch + 7) / 8 * 8;
  if (b > 64) b = (batch + 31) / 32 * 32;
  return std::min(b, max_batch);
}

#define KDN_CUBLAS_RETURN_IF_ERROR(expr)                                                         \
  do {                                                                                           \
    const cublasStatus_t _kdn_cublas_st = (expr);                                                \
    if (_kdn_cublas_st != CUBLAS_STATUS_SUCCESS) {                                               \
      return Internal(std::string(#expr) + " failed: " + cublasGetStatusString(_kdn_cublas_st) + \
                      " at " + __FILE__ + ":" + std::to_string(__LINE__));                       \
    }                                                                                            \
  } while (0)

struct LayerWeights {
  DeviceArray<bf16> input_norm, post_norm;
  DeviceArray<bf16> qkv;               // [q_dim + 2 * kv_dim][hidden]: q rows, k rows, v rows
  DeviceArray<bf16> o;                 // [hidden][q_dim]
  DeviceArray<bf16> qkv_bias, o_bias;  // empty when absent
  DeviceArray<bf16> gate_up;           // [2 * ffn][hidden]: gate rows, then up rows
  DeviceArray<bf16> down;              // [hidden][ffn]
};

// The most requests a row pass's scattered rows are split into (bands of
// consecutive rows; cuda_row_pass.cpp).
inline constexpr int kRowBands = 8;

}  // namespace internal

using namespace internal;  // NOLINT: the engine's own private names

struct CudaEngine::Impl {
  ModelConfig config;
  CudaEngineOptions options;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  int64_t weight_bytes = 0;

  DeviceArray<bf16> embed, lm_head, final_norm;  // lm_head empty when tied
  std::vector<LayerWeights> layers;
  DeviceArray<float> inv_freq;
  RopeParams rope;  // yarn's scale, dynamic growth (rope.h)

  // The KV pool, and the one block that decode graphs' padding rows write
  // (held by `scratch` for the engine's life). Declared before anything
  // that holds its blocks.
  std::unique_ptr<DeviceKvCache> kv;
  KvSequence scratch;
  int32_t scratch_block = -1;

  // Activations, sized for max(max_prefill_tokens, max_batch) rows.
  int64_t max_rows = 0;
  // A prefill's query hook (PrefillOptions::on_queries) and its rows' host
  // positions, while that prefill runs; null otherwise.
  const QueryHook* query_hook = nullptr;
  const int32_t* query_positions = nullptr;
  std::vector<__nv_bfloat16> query_host;  // staging for the hook's queries
  std::vector<float> query_f32;
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

  std::unique_ptr<FlashAttention> flash;  // null: reference attention
  // The biases of the prefill or decode step under way (DeviceBias); `any`
  // false outside one, or when none of its sequences has one.
  DeviceBias call_bias;
  // A row pass's keys that all rows of a band share, without a mask, on the
  // Hopper kernels (a plan of its own beside flash's); null off Hopper.
  std::unique_ptr<FlashAttention> flash_shared;
  std::unique_ptr<DeviceSampler> sampler;        // made at the first DecodeSample
  std::map<int, cudaGraphExec_t> decode_graphs;  // by bucket

  ~Impl() {
    for (auto& [bucket, exec] : decode_graphs) (void)cudaGraphExecDestroy(exec);
    if (blas != nullptr) (void)cublasDestroy(blas);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }

  int64_t qkv_dim() const { return config.q_dim() + 2 * config.kv_dim(); }
  bool graphs() const { return flash != nullptr && options.cuda_graphs; }

  PagedKvLayer<bf16> Layer(int l) { return kv->Layer(l); }
  PagedKvLayer<const bf16> ConstLayer(int l) { return kv->ConstLayer(l); }

  // out[rows][out_dim] (= or +=) in[rows][in_dim] . w[out_dim][in_dim]^T.
  // A few rows (a small decode batch) stream the weights through GemvCuda;
  // everything else is cuBLAS.
  Status Gemm(const bf16* in, int64_t rows, int in_dim, const bf16* w, int out_dim, void* out,
              cudaDataType_t out_type, bool accumulate) {
    if (rows <= kGemvMaxRows && GemvFits(in, static_cast<int>(rows), in_dim, w)) {
      const int r = static_cast<int>(rows);
      return out_type == CUDA_R_32F ? GemvCuda<float>(in, r, in_dim, w, out_dim,
                                                      static_cast<float*>(out), accumulate, stream)
                                    : GemvCuda<bf16>(in, r, in_dim, w, out_dim,
                                                     static_cast<bf16*>(out), accumulate, stream);
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

  Status CublasGemm(const bf16* in, int64_t rows, int in_dim, const bf16* w, int out_dim, void* out,
                    cudaDataType_t out_type, bool accumulate) {
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    KDN_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, out_dim,
                                            static_cast<int>(rows), in_dim, &alpha, w, CUDA_R_16BF,
                                            in_dim, in, CUDA_R_16BF, in_dim, &beta, out, out_type,
                                            out_dim, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return Status::Ok();
  }

  // The stream, cuBLAS, RoPE's frequencies, the device KV cache and the
  // activation buffers for options (cuda_engine_setup.cpp).
  Status Setup();

  // The attention shape of layer `l` (its sliding window, if any), or with
  // l = -1 the model's (any layer's window).
  AttentionShape Shape(int l = -1) const {
    return {config.num_heads, config.num_kv_heads, config.head_dim,
            1.0f / std::sqrt(static_cast<float>(config.head_dim)),
            l < 0 ? config.sliding_window : config.LayerWindow(l)};
  }

  // Weights (cuda_engine_setup.cpp). Upload: `n` floats as bf16 into
  // `dst` (allocated here); UploadTensor: a named tensor of `w`;
  // UploadConcat: tensors stacked row-wise into one (a fused projection's
  // weight or bias); UploadWeights: every tensor of the model;
  // MaterializeWeights: device-side random weights, each tensor its own
  // hash stream.
  Status Upload(const float* src, int64_t n, DeviceArray<bf16>* dst);
  Status UploadTensor(const ModelWeights& w, const std::string& name, DeviceArray<bf16>* dst);
  Status UploadConcat(const ModelWeights& w, std::initializer_list<std::string> names,
                      DeviceArray<bf16>* dst);
  Status UploadWeights(const ModelWeights& w);
  Status MaterializeWeights(uint64_t seed);

  // Whether a call takes the reference kernels: no FlashAttention, or a
  // bias (call_bias) to apply. Their queries are contiguous in `q`, which
  // is allocated here the first time a bias needs it.
  Result<bool> UsesReference(const DeviceBias& bias) {
    if (flash != nullptr && !bias.any) return false;
    if (q.size() < max_rows * config.q_dim())
      KDN_RETURN_IF_ERROR(q.Allocate(max_rows * config.q_dim()));
    return true;
  }

  // The layer's attention for `rows` rows of x: norm, the fused QKV product,
  // RoPE with the new K and V written to their slots (on the device), then
  // attention over the cache into attn. `decode`: one row per sequence of a
  // decode batch (lengths/tables on the device for the reference kernel);
  // otherwise the rows are one sequence's, from position `start`. With a
  // bias staged (call_bias), the reference kernels apply it.
  Status Attend(int l, int64_t rows, bool decode, int64_t start, int64_t table_stride,
                int64_t max_len) {
    const ModelConfig& c = config;
    LayerWeights& L = layers[l];
    const int qkv_out = static_cast<int>(qkv_dim());
    KDN_RETURN_IF_ERROR(
        NormGemm(x.get(), rows, L.input_norm.get(), L.qkv.get(), qkv_out, qkv.get(), CUDA_R_16BF));
    if (c.qkv_bias) {
      KDN_RETURN_IF_ERROR(AddBiasCuda<bf16>(qkv.get(), L.qkv_bias.get(), rows, qkv_out, stream));
    }
    if (query_hook != nullptr && !decode) KDN_RETURN_IF_ERROR(ShowQueries(l, rows));
    KDN_RETURN_IF_ERROR(RopeQkvToCacheCuda<bf16>(qkv.get(), rows, c.num_heads, c.num_kv_heads,
                                                 c.head_dim, positions.get(), inv_freq.get(),
                                                 slots.get(), Layer(l), stream, rope));
    if (flash != nullptr && !call_bias.any) {
      return flash->Run(qkv.get(), qkv_out, ConstLayer(l), attn.get(), stream);
    }
    // The reference kernels take contiguous queries.
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(q.get(), c.q_dim() * sizeof(bf16), qkv.get(),
                                               qkv_out * sizeof(bf16), c.q_dim() * sizeof(bf16),
                                               rows, cudaMemcpyDeviceToDevice, stream));
    const AttentionShape shape = Shape(l);
    const ScoreBiasCuda bias = call_bias.Layer(l, c.num_heads);
    if (decode) {
      // Split keys need the workspace, which only an engine without
      // FlashAttention has.
      const int splits = workspace.get() != nullptr ? kMaxDecodeSplits : 1;
      return DecodeAttentionCuda<bf16>(q.get(), ConstLayer(l), tables.get(), table_stride,
                                       lengths.get(), rows, max_len, shape, splits, workspace.get(),
                                       attn.get(), stream, bias);
    }
    return PrefillAttentionCuda<bf16>(q.get(), rows, start, ConstLayer(l), tables.get(), shape,
                                      attn.get(), stream, bias);
  }

  // Shows the query hook layer l's queries before RoPE (the first q_dim
  // columns of qkv, one row per token), in f32 on the host, as the CPU
  // engine shows its own: the same hook serves both.
  Status ShowQueries(int l, int64_t rows) {
    const int64_t qd = config.q_dim();
    query_host.resize(static_cast<size_t>(rows * qd));
    query_f32.resize(query_host.size());
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(query_host.data(), qd * sizeof(bf16), qkv.get(),
                                               qkv_dim() * sizeof(bf16), qd * sizeof(bf16), rows,
                                               cudaMemcpyDeviceToHost, stream));
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    ToFloat(DType::kBF16, query_host.data(), query_host.size(), query_f32.data());
    (*query_hook)(l, query_f32.data(), rows, query_positions);
    return Status::Ok();
  }

  // After attention (in attn): output projection into the residual, then the MLP.
  Status Finish(int l, int64_t rows) {
    const ModelConfig& c = config;
    LayerWeights& L = layers[l];
    KDN_RETURN_IF_ERROR(
        Gemm(attn.get(), rows, c.q_dim(), L.o.get(), c.hidden_size, x.get(), CUDA_R_16BF, true));
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
      KDN_RETURN_IF_ERROR(
          SiluMulCuda<bf16>(gate_up.get(), rows, c.intermediate_size, act.get(), stream));
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
    KDN_RETURN_IF_ERROR(
        NormGemm(x.get(), rows, final_norm.get(), head, c.vocab_size, logits.get(), CUDA_R_32F));
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

  Status PrefillBody(KvSequence& seq, std::span<const int32_t> tokens, int64_t start,
                     const PrefillOptions& options, std::vector<float>* logits);
  Status Decode(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
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

}  // namespace kdn::engine::cuda
