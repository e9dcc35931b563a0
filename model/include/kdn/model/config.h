#pragma once
// ModelConfig: the subset of a Hugging Face config.json that the engine runs.
//
// Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM with SiLU
// gated MLPs, RMSNorm, RoPE (default, or "linear", "dynamic", "yarn" or
// "llama3" scaling, read as transformers 5.x reads them: docs/engine.md,
// "RoPE"), sliding-window attention (Mistral; Qwen2 per layer), grouped-query
// attention, optional QKV bias, tied or untied embeddings. Anything else is
// refused by ParseModelConfig with a Status that names the field.
//
// Apart from the engine (library kdn_model, no BLAS, no OpenMP), so that
// kdn-router reads config.json exactly as the workers do without linking the
// engine. Thread-safe (values and functions over values).

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::model {

enum class Architecture { kLlama, kMistral, kQwen2 };
const char* ArchitectureName(Architecture a);  // the Hugging Face class name

enum class RopeType { kDefault, kLinear, kDynamic, kYarn, kLlama3 };
const char* RopeTypeName(RopeType t);  // as config.json spells it

struct RopeScaling {
  RopeType type = RopeType::kDefault;
  double factor = 1.0;  // linear, dynamic, yarn, llama3
  // llama3: the band of wavelengths between original / high_freq_factor and
  // original / low_freq_factor is interpolated.
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // llama3 and yarn: the context the model was pretrained on.
  int64_t original_max_position_embeddings = 8192;
  // yarn: the correction range's rotation counts, whether its bounds are
  // rounded outwards, and the factor by which cos and sin are multiplied
  // (resolved from attention_factor, or mscale and mscale_all_dim, or factor).
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  bool truncate = true;
  double attention_factor = 1.0;
  // dynamic: the length past which the base grows with the position
  // (max_position_embeddings, as transformers has it).
  int64_t dynamic_threshold = 0;
};

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool qkv_bias = false;  // Qwen2 always; Llama when attention_bias
  bool o_bias = false;    // Llama with attention_bias only
  bool tie_word_embeddings = false;
  // The longest sequence the engine accepts: max_position_embeddings (times
  // the factor for dynamic RoPE, whose point is to run past it).
  int64_t max_context = 0;
  // Sliding-window attention: a query at position p of a windowed layer sees
  // the keys of positions p - sliding_window + 1 .. p. 0: none. Mistral
  // windows every layer; Qwen2 those its layer_types (or max_window_layers)
  // name.
  int64_t sliding_window = 0;
  std::vector<bool> windowed_layers;  // [num_layers] when sliding_window > 0

  // The window of layer `l`: sliding_window, or 0 (full attention).
  int64_t LayerWindow(int l) const {
    return sliding_window > 0 && windowed_layers[static_cast<size_t>(l)] ? sliding_window : 0;
  }
  int bos_token_id = -1;
  int eos_token_id = -1;  // the first of eos_token_ids, -1 when none
  // Every id that ends generation: config.json's eos_token_id (an integer or
  // a list: Llama 3.1 lists 128001, 128008 and 128009), then, where the folder
  // has one, generation_config.json's (what transformers' generate stops on).
  std::vector<int> eos_token_ids;
  std::string torch_dtype;  // as written; informative only

  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
  // Parameters in the matrices and vectors of the model (embeddings included).
  int64_t ParameterCount() const;
};

// Parses config.json text. `source` names the file in error messages.
Result<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& source);
// Reads and parses DIR/config.json, or, where `dir` is a GGUF file
// (IsGgufPath), the config of its metadata (kdn/model/gguf.h).
Result<ModelConfig> LoadModelConfig(const std::filesystem::path& dir);
// The config.json text for `config` (what kdn-mkmodel writes).
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace kdn::model
