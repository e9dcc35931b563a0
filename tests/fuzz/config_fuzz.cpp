// libFuzzer harness for config.json parsing (kdn/model/config.h).
//
// The input is the file's text. ParseModelConfig must not crash, throw or
// hit undefined behaviour, and a config it accepts must be one the engine
// can size: every size positive and what the file says (not truncated to
// fit an int), heads a multiple of KV heads, head_dim even, a positive
// context, and the products the engine computes from it (q_dim, kv_dim,
// ParameterCount) free of overflow. Its ModelConfigToJson text must parse
// back to the same config.
//
// Built with clang's -fsanitize=fuzzer,address,undefined (tests/fuzz); the
// test `config_fuzz` (label fuzz) runs it over tests/fuzz/corpus/config.
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "kdn/model/config.h"

using namespace kdn;
using kdn::fuzz::Check;

namespace {

// The integer `key` of the file as written (the parser accepted it).
int64_t Field(const nlohmann::json& j, const char* key, int64_t fallback) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<int64_t>();
}

bool Same(const model::ModelConfig& a, const model::ModelConfig& b) {
  return a.architecture == b.architecture && a.vocab_size == b.vocab_size &&
         a.hidden_size == b.hidden_size && a.intermediate_size == b.intermediate_size &&
         a.num_layers == b.num_layers && a.num_heads == b.num_heads &&
         a.num_kv_heads == b.num_kv_heads && a.head_dim == b.head_dim &&
         a.rms_norm_eps == b.rms_norm_eps && a.rope_theta == b.rope_theta &&
         a.rope_scaling.type == b.rope_scaling.type &&
         (a.rope_scaling.type == model::RopeType::kDefault ||
          (a.rope_scaling.factor == b.rope_scaling.factor &&
           a.rope_scaling.dynamic_threshold == b.rope_scaling.dynamic_threshold)) &&
         (a.rope_scaling.type != model::RopeType::kLlama3 ||
          (a.rope_scaling.low_freq_factor == b.rope_scaling.low_freq_factor &&
           a.rope_scaling.high_freq_factor == b.rope_scaling.high_freq_factor &&
           a.rope_scaling.original_max_position_embeddings ==
               b.rope_scaling.original_max_position_embeddings)) &&
         (a.rope_scaling.type != model::RopeType::kYarn ||
          (a.rope_scaling.original_max_position_embeddings ==
               b.rope_scaling.original_max_position_embeddings &&
           a.rope_scaling.beta_fast == b.rope_scaling.beta_fast &&
           a.rope_scaling.beta_slow == b.rope_scaling.beta_slow &&
           a.rope_scaling.truncate == b.rope_scaling.truncate &&
           a.rope_scaling.attention_factor == b.rope_scaling.attention_factor)) &&
         a.sliding_window == b.sliding_window && a.windowed_layers == b.windowed_layers &&
         a.qkv_bias == b.qkv_bias && a.o_bias == b.o_bias &&
         a.tie_word_embeddings == b.tie_word_embeddings && a.max_context == b.max_context &&
         a.bos_token_id == b.bos_token_id && a.eos_token_id == b.eos_token_id;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto parsed = model::ParseModelConfig(text, "config.json");
  if (!parsed.ok()) return 0;
  const model::ModelConfig& c = *parsed;
  const auto j = nlohmann::json::parse(text);
  Check(c.vocab_size > 0 && c.vocab_size == Field(j, "vocab_size", 0), "vocab_size as written");
  Check(c.hidden_size > 0 && c.hidden_size == Field(j, "hidden_size", 0), "hidden_size as written");
  Check(c.intermediate_size > 0 && c.intermediate_size == Field(j, "intermediate_size", 0),
        "intermediate_size as written");
  Check(c.num_layers > 0 && c.num_layers == Field(j, "num_hidden_layers", 0),
        "num_hidden_layers as written");
  Check(c.num_heads > 0 && c.num_heads == Field(j, "num_attention_heads", 0),
        "num_attention_heads as written");
  Check(c.num_kv_heads > 0 && c.num_kv_heads == Field(j, "num_key_value_heads", c.num_heads),
        "num_key_value_heads as written");
  Check(c.head_dim > 0 && c.head_dim % 2 == 0, "head_dim positive and even");
  Check(c.num_heads % c.num_kv_heads == 0, "heads a multiple of KV heads");
  Check(c.max_context > 0, "a positive context");
  Check(int64_t{c.num_heads} * c.head_dim == c.q_dim(), "q_dim without overflow");
  Check(int64_t{c.num_kv_heads} * c.head_dim == c.kv_dim(), "kv_dim without overflow");
  Check(c.ParameterCount() > 0, "a parameter count");

  auto again = model::ParseModelConfig(model::ModelConfigToJson(c), "written");
  Check(again.ok(), "ModelConfigToJson's text parses");
  Check(Same(c, *again), "ModelConfigToJson's text parses back to the same config");
  return 0;
}
