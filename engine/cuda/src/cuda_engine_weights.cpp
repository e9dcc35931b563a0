// CudaEngine's weights on the device: a model's tensors uploaded as bf16
// (fused projections stacked row-wise), or weights generated on the device
// for a preset (cuda_engine_impl.h).
#include "cuda_engine_impl.h"

namespace kdn::engine::cuda {

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
