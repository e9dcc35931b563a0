#include "kdn/model/config.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace kdn::model {
namespace {

const char* kLlama3 = R"({
  "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "max_position_embeddings": 131072, "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": false,
  "hidden_act": "silu", "torch_dtype": "bfloat16"})";

TEST(ModelConfig, ParsesALlama31Config) {
  auto c = ParseModelConfig(kLlama3, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->architecture, Architecture::kLlama);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->rope_scaling.type, RopeType::kLlama3);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c->eos_token_id, 128001);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{128001, 128008, 128009}));
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_EQ(c->max_context, 131072);
  EXPECT_NEAR(c->ParameterCount() / 1e9, 8.03, 0.01);
}

TEST(ModelConfig, Qwen2ImpliesQkvBias) {
  std::string j = kLlama3;
  j.replace(j.find("LlamaForCausalLM"), 16, "Qwen2ForCausalLM");
  auto c = ParseModelConfig(j, "config.json");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
}

TEST(ModelConfig, MistralWindowsEveryLayerAndKeepsItsWholeContext) {
  const char* j = R"({"architectures": ["MistralForCausalLM"], "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
    "sliding_window": 4096})";
  auto c = ParseModelConfig(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->max_context, 32768);
  EXPECT_EQ(c->sliding_window, 4096);
  EXPECT_EQ(c->LayerWindow(0), 4096);
  EXPECT_EQ(c->LayerWindow(31), 4096);
}

TEST(ModelConfig, SlidingWindowsAsTransformers5BuildsThem) {
  const std::string head = R"({"architectures": ["ARCH"], "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4)";
  auto parse = [&](const std::string& arch, const std::string& rest) {
    std::string j = head;
    j.replace(j.find("ARCH"), 4, arch);
    return ParseModelConfig(j + rest + "}", "config.json");
  };
  // Mistral: absent means transformers' default of 4096; null means none.
  auto m = parse("MistralForCausalLM", "");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->sliding_window, 4096);
  m = parse("MistralForCausalLM", R"(, "sliding_window": null)");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->sliding_window, 0);
  EXPECT_EQ(m->LayerWindow(2), 0);
  // Qwen2: nothing without use_sliding_window; with it, the layers from
  // max_window_layers on, or those layer_types names.
  auto q = parse("Qwen2ForCausalLM", R"(, "sliding_window": 32, "max_window_layers": 1)");
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->sliding_window, 0);
  q = parse("Qwen2ForCausalLM",
            R"(, "use_sliding_window": true, "sliding_window": 32, "max_window_layers": 1)");
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->LayerWindow(0), 0);
  EXPECT_EQ(q->LayerWindow(1), 32);
  EXPECT_EQ(q->LayerWindow(3), 32);
  q = parse("Qwen2ForCausalLM", R"(, "use_sliding_window": true, "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"])");
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->LayerWindow(0), 32);
  EXPECT_EQ(q->LayerWindow(1), 0);
  // A window no layer uses is none (max_window_layers defaults to 28).
  q = parse("Qwen2ForCausalLM", R"(, "use_sliding_window": true, "sliding_window": 32)");
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->sliding_window, 0);
  // Llama has no window whatever the file says.
  auto l = parse("LlamaForCausalLM", R"(, "sliding_window": 32)");
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->sliding_window, 0);
  // Refusals name the field.
  q = parse("Qwen2ForCausalLM", R"(, "use_sliding_window": true, "sliding_window": 32,
    "layer_types": ["sliding_attention"])");
  EXPECT_NE(q.status().message().find("layer_types"), std::string::npos) << q.status().ToString();
  q = parse("Qwen2ForCausalLM", R"(, "use_sliding_window": true, "sliding_window": 32,
    "layer_types": ["chunked_attention", "full_attention", "full_attention", "full_attention"])");
  EXPECT_EQ(q.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(q.status().message().find("layer_types[0]"), std::string::npos);
  m = parse("MistralForCausalLM", R"(, "sliding_window": -3)");
  EXPECT_NE(m.status().message().find("sliding_window"), std::string::npos);
}

