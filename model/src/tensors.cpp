#include "kdn/model/tensors.h"

namespace kdn::model {

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c) {
  const int64_t d = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), ff = c.intermediate_size;
  std::vector<TensorSpec> specs;
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, d}});
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    specs.push_back({p + "input_layernorm.weight", {d}});
    specs.push_back({p + "self_attn.q_proj.weight", {q, d}});
    specs.push_back({p + "self_attn.k_proj.weight", {kv, d}});
    specs.push_back({p + "self_attn.v_proj.weight", {kv, d}});
    if (c.qkv_bias) {
      specs.push_back({p + "self_attn.q_proj.bias", {q}});
      specs.push_back({p + "self_attn.k_proj.bias", {kv}});
      specs.push_back({p + "self_attn.v_proj.bias", {kv}});
    }
    specs.push_back({p + "self_attn.o_proj.weight", {d, q}});
    if (c.o_bias) specs.push_back({p + "self_attn.o_proj.bias", {d}});
    specs.push_back({p + "post_attention_layernorm.weight", {d}});
    specs.push_back({p + "mlp.gate_proj.weight", {ff, d}});
    specs.push_back({p + "mlp.up_proj.weight", {ff, d}});
    specs.push_back({p + "mlp.down_proj.weight", {d, ff}});
  }
  specs.push_back({"model.norm.weight", {d}});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, d}});
  return specs;
}

std::string ShapeToString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace kdn::model
