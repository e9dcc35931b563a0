#include "kdn/model/config.h"

#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

namespace kdn::model {

using nlohmann::json;

const char* ArchitectureName(Architecture a) {
  switch (a) {
    case Architecture::kLlama: return "LlamaForCausalLM";
    case Architecture::kMistral: return "MistralForCausalLM";
    case Architecture::kQwen2: return "Qwen2ForCausalLM";
  }
  return "?";
}

namespace {

// The parameter count in doubles, which no size can overflow; exact while
// it is below 2^53, which ParseModelConfig ensures.
double Parameters(const ModelConfig& c) {
  const double d = c.hidden_size, q = c.q_dim(), kv = c.kv_dim();
  double per_layer = d * (q + 2 * kv) + q * d + 3 * d * c.intermediate_size + 2 * d;
  if (c.qkv_bias) per_layer += q + 2 * kv;
  if (c.o_bias) per_layer += d;
  const double embed = static_cast<double>(c.vocab_size) * d;
  return embed * (c.tie_word_embeddings ? 1 : 2) + c.num_layers * per_layer + d;
}

}  // namespace

int64_t ModelConfig::ParameterCount() const { return static_cast<int64_t>(Parameters(*this)); }

namespace {

// Reads an integer field; `required` fields missing are an error.
Status GetInt(const json& j, const char* key, bool required, int64_t fallback, int64_t* out,
              const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return InvalidArgument(source + ": missing required field \"" + key + "\"");
    *out = fallback;
    return Status::Ok();
  }
  if (!it->is_number_integer()) {
    return InvalidArgument(source + ": field \"" + key + "\" must be an integer, got " + it->dump());
  }
  *out = it->get<int64_t>();
  return Status::Ok();
}

// Reads a size: an integer in [1, INT_MAX], as the engine holds sizes in
// ints (a larger one must not be cut down to fit).
Status GetSize(const json& j, const char* key, bool required, int64_t fallback, int* out,
               const std::string& source) {
  int64_t v = 0;
  KDN_RETURN_IF_ERROR(GetInt(j, key, required, fallback, &v, source));
  if (v <= 0 || v > std::numeric_limits<int>::max()) {
    return InvalidArgument(source + ": field \"" + key + "\" must be in [1, " +
                           std::to_string(std::numeric_limits<int>::max()) + "], got " +
                           std::to_string(v));
  }
  *out = static_cast<int>(v);
  return Status::Ok();
}

Status GetDouble(const json& j, const char* key, double fallback, double* out,
                 const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    *out = fallback;
    return Status::Ok();
  }
  if (!it->is_number()) {
    return InvalidArgument(source + ": field \"" + key + "\" must be a number, got " + it->dump());
  }
  *out = it->get<double>();
  return Status::Ok();
}

// bos/eos may be an integer or a list (Llama 3 lists several eos ids; the
// first is the one generation stops on by default).
int FirstId(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return -1;
  if (it->is_number_integer()) return it->get<int>();
  if (it->is_array() && !it->empty() && (*it)[0].is_number_integer()) return (*it)[0].get<int>();
  return -1;
}

