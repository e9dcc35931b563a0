#include "kdn/engine/presets.h"

#include <gtest/gtest.h>

#include "kdn/engine/cpu_ops.h"
#include "kdn/model/config.h"

namespace kdn::engine {
namespace {

TEST(Presets, RoundTripThroughConfigJson) {
  for (const Preset& p : Presets()) {
    auto c = model::ParseModelConfig(model::ModelConfigToJson(p.config), p.name);
    ASSERT_TRUE(c.ok()) << p.name << ": " << c.status().ToString();
    EXPECT_EQ(c->ParameterCount(), p.config.ParameterCount()) << p.name;
    EXPECT_EQ(c->qkv_bias, p.config.qkv_bias) << p.name;
    EXPECT_EQ(c->rope_scaling.type, p.config.rope_scaling.type) << p.name;
    EXPECT_EQ(c->max_context, p.config.max_context) << p.name;
  }
}

TEST(Presets, SmallHasAtLeastSixteenLayersAndTensOfMillionsOfParameters) {
  const model::ModelConfig c = FindPreset("small").value().config;
  EXPECT_GE(c.num_layers, 16);
  EXPECT_GT(c.ParameterCount(), 20'000'000);
  EXPECT_LT(c.ParameterCount(), 100'000'000);
  EXPECT_EQ(FindPreset("nope").status().code(), StatusCode::kNotFound);
}

TEST(RopeInvFreq, Llama3ScalingKeepsHighFrequenciesAndSlowsLowOnes) {
  const model::ModelConfig c = FindPreset("llama3-8b").value().config;  // Llama 3.1's scaling
  ASSERT_EQ(c.rope_scaling.type, model::RopeType::kLlama3);
  ASSERT_EQ(c.rope_scaling.factor, 8.0);
  model::ModelConfig plain = c;
  plain.rope_scaling = {};
  const auto scaled = RopeInvFreq(c), base = RopeInvFreq(plain);
  EXPECT_FLOAT_EQ(scaled.front(), base.front());       // wavelength 2*pi: kept
  EXPECT_FLOAT_EQ(scaled.back(), base.back() / 8.0f);  // longest: divided by factor
}

}  // namespace
}  // namespace kdn::engine
