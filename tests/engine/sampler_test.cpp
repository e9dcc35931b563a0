#include "kdn/engine/sampler.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <vector>

namespace kdn::engine {
namespace {

const std::vector<float> kLogits = {1.0f, 3.0f, 2.5f, -1.0f, 0.0f, 2.9f};

std::map<int32_t, int> Histogram(model::SamplingParams p, int n) {
  Sampler s(p);
  std::map<int32_t, int> h;
  for (int i = 0; i < n; ++i) ++h[s.Sample(kLogits)];
  return h;
}

TEST(Sampler, ZeroTemperatureAndTopKOneAreGreedy) {
  EXPECT_EQ(Argmax(kLogits), 1);
  EXPECT_EQ(Sampler({.temperature = 0.0f}).Sample(kLogits), 1);
  Sampler k1({.temperature = 5.0f, .top_k = 1, .seed = 3});
  for (int i = 0; i < 50; ++i) EXPECT_EQ(k1.Sample(kLogits), 1);
}

TEST(Sampler, ASeedReproducesTheSameDrawsAndAnotherSeedDoesNot) {
  auto draw = [](uint64_t seed) {
    Sampler s({.temperature = 1.0f, .seed = seed});
    std::vector<int32_t> v;
    for (int i = 0; i < 64; ++i) v.push_back(s.Sample(kLogits));
    return v;
  };
  EXPECT_EQ(draw(42), draw(42));
  EXPECT_NE(draw(42), draw(43));
}

TEST(Sampler, TopKDrawsOnlyTheKLargest) {
  auto h = Histogram({.temperature = 2.0f, .top_k = 3, .seed = 1}, 3000);
  std::set<int32_t> seen;
  for (auto& [id, n] : h) seen.insert(id);
  EXPECT_EQ(seen, (std::set<int32_t>{1, 2, 5}));
}

TEST(Sampler, TopPKeepsTheSmallestSetReachingP) {
  // Softmax of kLogits: token 1 has ~0.37, 5 ~0.33, 2 ~0.22: p = 0.6 keeps {1, 5}.
  auto h = Histogram({.temperature = 1.0f, .top_p = 0.6f, .seed = 2}, 3000);
  std::set<int32_t> seen;
  for (auto& [id, n] : h) seen.insert(id);
  EXPECT_EQ(seen, (std::set<int32_t>{1, 5}));
}

TEST(Sampler, FrequenciesFollowTheSoftmaxAtTheTemperature) {
  const float t = 0.7f;
  const int n = 40000;
  auto h = Histogram({.temperature = t, .seed = 5}, n);
  double z = 0.0;
  for (float l : kLogits) z += std::exp(l / t);
  for (size_t i = 0; i < kLogits.size(); ++i) {
    const double p = std::exp(kLogits[i] / t) / z;
    const double sd = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(static_cast<double>(h[i]) / n, p, 5 * sd + 1e-4) << "token " << i;
  }
}

}  // namespace
}  // namespace kdn::engine
