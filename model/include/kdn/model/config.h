#pragma once
// ModelConfig: the subset of a Hugging Face config.json that the engine runs.
//
// Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM with SiLU
// gated MLPs, RMSNorm, RoPE (default or "llama3" scaling), grouped-query
// attention, optional QKV bias, tied or untied embeddings. Anything else is
// refused by ParseModelConfig with a Status that says what and why.
//
// Apart from the engine (library kdn_model, no BLAS, no OpenMP), so that
// kdn-router reads config.json exactly as the workers do without linking the
// engine. Thread-safe (values and functions over values).

#include <cstdint>
#include <filesystem>
#include <string>

#include "kdn/common/status.h"

namespace kdn::model {

enum class Architecture { kLlama, kMistral, kQwen2 };
const char* ArchitectureName(Architecture a);  // the Hugging Face class name

struct RopeScaling {
  bool llama3 = false;  // false: plain RoPE
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
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
  // The longest sequence the engine accepts: max_position_embeddings, or the
  // sliding window when a Mistral/Qwen2 model sets one smaller (inside the
  // window, sliding-window attention equals full attention).
  int64_t max_context = 0;
  int bos_token_id = -1;
  int eos_token_id = -1;
  std::string torch_dtype;  // as written; informative only

  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
  // Parameters in the matrices and vectors of the model (embeddings included).
  int64_t ParameterCount() const;
};

// Parses config.json text. `source` names the file in error messages.
Result<ModelConfig> ParseModelConfig(const std::string& json_text,
                                     const std::string& source);
// Reads and parses DIR/config.json.
Result<ModelConfig> LoadModelConfig(const std::filesystem::path& dir);
// The config.json text for `config` (what kdn-mkmodel writes).
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace kdn::model
