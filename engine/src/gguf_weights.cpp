// Built with -ffp-contract=off (engine/CMakeLists.txt): Q4_1's d * q + m must
// round twice, as the gguf package's numpy does, not once in a fused
// multiply-add.
#include "kdn/engine/gguf_weights.h"

#include <cstring>

#include "kdn/engine/tensor.h"

namespace kdn::engine {

namespace {

using model::GgmlType;

constexpr int64_t kQBlock = 32;  // values in a Q8_0, Q4_0 or Q4_1 block

float HalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToF32(h);
}

void DequantizeQ8_0(const uint8_t* src, int64_t blocks, float* dst) {
  for (int64_t b = 0; b < blocks; ++b, src += 34, dst += kQBlock) {
    const float d = HalfAt(src);
    for (int i = 0; i < kQBlock; ++i)
      dst[i] = static_cast<float>(static_cast<int8_t>(src[2 + i])) * d;
  }
}

// Q4_0 and Q4_1: byte j of a block holds value j in its low nibble and value
// j + 16 in its high one.
void DequantizeQ4_0(const uint8_t* src, int64_t blocks, float* dst) {
  for (int64_t b = 0; b < blocks; ++b, src += 18, dst += kQBlock) {
    const float d = HalfAt(src);
    const uint8_t* qs = src + 2;
    for (int j = 0; j < kQBlock / 2; ++j) {
      dst[j] = d * static_cast<float>((qs[j] & 0x0F) - 8);
      dst[j + kQBlock / 2] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  }
}

void DequantizeQ4_1(const uint8_t* src, int64_t blocks, float* dst) {
  for (int64_t b = 0; b < blocks; ++b, src += 20, dst += kQBlock) {
    const float d = HalfAt(src), m = HalfAt(src + 2);
    const uint8_t* qs = src + 4;
    for (int j = 0; j < kQBlock / 2; ++j) {
      dst[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
      dst[j + kQBlock / 2] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
}

// Llama's Q or K rows (`heads` heads of `head_dim` rows of `cols`) from
// llama.cpp's interleaved order back to Hugging Face's: GGUF row
// h * head_dim + 2j + i is row h * head_dim + i * head_dim / 2 + j.
void UnpermuteRows(int64_t heads, int64_t head_dim, int64_t cols, std::vector<float>* data) {
  std::vector<float> out(data->size());
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t j = 0; j < half; ++j) {
      for (int64_t i = 0; i < 2; ++i) {
        const float* from = data->data() + (h * head_dim + 2 * j + i) * cols;
        std::memcpy(out.data() + (h * head_dim + i * half + j) * cols, from,
                    static_cast<size_t>(cols) * sizeof(float));
      }
    }
  }
  *data = std::move(out);
}

}  // namespace

bool CanDequantize(uint32_t type) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ8_0:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1: return true;
    default: return false;
  }
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
  const int64_t blocks = n / info->block_elements;
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32: std::memcpy(dst, src, static_cast<size_t>(n) * 4); break;
    case GgmlType::kF16: ToFloat(DType::kF16, src, static_cast<size_t>(n), dst); break;
    case GgmlType::kBF16: ToFloat(DType::kBF16, src, static_cast<size_t>(n), dst); break;
    case GgmlType::kQ8_0: DequantizeQ8_0(src, blocks, dst); break;
    case GgmlType::kQ4_0: DequantizeQ4_0(src, blocks, dst); break;
    case GgmlType::kQ4_1: DequantizeQ4_1(src, blocks, dst); break;
    default: break;  // refused above
  }
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

Result<ModelWeights> LoadGgufWeights(const model::GgufFile& file, const model::ModelConfig& c) {
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
    h.data.resize(static_cast<size_t>(t->numel()));
    Status s = DequantizeGguf(t->type, t->data, t->numel(), h.data.data());
    if (!s.ok()) return Status(s.code(), file.Where("tensor \"" + name + "\": " + s.message()));
    const bool q = name.find(".attn_q.") != std::string::npos;
    if (q || name.find(".attn_k.") != std::string::npos) {
      const int64_t cols = shape.size() > 1 ? shape[1] : 1;
      UnpermuteRows(q ? c.num_heads : c.num_kv_heads, c.head_dim, cols, &h.data);
    }
    weights.emplace(spec.name, std::move(h));
  }
  return weights;
}

}  // namespace kdn::engine