Result<ModelConfig> Parse(const json& j, const std::string& src) {
  if (!j.is_object()) return InvalidArgument(src + ": not a JSON object");
  ModelConfig c;
  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    return InvalidArgument(src + ": missing \"architectures\" (expected e.g. [\"LlamaForCausalLM\"])");
  }
  const std::string name = (*arch)[0].get<std::string>();
  if (name == "LlamaForCausalLM") {
    c.architecture = Architecture::kLlama;
  } else if (name == "MistralForCausalLM") {
    c.architecture = Architecture::kMistral;
  } else if (name == "Qwen2ForCausalLM") {
    c.architecture = Architecture::kQwen2;
  } else {
    return Unimplemented(src + ": architecture \"" + name +
                         "\" is not supported (kdn runs LlamaForCausalLM, MistralForCausalLM, "
                         "Qwen2ForCausalLM)");
  }

  KDN_RETURN_IF_ERROR(GetSize(j, "vocab_size", true, 0, &c.vocab_size, src));
  KDN_RETURN_IF_ERROR(GetSize(j, "hidden_size", true, 0, &c.hidden_size, src));
  KDN_RETURN_IF_ERROR(GetSize(j, "intermediate_size", true, 0, &c.intermediate_size, src));
  KDN_RETURN_IF_ERROR(GetSize(j, "num_hidden_layers", true, 0, &c.num_layers, src));
  KDN_RETURN_IF_ERROR(GetSize(j, "num_attention_heads", true, 0, &c.num_heads, src));
  KDN_RETURN_IF_ERROR(GetSize(j, "num_key_value_heads", false, c.num_heads, &c.num_kv_heads, src));
  KDN_RETURN_IF_ERROR(GetSize(j, "head_dim", false, c.hidden_size / c.num_heads, &c.head_dim, src));
  if (c.head_dim % 2 != 0) {
    return InvalidArgument(src + ": head_dim must be positive and even, got " + std::to_string(c.head_dim));
  }
  if (!j.contains("head_dim") && c.hidden_size % c.num_heads != 0) {
    return InvalidArgument(src + ": hidden_size is not a multiple of num_attention_heads");
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    return InvalidArgument(src + ": num_attention_heads (" + std::to_string(c.num_heads) +
                           ") is not a multiple of num_key_value_heads (" +
                           std::to_string(c.num_kv_heads) + ")");
  }
  if (int64_t{c.num_heads} * c.head_dim > std::numeric_limits<int>::max()) {
    return InvalidArgument(src + ": num_attention_heads * head_dim does not fit in an int");
  }
  KDN_RETURN_IF_ERROR(GetDouble(j, "rms_norm_eps", 1e-6, &c.rms_norm_eps, src));
  KDN_RETURN_IF_ERROR(GetDouble(j, "rope_theta", 10000.0, &c.rope_theta, src));

  const std::string act = j.value("hidden_act", std::string("silu"));
  if (act != "silu") {
    return Unimplemented(src + ": hidden_act \"" + act + "\" is not supported (only silu)");
  }
  if (j.value("mlp_bias", false)) return Unimplemented(src + ": mlp_bias is not supported");

  auto rs = j.find("rope_scaling");
  if (rs != j.end() && !rs->is_null()) {
    if (!rs->is_object()) return InvalidArgument(src + ": rope_scaling must be an object or null");
    std::string type = rs->value("rope_type", rs->value("type", std::string("default")));
    if (type == "llama3") {
      RopeScaling& s = c.rope_scaling;
      s.llama3 = true;
      KDN_RETURN_IF_ERROR(GetDouble(*rs, "factor", 8.0, &s.factor, src + " rope_scaling"));
      KDN_RETURN_IF_ERROR(GetDouble(*rs, "low_freq_factor", 1.0, &s.low_freq_factor, src + " rope_scaling"));
      KDN_RETURN_IF_ERROR(GetDouble(*rs, "high_freq_factor", 4.0, &s.high_freq_factor, src + " rope_scaling"));
      KDN_RETURN_IF_ERROR(GetInt(*rs, "original_max_position_embeddings", false, 8192,
                                 &s.original_max_position_embeddings, src + " rope_scaling"));
      if (s.high_freq_factor <= s.low_freq_factor || s.factor <= 0) {
        return InvalidArgument(src + ": rope_scaling needs high_freq_factor > low_freq_factor and factor > 0");
      }
    } else if (type != "default") {
      return Unimplemented(src + ": rope_scaling type \"" + type +
                           "\" is not supported (only llama3 or none)");
    }
  }

  // As in Hugging Face's classes: Qwen2 always has QKV biases, Llama has
  // them (and the output's) when attention_bias says so, Mistral never
  // (its attention_bias, if any, is not read).
  if (c.architecture == Architecture::kQwen2) {
    c.qkv_bias = true;
  } else if (c.architecture == Architecture::kLlama && j.value("attention_bias", false)) {
    c.qkv_bias = true;
    c.o_bias = true;
  }
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);

  int64_t max_pos = 0;
  KDN_RETURN_IF_ERROR(GetInt(j, "max_position_embeddings", false, 4096, &max_pos, src));
  if (max_pos <= 0) return InvalidArgument(src + ": max_position_embeddings must be positive");
  c.max_context = max_pos;
  auto sw = j.find("sliding_window");
  const bool sliding = c.architecture == Architecture::kMistral ||
                       (c.architecture == Architecture::kQwen2 && j.value("use_sliding_window", false));
  if (sliding && sw != j.end() && sw->is_number_integer() && sw->get<int64_t>() > 0) {
    c.max_context = std::min(c.max_context, sw->get<int64_t>());
  }
  c.bos_token_id = FirstId(j, "bos_token_id");
  c.eos_token_id = FirstId(j, "eos_token_id");
  c.torch_dtype = j.value("torch_dtype", std::string());
  // Far beyond any model (Llama 3.1 405B is under 2^39), and every product
  // of sizes the engine forms in int64_t stays inside it.
  if (Parameters(c) > 0x1p53) {
    return InvalidArgument(src + ": the sizes imply more than 2^53 parameters");
  }
  return c;
}

}  // namespace

Result<ModelConfig> ParseModelConfig(const std::string& json_text, const std::string& source) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument(source + ": not valid JSON");
  try {
    return Parse(j, source);
  } catch (const json::exception& e) {  // a field of an unexpected type
    return InvalidArgument(source + ": " + e.what());
  }
}

Result<ModelConfig> LoadModelConfig(const std::filesystem::path& dir) {
  const auto path = dir / "config.json";
  std::ifstream in(path);
  if (!in) return NotFound(path.string() + ": cannot open (is this a model folder?)");
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseModelConfig(ss.str(), path.string());
}

std::string ModelConfigToJson(const ModelConfig& c) {
  json j;
  j["architectures"] = {ArchitectureName(c.architecture)};
  j["model_type"] = c.architecture == Architecture::kQwen2     ? "qwen2"
                    : c.architecture == Architecture::kMistral ? "mistral"
                                                               : "llama";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.llama3) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings",
                          c.rope_scaling.original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  if (c.architecture == Architecture::kLlama) {
    j["attention_bias"] = c.o_bias;
    j["mlp_bias"] = false;
  }
  if (c.architecture != Architecture::kLlama) {
    j["sliding_window"] = nullptr;
    j["use_sliding_window"] = false;
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["max_position_embeddings"] = c.max_context;
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = c.eos_token_id;
  j["torch_dtype"] = c.torch_dtype.empty() ? "float32" : c.torch_dtype;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  return j.dump(2) + "\n";
}

}  // namespace kdn::model
