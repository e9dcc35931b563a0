#include "kdn/engine/presets.h"

#include <cmath>
#include <fstream>
#include <numbers>

#include "kdn/engine/safetensors.h"
#include "kdn/text/tokenizer.h"

namespace kdn::engine {

using model::Architecture;
using model::ModelConfig;

namespace {

ModelConfig Shape(Architecture arch, int vocab, int hidden, int inter, int layers, int heads,
                  int kv_heads, int head_dim, double theta, bool tied, int64_t max_ctx) {
  ModelConfig c;
  c.architecture = arch;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.rope_theta = theta;
  c.tie_word_embeddings = tied;
  c.max_context = max_ctx;
  c.rms_norm_eps = 1e-5;
  c.qkv_bias = arch == Architecture::kQwen2;
  // The byte-level tokenizer's specials (real-model shapes keep them too: their
  // vocabularies are larger, and the generated weights give every id a row).
  c.bos_token_id = 256;
  c.eos_token_id = 257;
  return c;
}

std::vector<Preset> MakePresets() {
  std::vector<Preset> p;
  {
    // Llama with GQA, tied embeddings and llama3 RoPE scaling whose three
    // frequency bands all occur (wavelengths 6..~6000 vs original 128).
    ModelConfig c = Shape(Architecture::kLlama, 258, 64, 176, 2, 4, 2, 16, 10000.0, true, 2048);
    c.rope_scaling = {model::RopeType::kLlama3, 4.0, 1.0, 4.0, 128};
    p.push_back({"tiny", "2-layer Llama (GQA, tied, llama3 RoPE) for unit tests", c, DType::kBF16});
  }
  p.push_back({"tiny-qwen2", "2-layer Qwen2 (QKV bias, untied) for unit tests",
               Shape(Architecture::kQwen2, 258, 64, 160, 2, 4, 2, 16, 1000000.0, false, 2048),
               DType::kF32});
  p.push_back({"tiny-mistral", "2-layer Mistral (GQA 4:1, untied) for unit tests",
               Shape(Architecture::kMistral, 258, 64, 192, 2, 8, 2, 8, 1000000.0, false, 2048),
               DType::kF16});
  p.push_back({"small", "16-layer Llama, ~46M parameters, for CPU benchmarks and blend",
               Shape(Architecture::kLlama, 258, 512, 1408, 16, 8, 4, 64, 10000.0, false, 8192),
               DType::kBF16});
  {
    ModelConfig c =
        Shape(Architecture::kLlama, 128256, 4096, 14336, 32, 32, 8, 128, 500000.0, false, 131072);
    c.rope_scaling = {model::RopeType::kLlama3, 8.0, 1.0, 4.0, 8192};
    p.push_back({"llama3-8b", "the shape of Llama-3.1-8B (16 GB in bf16)", c, DType::kBF16});
  }
  p.push_back(
      {"qwen2.5-7b", "the shape of Qwen2.5-7B (15 GB in bf16)",
       Shape(Architecture::kQwen2, 152064, 3584, 18944, 28, 28, 4, 128, 1000000.0, false, 32768),
       DType::kBF16});
  p.push_back(
      {"mistral-7b", "the shape of Mistral-7B-v0.3 (14 GB in bf16)",
       Shape(Architecture::kMistral, 32768, 4096, 14336, 32, 32, 8, 128, 1000000.0, false, 32768),
       DType::kBF16});
  return p;
}

uint64_t Mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

const std::vector<Preset>& Presets() {
  static const std::vector<Preset> presets = MakePresets();
  return presets;
}

Result<Preset> FindPreset(const std::string& name) {
  std::string known;
  for (const Preset& p : Presets()) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  return NotFound("no preset \"" + name + "\" (known: " + known + ")");
}

void FillTensor(const ModelConfig& config, const TensorSpec& spec, uint64_t seed, int64_t offset,
                int64_t n, float* out) {
  // Scales chosen so activations stay O(1) through the layers and the logits
  // are spread widely enough that greedy choices are stable across backends.
  const int64_t fan_in = spec.shape.back();
  float mean = 0.0f, stddev = 1.0f / std::sqrt(static_cast<float>(fan_in));
  if (spec.name == "model.embed_tokens.weight") {
    stddev = 1.0f;
  } else if (spec.name == "lm_head.weight") {
    stddev = 3.0f / std::sqrt(static_cast<float>(config.hidden_size));
  } else if (EndsWith(spec.name, "norm.weight")) {
    mean = 1.0f;
    stddev = 0.1f;
  } else if (EndsWith(spec.name, ".bias")) {
    stddev = 0.2f;
  }
  // Counter-based: element i depends only on (seed, name, i).
  const uint64_t key = Mix(seed ^ Mix(Fnv1a(spec.name)));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t r = Mix(key ^ static_cast<uint64_t>(offset + i) * 0xd1342543de82ef95ull);
    const double u1 = (static_cast<double>(r >> 40) + 1.0) * 0x1.0p-24;  // (0, 1]
    const double u2 = static_cast<double>(r & 0xffffffull) * 0x1.0p-24;  // [0, 1)
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
    out[i] = mean + stddev * static_cast<float>(z);
  }
}

ModelWeights GenerateWeights(const ModelConfig& config, uint64_t seed, DType dtype) {
  ModelWeights w;
  std::vector<uint16_t> half;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    HostTensor t;
    t.shape = spec.shape;
    t.data.resize(t.numel());
    FillTensor(config, spec, seed, 0, t.numel(), t.data.data());
    if (dtype != DType::kF32) {
      half.resize(t.data.size());
      FromFloat(dtype, t.data.data(), t.data.size(), half.data());
      ToFloat(dtype, half.data(), half.size(), t.data.data());
    }
    w.emplace(spec.name, std::move(t));
  }
  return w;
}