TEST(ModelConfig, ReadsEachRopeTypeWithTransformers5Precedence) {
  const std::string head = R"({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "max_position_embeddings": 4096, "rope_theta": 10000.0)";
  auto parse = [&](const std::string& rest) {
    return ParseModelConfig(head + rest + "}", "config.json");
  };
  auto c = parse(R"(, "rope_scaling": {"rope_type": "linear", "factor": 2.0})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rope_scaling.type, RopeType::kLinear);
  EXPECT_EQ(c->rope_scaling.factor, 2.0);
  // "rope_type" before the older "type".
  c = parse(R"(, "rope_scaling": {"type": "linear", "rope_type": "dynamic", "factor": 2.0})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->rope_scaling.type, RopeType::kDynamic);
  EXPECT_EQ(c->rope_scaling.dynamic_threshold, 4096);
  EXPECT_EQ(c->max_context, 8192);  // dynamic runs past max_position_embeddings
  c = parse(R"(, "rope_scaling": {"type": "linear", "factor": 2.0})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->rope_scaling.type, RopeType::kLinear);
  // rope_parameters (what transformers 5 writes), its rope_theta first.
  c = parse(R"(, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5000.0,
              "original_max_position_embeddings": 1024})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rope_scaling.type, RopeType::kYarn);
  EXPECT_EQ(c->rope_theta, 5000.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 1024);
  EXPECT_NEAR(c->rope_scaling.attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-12);
  // yarn: factor defaults to the context ratio; mscale / mscale_all_dim.
  c = parse(R"(, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 1024,
              "mscale": 1.0, "mscale_all_dim": 0.5})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rope_scaling.factor, 4.0);
  EXPECT_NEAR(c->rope_scaling.attention_factor,
              (0.1 * std::log(4.0) + 1.0) / (0.05 * std::log(4.0) + 1.0), 1e-12);
  // A default-type rope_parameters with a theta of its own.
  c = parse(R"(, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->rope_scaling.type, RopeType::kDefault);
  EXPECT_EQ(c->rope_theta, 1000000.0);
  // Refusals name the field.
  struct Bad {
    std::string rest, expect;
    StatusCode code;
  };
  for (const Bad& b : std::vector<Bad>{
           {R"(, "rope_scaling": {"rope_type": "longrope", "factor": 2.0})", "longrope",
            StatusCode::kUnimplemented},
           {R"(, "rope_scaling": {"rope_type": "linear"})", "factor", StatusCode::kInvalidArgument},
           {R"(, "rope_scaling": {"rope_type": "linear", "factor": -1})", "factor",
            StatusCode::kInvalidArgument},
           {R"(, "rope_scaling": {"rope_type": 3, "factor": 2})", "rope_type",
            StatusCode::kInvalidArgument},
           {R"(, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5})",
            "partial_rotary_factor", StatusCode::kUnimplemented},
           {R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
               "high_freq_factor": 1.0})",
            "high_freq_factor", StatusCode::kInvalidArgument},
           {R"(, "rope_scaling": [1])", "rope_scaling", StatusCode::kInvalidArgument},
           {R"(, "rope_parameters": {"rope_type": "default", "rope_theta": 0.5})", "rope_theta",
            StatusCode::kInvalidArgument},
       }) {
    auto r = parse(b.rest);
    EXPECT_EQ(r.status().code(), b.code) << b.rest << ": " << r.status().ToString();
    EXPECT_NE(r.status().message().find(b.expect), std::string::npos) << r.status().ToString();
  }
}

// Found by tests/fuzz/config_fuzz.cpp: a Mistral config with attention_bias
// got Llama's biases (tensors a Mistral checkpoint does not have), and lost
// them again through ModelConfigToJson.
TEST(ModelConfig, MistralHasNoAttentionBiasWhateverTheConfigSays) {
  const char* j = R"({"architectures": ["MistralForCausalLM"], "vocab_size": 258,
    "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "attention_bias": true})";
  auto c = ParseModelConfig(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  auto back = ParseModelConfig(ModelConfigToJson(*c), "written");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->ParameterCount(), c->ParameterCount());
}

TEST(ModelConfig, RefusesWhatItCannotRunSayingWhy) {
  struct Case {
    std::string from, to, expect;
    StatusCode code;
  };
  const std::vector<Case> cases = {
      {"LlamaForCausalLM", "GPTNeoXForCausalLM", "GPTNeoXForCausalLM", StatusCode::kUnimplemented},
      {"\"silu\"", "\"gelu\"", "gelu", StatusCode::kUnimplemented},
      {"\"llama3\"", "\"su\"", "\"su\"", StatusCode::kUnimplemented},
      {"\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5", "multiple",
       StatusCode::kInvalidArgument},
      {"\"hidden_size\": 4096", "\"hidden_size\": \"big\"", "hidden_size",
       StatusCode::kInvalidArgument},
      {"\"vocab_size\": 128256,", "", "vocab_size", StatusCode::kInvalidArgument},
      {"{", "[", "not valid JSON", StatusCode::kInvalidArgument},
      {"\"max_position_embeddings\": 131072", "\"max_position_embeddings\": [1]",
       "max_position_embeddings", StatusCode::kInvalidArgument},
  };
  for (const Case& k : cases) {
    std::string j = kLlama3;
    j.replace(j.find(k.from), k.from.size(), k.to);
    auto c = ParseModelConfig(j, "cfg.json");
    EXPECT_EQ(c.status().code(), k.code) << k.to << ": " << c.status().ToString();
    EXPECT_NE(c.status().message().find(k.expect), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find("cfg.json"), std::string::npos);
  }
}

