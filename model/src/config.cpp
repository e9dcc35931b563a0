#include "kdn/model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kdn/model/gguf.h"

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

const char* RopeTypeName(RopeType t) {
  switch (t) {
    case RopeType::kDefault: return "default";
    case RopeType::kLinear: return "linear";
    case RopeType::kDynamic: return "dynamic";
    case RopeType::kYarn: return "yarn";
    case RopeType::kLlama3: return "llama3";
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
    return InvalidArgument(source + ": field \"" + key + "\" must be an integer, got " +
                           it->dump());
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

// The ids of a bos/eos field: an integer or a list of them (Llama 3 lists
// several eos ids). Other values are no ids.
std::vector<int> Ids(const json& j, const char* key) {
  std::vector<int> ids;
  auto it = j.find(key);
  if (it == j.end()) return ids;
  auto take = [&](const json& v) {
    if (v.is_number_integer() && v.get<int64_t>() >= 0 &&
        v.get<int64_t>() <= std::numeric_limits<int>::max()) {
      ids.push_back(v.get<int>());
    }
  };
  if (it->is_array()) {
    for (const json& v : *it) take(v);
  } else {
    take(*it);
  }
  return ids;
}

// The first of Ids (Llama 3 lists several eos ids; the first is the one
// generation stops on by default), -1 when there is none: derived from Ids so
// that eos_token_id is always eos_token_ids' first, as config.h says.
int FirstId(const json& j, const char* key) {
  const std::vector<int> ids = Ids(j, key);
  return ids.empty() ? -1 : ids[0];
}

// RoPE as transformers 5.x reads it (RotaryEmbeddingConfigMixin): the
// parameters are config.json's rope_scaling when that is a non-empty object,
// else its rope_parameters (what 5.x writes); their rope_theta comes before
// the top-level one; "rope_type" comes before the older "type". Scaling
// parameters of a type are checked, the others' ignored, as transformers
// ignores them (with a warning).
Status ParseRope(const json& j, int64_t max_pos, ModelConfig* c, const std::string& src) {
  const json* rp = nullptr;
  std::string field = "rope_scaling";
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_object()) return InvalidArgument(src + ": " + key + " must be an object or null");
    if (it->empty()) continue;
    rp = &*it;
    field = key;
    break;
  }
  KDN_RETURN_IF_ERROR(GetDouble(j, "rope_theta", 10000.0, &c->rope_theta, src));
  const std::string where = src + (rp != nullptr ? " " + field : "");
  if (rp != nullptr) {
    KDN_RETURN_IF_ERROR(GetDouble(*rp, "rope_theta", c->rope_theta, &c->rope_theta, where));
  }
  if (!(c->rope_theta > 1.0) || !std::isfinite(c->rope_theta)) {
    return InvalidArgument(where + ": rope_theta must be a number above 1");
  }
  if (rp == nullptr) return Status::Ok();
  double partial = 1.0;
  KDN_RETURN_IF_ERROR(GetDouble(*rp, "partial_rotary_factor", 1.0, &partial, where));
  if (partial != 1.0) {
    return Unimplemented(where + ": partial_rotary_factor " + std::to_string(partial) +
                         " is not supported (RoPE over the whole head only)");
  }
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    auto it = rp->find(key);
    if (it == rp->end() || it->is_null()) continue;
    if (!it->is_string()) return InvalidArgument(where + ": " + key + " must be a string");
    type = it->get<std::string>();
    break;
  }
  RopeScaling& s = c->rope_scaling;
  if (type == "default") return Status::Ok();
  if (type == "linear")
    s.type = RopeType::kLinear;
  else if (type == "dynamic")
    s.type = RopeType::kDynamic;
  else if (type == "yarn")
    s.type = RopeType::kYarn;
  else if (type == "llama3")
    s.type = RopeType::kLlama3;
  else {
    return Unimplemented(where + ": rope_type \"" + type +
                         "\" is not supported (default, linear, dynamic, yarn, llama3)");
  }
  // factor: required but for yarn, where it defaults to the context ratio.
  const bool has_factor = rp->contains("factor") && !rp->at("factor").is_null();
  if (!has_factor && s.type != RopeType::kYarn) {
    return InvalidArgument(where + ": rope_type \"" + type + "\" needs a \"factor\"");
  }
  int64_t original = max_pos;
  KDN_RETURN_IF_ERROR(
      GetInt(*rp, "original_max_position_embeddings", false, max_pos, &original, where));
  if (original <= 0)
    return InvalidArgument(where + ": original_max_position_embeddings must be positive");
  s.original_max_position_embeddings = original;
  KDN_RETURN_IF_ERROR(
      GetDouble(*rp, "factor", static_cast<double>(max_pos) / original, &s.factor, where));
  if (!(s.factor > 0) || !std::isfinite(s.factor)) {
    return InvalidArgument(where + ": factor must be a positive number");
  }
  switch (s.type) {
    case RopeType::kLlama3:
      KDN_RETURN_IF_ERROR(GetDouble(*rp, "low_freq_factor", 1.0, &s.low_freq_factor, where));
      KDN_RETURN_IF_ERROR(GetDouble(*rp, "high_freq_factor", 4.0, &s.high_freq_factor, where));
      if (s.high_freq_factor <= s.low_freq_factor || s.low_freq_factor <= 0) {
        return InvalidArgument(where + ": llama3 needs high_freq_factor > low_freq_factor > 0");
      }
      break;
    case RopeType::kDynamic:
      // Its base grows as a power d / (d - 2) of the head size d.
      if (c->head_dim <= 2) {
        return Unimplemented(where + ": dynamic RoPE needs head_dim > 2, got " +
                             std::to_string(c->head_dim));
      }
      s.dynamic_threshold = max_pos;
      // The base grows with the position past max_position_embeddings:
      // the scaled context is the point of dynamic RoPE.
      c->max_context =
          static_cast<int64_t>(std::min(static_cast<double>(max_pos) * std::max(1.0, s.factor),
                                        static_cast<double>(int64_t{1} << 31)));
      break;
    case RopeType::kYarn: {
      // transformers treats a falsy beta (null or 0) as unset.
      KDN_RETURN_IF_ERROR(GetDouble(*rp, "beta_fast", 32.0, &s.beta_fast, where));
      KDN_RETURN_IF_ERROR(GetDouble(*rp, "beta_slow", 1.0, &s.beta_slow, where));
      if (s.beta_fast == 0) s.beta_fast = 32.0;
      if (s.beta_slow == 0) s.beta_slow = 1.0;
      if (!(s.beta_fast > 0 && s.beta_slow > 0)) {
        return InvalidArgument(where + ": beta_fast and beta_slow must be positive");
      }
      auto tr = rp->find("truncate");
      if (tr != rp->end() && !tr->is_null()) {
        if (!tr->is_boolean()) return InvalidArgument(where + ": truncate must be true or false");
        s.truncate = tr->get<bool>();
      }
      auto mscale = [](double scale, double m) {
        return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
      };
      double m = 0, m_all = 0;
      KDN_RETURN_IF_ERROR(GetDouble(*rp, "mscale", 0.0, &m, where));
      KDN_RETURN_IF_ERROR(GetDouble(*rp, "mscale_all_dim", 0.0, &m_all, where));
      const double fallback = m != 0 && m_all != 0 ? mscale(s.factor, m) / mscale(s.factor, m_all)
                                                   : mscale(s.factor, 1.0);
      KDN_RETURN_IF_ERROR(GetDouble(*rp, "attention_factor", fallback, &s.attention_factor, where));
      if (!(s.attention_factor > 0) || !std::isfinite(s.attention_factor)) {
        return InvalidArgument(where + ": attention_factor must be a positive number");
      }
      break;
    }
    default: break;
  }
  return Status::Ok();
}

