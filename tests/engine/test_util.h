#pragma once
// Helpers shared by the engine tests: small generated models and comparisons.

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kdn/engine/cpu_engine.h"
#include "kdn/engine/presets.h"

namespace kdn::engine::testing {

// A model built in memory from a preset (no files).
inline std::unique_ptr<CpuEngine> MakeModel(const std::string& preset, uint64_t seed = 7,
                                            EngineOptions options = {}) {
  auto p = FindPreset(preset);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  if (options.threads == 0) options.threads = 1;  // tests run side by side
  auto m = CpuEngine::Create(p->config, GenerateWeights(p->config, seed, p->dtype), options);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::move(m).value() : nullptr;
}

inline std::vector<int32_t> RandomTokens(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (int& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// A test name for a preset parameter ("tiny-qwen2" -> "tiny_qwen2").
struct PresetTestName {
  template <typename Param>
  std::string operator()(const ::testing::TestParamInfo<Param>& info) const {
    std::string s = info.param;
    for (char& ch : s) {
      if (ch == '-') ch = '_';
    }
    return s;
  }
};

// max |a - b| / max |b|: the error relative to the scale of the reference.
inline double RelError(const float* a, const float* b, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return den == 0.0 ? num : num / den;
}

// A fresh temporary folder, removed with the object.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("kdn_test_" + std::string(info->test_suite_name()) + "_" + info->name() + "_" +
             std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace kdn::engine::testing