// Found by tests/fuzz/config_fuzz.cpp: a size past INT_MAX was cut down to
// an int (4336128256 vocab entries ran as 41160960), a context of 0 or less
// was taken, and sizes whose products overflow (q_dim, the parameter count)
// reached the engine.
TEST(ModelConfig, RefusesSizesTheEngineCannotHold) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"\"vocab_size\": 128256", "\"vocab_size\": 4336128256"},
      {"\"hidden_size\": 4096", "\"hidden_size\": 2147483648"},
      {"\"num_hidden_layers\": 32", "\"num_hidden_layers\": -32"},
      {"\"max_position_embeddings\": 131072", "\"max_position_embeddings\": 0"},
      {"\"max_position_embeddings\": 131072", "\"max_position_embeddings\": -1"},
      {"\"num_attention_heads\": 32", "\"num_attention_heads\": 32, \"head_dim\": 134217728"},
      {"\"num_hidden_layers\": 32", "\"num_hidden_layers\": 2000000000"},
  };
  for (const auto& [from, to] : cases) {
    std::string j = kLlama3;
    j.replace(j.find(from), from.size(), to);
    auto c = ParseModelConfig(j, "cfg.json");
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << to;
  }
}

TEST(ModelConfig, RoundTripsThroughJson) {
  const ModelConfig c = ParseModelConfig(kLlama3, "config.json").value();
  auto back = ParseModelConfig(ModelConfigToJson(c), "written");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->ParameterCount(), c.ParameterCount());
  EXPECT_EQ(back->rope_scaling.type, c.rope_scaling.type);
  EXPECT_EQ(back->rope_scaling.factor, c.rope_scaling.factor);
  EXPECT_EQ(back->max_context, c.max_context);
  EXPECT_EQ(back->eos_token_id, c.eos_token_id);
}

TEST(ModelConfig, TheFirstEosIdIsTheFirstOfTheIdsThatAreIds) {
  // config_fuzz found it: a first entry that is no id (a float here) was
  // dropped from eos_token_ids but made eos_token_id -1, so the written
  // config read back with another eos_token_id.
  std::string text = kLlama3;
  text.replace(text.find("[128001,"), 8, "[1.5e40,");
  const ModelConfig c = ParseModelConfig(text, "config.json").value();
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{128008, 128009}));
  EXPECT_EQ(c.eos_token_id, 128008);
  EXPECT_EQ(ParseModelConfig(ModelConfigToJson(c), "written")->eos_token_id, 128008);
}

TEST(ModelConfig, RoundTripsYarnDynamicAndWindowsThroughJson) {
  const std::string qwen = R"({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "max_position_embeddings": 4096, "use_sliding_window": true,
    "sliding_window": 100, "max_window_layers": 2, "rope_scaling": ROPE})";
  for (const std::string rope :
       {R"({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
            "beta_fast": 16, "truncate": false, "mscale": 0.7, "mscale_all_dim": 0.3})",
        R"({"rope_type": "dynamic", "factor": 2.5})", R"({"type": "linear", "factor": 3})"}) {
    std::string j = qwen;
    j.replace(j.find("ROPE"), 4, rope);
    const ModelConfig c = ParseModelConfig(j, "config.json").value();
    auto back = ParseModelConfig(ModelConfigToJson(c), "written");
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    const RopeScaling &a = c.rope_scaling, &b = back->rope_scaling;
    EXPECT_EQ(b.type, a.type) << rope;
    EXPECT_EQ(b.factor, a.factor);
    EXPECT_EQ(b.original_max_position_embeddings, a.original_max_position_embeddings);
    EXPECT_EQ(b.beta_fast, a.beta_fast);
    EXPECT_EQ(b.truncate, a.truncate);
    EXPECT_DOUBLE_EQ(b.attention_factor, a.attention_factor);
    EXPECT_EQ(b.dynamic_threshold, a.dynamic_threshold);
    EXPECT_EQ(back->max_context, c.max_context);
    EXPECT_EQ(back->sliding_window, 100);
    EXPECT_EQ(back->windowed_layers, c.windowed_layers);
  }
}

TEST(ModelConfig, GenerationConfigAddsTheIdsGenerateStopsOn) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("kdn-config-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::string j = kLlama3;
  j.replace(j.find("[128001, 128008, 128009]"), 24, "128001");
  std::ofstream(dir / "config.json") << j;
  auto c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{128001}));
  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": [128001, 128009]})";
  c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->eos_token_id, 128001);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{128001, 128009}));
  std::ofstream(dir / "generation_config.json") << "{";
  c = LoadModelConfig(dir);
  EXPECT_NE(c.status().message().find("generation_config.json"), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kdn::model
