// CudaEngine's setup: its stream, cuBLAS, device KV cache and activation
// buffers, and its weights on the device: a model's tensors uploaded as
// bf16 (fused projections stacked row-wise), or weights generated on the
// device for a preset (cuda_engine_impl.h).
#include "cuda_engine_impl.h"

namespace kdn::engine::cuda {

Status CudaEngine::Impl::Setup() {
  KDN_RETURN_IF_ERROR(UseDevice(options.device));
  KDN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  KDN_CUBLAS_RETURN_IF_ERROR(cublasCreate(&blas));
  KDN_CUBLAS_RETURN_IF_ERROR(cublasSetStream(blas, stream));
  // A workspace of our own, so that cuBLAS allocates nothing while a decode
  // graph is captured.
  KDN_RETURN_IF_ERROR(blas_workspace.Allocate(kCublasWorkspaceBytes));
  KDN_CUBLAS_RETURN_IF_ERROR(cublasSetWorkspace(blas, blas_workspace.get(), kCublasWorkspaceBytes));
  const ModelConfig& c = config;
  const std::vector<float> freq = RopeInvFreq(c);
  rope = RopeParamsFor(c);
  KDN_RETURN_IF_ERROR(inv_freq.Allocate(static_cast<int64_t>(freq.size())));
  KDN_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(inv_freq.get(), freq.data(), freq.size() * sizeof(float), cudaMemcpyHostToDevice));
  // One block more than asked for: the scratch block of graph padding.
  const int num_blocks = static_cast<int>((options.kv_tokens + 15) / 16) + 1;
  kv = std::make_unique<DeviceKvCache>(options.device, c.num_layers, c.num_kv_heads, c.head_dim,
                                       num_blocks);
  KDN_RETURN_IF_ERROR(kv->Allocate(options.kv_pool_memory));
  scratch = kv->NewSequence();
  KDN_RETURN_IF_ERROR(kv->Reserve(scratch, 1));
  scratch_block = scratch.blocks()[0];
  max_rows = std::max<int64_t>(options.max_prefill_tokens, options.max_batch);
  const int64_t R = max_rows;
  const AttentionShape shape = Shape();
  if (options.flash_attention && FlashAttention::Supports(shape)) {
    // Every block once, and the scratch block once more per padding row.
    KDN_ASSIGN_OR_RETURN(
        flash, FlashAttention::Create(shape, options.max_batch, R, num_blocks + options.max_batch));
    if (flash->hopper()) {
      const int64_t context_blocks = (c.max_context + kKvBlockTokens - 1) / kKvBlockTokens;
      KDN_ASSIGN_OR_RETURN(
          flash_shared,
          FlashAttention::Create(shape, kRowBands, R,
                                 kRowBands * std::min<int64_t>(context_blocks, num_blocks)));
    }
  } else {
    KDN_RETURN_IF_ERROR(q.Allocate(R * c.q_dim()));
  }
  KDN_RETURN_IF_ERROR(x.Allocate(R * c.hidden_size));
  KDN_RETURN_IF_ERROR(h.Allocate(R * c.hidden_size));
  KDN_RETURN_IF_ERROR(qkv.Allocate(R * qkv_dim()));
  KDN_RETURN_IF_ERROR(attn.Allocate(R * c.q_dim()));
  KDN_RETURN_IF_ERROR(gate_up.Allocate(R * 2 * int64_t{c.intermediate_size}));
  KDN_RETURN_IF_ERROR(act.Allocate(R * c.intermediate_size));
  KDN_RETURN_IF_ERROR(
      logits.Allocate(std::max<int64_t>(kLogitRows, options.max_batch) * c.vocab_size));
  KDN_RETURN_IF_ERROR(ids.Allocate(R));
  KDN_RETURN_IF_ERROR(positions.Allocate(R));
  KDN_RETURN_IF_ERROR(lengths.Allocate(options.max_batch));
  KDN_RETURN_IF_ERROR(slots.Allocate(R));
  KDN_RETURN_IF_ERROR(bad_id.Allocate(1));
  KDN_RETURN_IF_ERROR(sampled.Allocate(options.max_batch));
  KDN_RETURN_IF_ERROR(
      argmax_workspace.Allocate(static_cast<int64_t>(ArgmaxWorkspaceBytes(options.max_batch))));
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

// Uploads `n` floats as bf16 into `dst` (allocated here).
Status CudaEngine::Impl::Upload(const float* src, int64_t n, DeviceArray<bf16>* dst) {
  std::vector<bf16> host(n);
  for (int64_t i = 0; i < n; ++i) host[i] = __float2bfloat16_rn(src[i]);
  KDN_RETURN_IF_ERROR(dst->Allocate(n));
  KDN_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(dst->get(), host.data(), n * sizeof(bf16), cudaMemcpyHostToDevice));
  weight_bytes += n * static_cast<int64_t>(sizeof(bf16));
  return Status::Ok();
}

Status CudaEngine::Impl::UploadTensor(const ModelWeights& w, const std::string& name,
                                      DeviceArray<bf16>* dst) {
  auto it = w.find(name);
  if (it == w.end()) return InvalidArgument("CudaEngine: tensor " + name + " is missing");
  return Upload(it->second.data.data(), it->second.numel(), dst);
}

// Tensors stacked row-wise into one (a fused projection's weight or bias).
Status CudaEngine::Impl::UploadConcat(const ModelWeights& w,
                                      std::initializer_list<std::string> names,
                                      DeviceArray<bf16>* dst) {
  std::vector<float> fused;
  for (const std::string& name : names) {
    auto it = w.find(name);
    if (it == w.end()) return InvalidArgument("CudaEngine: tensor " + name + " is missing");
    fused.insert(fused.end(), it->second.data.begin(), it->second.data.end());
  }
  return Upload(fused.data(), static_cast<int64_t>(fused.size()), dst);
}

Status CudaEngine::Impl::UploadWeights(const ModelWeights& w) {
  KDN_RETURN_IF_ERROR(UploadTensor(w, "model.embed_tokens.weight", &embed));
  KDN_RETURN_IF_ERROR(UploadTensor(w, "model.norm.weight", &final_norm));
  if (!config.tie_word_embeddings) KDN_RETURN_IF_ERROR(UploadTensor(w, "lm_head.weight", &lm_head));
  layers.resize(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights& L = layers[l];
    KDN_RETURN_IF_ERROR(UploadTensor(w, p + "input_layernorm.weight", &L.input_norm));
    KDN_RETURN_IF_ERROR(UploadTensor(w, p + "post_attention_layernorm.weight", &L.post_norm));
    KDN_RETURN_IF_ERROR(UploadConcat(w,
                                     {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                      p + "self_attn.v_proj.weight"},
                                     &L.qkv));
    KDN_RETURN_IF_ERROR(UploadTensor(w, p + "self_attn.o_proj.weight", &L.o));
    if (config.qkv_bias) {
      KDN_RETURN_IF_ERROR(UploadConcat(
          w,
          {p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"},
          &L.qkv_bias));
    }
    if (config.o_bias) KDN_RETURN_IF_ERROR(UploadTensor(w, p + "self_attn.o_proj.bias", &L.o_bias));
    KDN_RETURN_IF_ERROR(
        UploadConcat(w, {p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"}, &L.gate_up));
    KDN_RETURN_IF_ERROR(UploadTensor(w, p + "mlp.down_proj.weight", &L.down));
  }
  return Status::Ok();
}

// Device-side random weights: each tensor its own hash stream.
Status CudaEngine::Impl::MaterializeWeights(uint64_t seed) {
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

}  // namespace kdn::engine::cuda
