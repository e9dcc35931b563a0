#include "kdn/engine/gguf_weights.h"

#include <cstring>

#include "kdn/engine/quant.h"
#include "kdn/engine/tensor.h"

namespace kdn::engine {

namespace {

using model::GgmlType;

// Llama's Q or K rows (`heads` heads of `head_dim` rows of `row_bytes`
// bytes, in any format) from llama.cpp's interleaved order back to Hugging
// Face's: GGUF row h * head_dim + 2j + i is row h * head_dim + i * head_dim / 2 + j.
void UnpermuteRows(int64_t heads, int64_t head_dim, int64_t row_bytes, uint8_t* data) {
  std::vector<uint8_t> in(data, data + heads * head_dim * row_bytes);
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t j = 0; j < half; ++j) {
      for (int64_t i = 0; i < 2; ++i) {
        std::memcpy(data + (h * head_dim + i * half + j) * row_bytes,
                    in.data() + (h * head_dim + 2 * j + i) * row_bytes,
                    static_cast<size_t>(row_bytes));
      }
    }
  }
}

}  // namespace

bool CanDequantize(uint32_t type) {
  return FindQuantTraits(static_cast<GgmlType>(type)) != nullptr;
}

Status DequantizeGguf(uint32_t type, const uint8_t* src, int64_t n, float* dst) {
  const model::GgmlTypeInfo* info = model::FindGgmlType(type);
  if (info == nullptr || !CanDequantize(type)) {
    return Unimplemented(std::string("ggml type ") +
                         (info != nullptr ? info->name : std::to_string(type)) +
                         " is not read (kdn reads F32, F16, BF16, Q8_0, Q4_0, Q4_1)");
  }
  if (n < 0 || n % info->block_elements != 0) {
    return InvalidArgument(std::to_string(n) + " values are not whole blocks of " + info->name);
  }
  FindQuantTraits(static_cast<GgmlType>(type))->to_float(src, n, dst);
  return Status::Ok();
}

std::string GgufTensorName(const std::string& hf) {
  static const std::pair<const char*, const char*> kWhole[] = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
  };
  for (const auto& [from, to] : kWhole) {
    if (hf == from) return to;
  }
  static const std::string kLayer = "model.layers.";
  if (hf.rfind(kLayer, 0) != 0) return {};
  const size_t dot = hf.find('.', kLayer.size());
  if (dot == std::string::npos) return {};
  const std::string layer = hf.substr(kLayer.size(), dot - kLayer.size());
  const std::string rest = hf.substr(dot + 1);
  static const std::pair<const char*, const char*> kParts[] = {
      {"input_layernorm.", "attn_norm."},    {"self_attn.q_proj.", "attn_q."},
      {"self_attn.k_proj.", "attn_k."},      {"self_attn.v_proj.", "attn_v."},
      {"self_attn.o_proj.", "attn_output."}, {"post_attention_layernorm.", "ffn_norm."},
      {"mlp.gate_proj.", "ffn_gate."},       {"mlp.up_proj.", "ffn_up."},
      {"mlp.down_proj.", "ffn_down."},
  };
  for (const auto& [from, to] : kParts) {
    const std::string f = from;
    if (rest.rfind(f, 0) == 0) return "blk." + layer + "." + to + rest.substr(f.size());
  }
  return {};
}

Result<ModelWeights> LoadGgufWeights(const model::GgufFile& file, const model::ModelConfig& c,
                                     WeightsDType dtype) {
  ModelWeights weights;
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    const std::string name = GgufTensorName(spec.name);
    const model::GgufTensor* t = name.empty() ? nullptr : file.FindTensor(name);
    if (t == nullptr) {
      return NotFound(file.Where("tensor \"" + name + "\" (" + spec.name + ") is missing"));
    }
    // ggml lists dimensions innermost first.
    const std::vector<int64_t> shape(t->dims.rbegin(), t->dims.rend());
    if (shape != spec.shape) {
      return InvalidArgument(file.Where("tensor \"" + name + "\" has shape " +
                                        ShapeToString(shape) + ", the metadata implies " +
                                        ShapeToString(spec.shape)));
    }
    HostTensor h;
    h.shape = spec.shape;
    const auto type = static_cast<GgmlType>(t->type);
    const QuantTraits* traits = FindQuantTraits(type);
    uint8_t* rows = nullptr;
    int64_t row_bytes = 0;
    const int64_t cols = shape.size() > 1 ? shape[1] : 1;
    if (dtype == WeightsDType::kNative && shape.size() == 2 && type != GgmlType::kF32 &&
        traits != nullptr) {
      h.type = type;
      h.bytes.assign(t->data, t->data + traits->RowBytes(t->numel()));
      rows = h.bytes.data();
      row_bytes = traits->RowBytes(cols);
    } else {
      h.data.resize(static_cast<size_t>(t->numel()));
      Status s = DequantizeGguf(t->type, t->data, t->numel(), h.data.data());
      if (!s.ok()) return Status(s.code(), file.Where("tensor \"" + name + "\": " + s.message()));
      rows = reinterpret_cast<uint8_t*>(h.data.data());
      row_bytes = cols * static_cast<int64_t>(sizeof(float));
    }
    const bool q = name.find(".attn_q.") != std::string::npos;
    if (q || name.find(".attn_k.") != std::string::npos) {
      UnpermuteRows(q ? c.num_heads : c.num_kv_heads, c.head_dim, row_bytes, rows);
    }
    weights.emplace(spec.name, std::move(h));
  }
  return weights;
}

}  // namespace kdn::engine