// Sliding windows as transformers 5.x builds them: Mistral windows every
// layer when sliding_window is set; Qwen2 only with use_sliding_window, and
// then the layers its layer_types call "sliding_attention" (by default those
// from max_window_layers on). Llama has none.
Status ParseSlidingWindow(const json& j, ModelConfig* c, const std::string& src) {
  if (c->architecture == Architecture::kLlama) return Status::Ok();
  if (c->architecture == Architecture::kQwen2 && !j.value("use_sliding_window", false)) {
    return Status::Ok();
  }
  // Both classes default sliding_window to 4096 when the field is absent.
  int64_t window = 0;
  KDN_RETURN_IF_ERROR(GetInt(j, "sliding_window", false, 4096, &window, src));
  if (j.contains("sliding_window") && j.at("sliding_window").is_null()) return Status::Ok();
  if (window <= 0) return InvalidArgument(src + ": sliding_window must be positive or null");
  c->sliding_window = window;
  c->windowed_layers.assign(c->num_layers, true);
  if (c->architecture != Architecture::kQwen2) return Status::Ok();
  auto lt = j.find("layer_types");
  if (lt != j.end() && !lt->is_null()) {
    if (!lt->is_array() || static_cast<int64_t>(lt->size()) != c->num_layers) {
      return InvalidArgument(src + ": layer_types must list one type for each of the " +
                             std::to_string(c->num_layers) + " layers");
    }
    for (int l = 0; l < c->num_layers; ++l) {
      const json& t = (*lt)[l];
      if (t == "full_attention")
        c->windowed_layers[l] = false;
      else if (t != "sliding_attention") {
        return Unimplemented(src + ": layer_types[" + std::to_string(l) + "] " + t.dump() +
                             " is not supported (full_attention, sliding_attention)");
      }
    }
  } else {
    int64_t first = 28;
    KDN_RETURN_IF_ERROR(GetInt(j, "max_window_layers", false, 28, &first, src));
    for (int l = 0; l < c->num_layers; ++l) c->windowed_layers[l] = l >= first;
  }
  // A window no layer uses is none (one model, one fingerprint).
  if (std::find(c->windowed_layers.begin(), c->windowed_layers.end(), true) ==
      c->windowed_layers.end()) {
    c->sliding_window = 0;
    c->windowed_layers.clear();
  }
  return Status::Ok();
}