namespace {
Status WriteText(const std::filesystem::path& path, const std::string& text) {
  auto tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out << text;
    if (!out.good()) return IoError(tmp.string() + ": write failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return IoError(path.string() + ": " + ec.message());
  return Status::Ok();
}
}  // namespace

Status WriteModelFolder(const std::filesystem::path& dir, const ModelConfig& config, uint64_t seed,
                        DType dtype, const std::function<void(int64_t, int64_t)>& progress) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IoError(dir.string() + ": " + ec.message());
  ModelConfig c = config;
  c.torch_dtype = dtype == DType::kF32 ? "float32" : dtype == DType::kF16 ? "float16" : "bfloat16";

  const std::vector<TensorSpec> specs = ExpectedTensors(c);
  SafetensorsWriter writer(dir / "model.safetensors");
  int64_t total = 0;
  for (const TensorSpec& s : specs) {
    writer.Declare(s.name, dtype, s.shape);
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    total += n * DTypeSize(dtype);
  }
  KDN_RETURN_IF_ERROR(writer.Begin());
  constexpr int64_t kPiece = 1 << 20;
  std::vector<float> buf(kPiece);
  int64_t done = 0;
  for (const TensorSpec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    for (int64_t off = 0; off < n; off += kPiece) {
      const int64_t take = std::min(kPiece, n - off);
      FillTensor(c, s, seed, off, take, buf.data());
      KDN_RETURN_IF_ERROR(writer.Append(buf.data(), take));
      done += take * DTypeSize(dtype);
      if (progress) progress(done, total);
    }
  }
  KDN_RETURN_IF_ERROR(writer.Finish());
  KDN_RETURN_IF_ERROR(WriteText(dir / "config.json", model::ModelConfigToJson(c)));
  KDN_RETURN_IF_ERROR(WriteText(dir / "tokenizer.json", text::ByteTokenizerJson()));
  KDN_RETURN_IF_ERROR(WriteText(dir / "tokenizer_config.json", text::ByteTokenizerConfigJson()));
  return Status::Ok();
}

}  // namespace kdn::engine
