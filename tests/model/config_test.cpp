#include "kdn/model/config.h"

#include <gtest/gtest.h>

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
  EXPECT_TRUE(c->rope_scaling.llama3);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(c->eos_token_id, 128001);
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

TEST(ModelConfig, MistralSlidingWindowBoundsTheContext) {
  const char* j = R"({"architectures": ["MistralForCausalLM"], "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
    "sliding_window": 4096})";
  auto c = ParseModelConfig(j, "config.json");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->max_context, 4096);
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
      {"\"llama3\"", "\"yarn\"", "yarn", StatusCode::kUnimplemented},
      {"\"num_key_value_heads\": 8", "\"num_key_value_heads\": 5", "multiple", StatusCode::kInvalidArgument},
      {"\"hidden_size\": 4096", "\"hidden_size\": \"big\"", "hidden_size", StatusCode::kInvalidArgument},
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
  EXPECT_EQ(back->rope_scaling.llama3, c.rope_scaling.llama3);
  EXPECT_EQ(back->rope_scaling.factor, c.rope_scaling.factor);
  EXPECT_EQ(back->max_context, c.max_context);
  EXPECT_EQ(back->eos_token_id, c.eos_token_id);
}

}  // namespace
}  // namespace kdn::model