Result<ModelConfig> Parse(const json& j, const std::string& src) {
  if (!j.is_object()) return InvalidArgument(src + ": not a JSON object");
  ModelConfig c;
  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string()) {
    return InvalidArgument(src +
                           ": missing \"architectures\" (expected e.g. [\"LlamaForCausalLM\"])");
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
    return InvalidArgument(src + ": head_dim must be positive and even, got " +
                           std::to_string(c.head_dim));
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

  const std::string act = j.value("hidden_act", std::string("silu"));
  if (act != "silu") {
    return Unimplemented(src + ": hidden_act \"" + act + "\" is not supported (only silu)");
  }
  // Only Llama's class reads mlp_bias; Mistral's and Qwen2's never build MLP biases.
  if (c.architecture == Architecture::kLlama && j.value("mlp_bias", false)) {
    return Unimplemented(src + ": mlp_bias: true is not supported (MLP biases)");
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
  KDN_RETURN_IF_ERROR(ParseRope(j, max_pos, &c, src));
  KDN_RETURN_IF_ERROR(ParseSlidingWindow(j, &c, src));
  c.bos_token_id = FirstId(j, "bos_token_id");
  c.eos_token_id = FirstId(j, "eos_token_id");
  c.eos_token_ids = Ids(j, "eos_token_id");
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
  if (IsGgufPath(dir)) {
    KDN_ASSIGN_OR_RETURN(auto file, GgufFile::Open(dir));
    return ModelConfigFromGguf(*file);
  }
  const auto path = dir / "config.json";
  std::ifstream in(path);
  if (!in) return NotFound(path.string() + ": cannot open (is this a model folder?)");
  std::stringstream ss;
  ss << in.rdbuf();
  KDN_ASSIGN_OR_RETURN(ModelConfig c, ParseModelConfig(ss.str(), path.string()));
  // generation_config.json: the eos ids transformers' generate stops on
  // (Llama 3.1 Instruct adds <|eot_id|> there).
  const auto gen_path = dir / "generation_config.json";
  std::ifstream gen(gen_path);
  if (gen) {
    std::stringstream gs;
    gs << gen.rdbuf();
    json g = json::parse(gs.str(), nullptr, /*allow_exceptions=*/false);
    if (g.is_discarded() || !g.is_object()) {
      return InvalidArgument(gen_path.string() + ": not a JSON object");
    }
    for (int id : Ids(g, "eos_token_id")) {
      if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end()) {
        c.eos_token_ids.push_back(id);
      }
    }
    if (c.eos_token_id < 0 && !c.eos_token_ids.empty()) c.eos_token_id = c.eos_token_ids[0];
  }
  return c;
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
  const RopeScaling& rs = c.rope_scaling;
  if (rs.type == RopeType::kDefault) {
    j["rope_scaling"] = nullptr;
  } else {
    json r = {{"rope_type", RopeTypeName(rs.type)}, {"factor", rs.factor}};
    if (rs.type == RopeType::kLlama3) {
      r["low_freq_factor"] = rs.low_freq_factor;
      r["high_freq_factor"] = rs.high_freq_factor;
    }
    if (rs.type == RopeType::kLlama3 || rs.type == RopeType::kYarn) {
      r["original_max_position_embeddings"] = rs.original_max_position_embeddings;
    }
    if (rs.type == RopeType::kYarn) {
      r["beta_fast"] = rs.beta_fast;
      r["beta_slow"] = rs.beta_slow;
      r["truncate"] = rs.truncate;
      r["attention_factor"] = rs.attention_factor;
    }
    j["rope_scaling"] = r;
  }
  if (c.architecture == Architecture::kLlama) {
    j["attention_bias"] = c.o_bias;
    j["mlp_bias"] = false;
  }
  if (c.architecture != Architecture::kLlama) {
    if (c.sliding_window > 0) {
      j["sliding_window"] = c.sliding_window;
      j["use_sliding_window"] = true;
      if (c.architecture == Architecture::kQwen2) {
        json types = json::array();
        for (int l = 0; l < c.num_layers; ++l) {
          types.push_back(c.windowed_layers[l] ? "sliding_attention" : "full_attention");
        }
        j["layer_types"] = types;
      }
    } else {
      j["sliding_window"] = nullptr;
      j["use_sliding_window"] = false;
    }
  }
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["max_position_embeddings"] =
      rs.type == RopeType::kDynamic ? rs.dynamic_threshold : c.max_context;
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = c.eos_token_ids.size() > 1 ? json(c.eos_token_ids) : json(c.eos_token_id);
  j["torch_dtype"] = c.torch_dtype.empty() ? "float32" : c.torch_dtype;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  return j.dump(2) + "\n";
}

}  // namespace kdn::model
