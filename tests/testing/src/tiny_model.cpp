#include "kdn/testing/tiny_model.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "kdn/engine/presets.h"

namespace kdn::testing {

std::unique_ptr<engine::CpuEngine> MakeModel(const std::string& preset, uint64_t seed,
                                             engine::EngineOptions options) {
  auto p = engine::FindPreset(preset);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  if (!p.ok()) return nullptr;
  if (options.threads == 0) options.threads = 1;
  auto m = engine::CpuEngine::Create(p->config, engine::GenerateWeights(p->config, seed, p->dtype),
                                     options);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::move(m).value() : nullptr;
}

Status WriteTinyModel(const std::filesystem::path& dir, const std::string& preset) {
  KDN_ASSIGN_OR_RETURN(engine::Preset p, engine::FindPreset(preset));
  return engine::WriteModelFolder(dir, p.config, 1, p.dtype);
}

std::vector<int32_t> RandomTokens(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return t;
}

double RelError(const float* a, const float* b, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    num = std::max(num, std::fabs(static_cast<double>(a[i]) - b[i]));
    den = std::max(den, std::fabs(static_cast<double>(b[i])));
  }
  return den == 0.0 ? num : num / den;
}

float MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float d = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}

std::vector<float> AnswerOver(engine::CpuEngine& model, engine::KvSequence& seq,
                              const std::vector<int32_t>& question) {
  std::vector<float> all, step;
  EXPECT_TRUE(model.Prefill(seq, question, {.all_logits = true}, &all).ok());
  engine::KvSequence* batch[] = {&seq};
  for (int32_t t : {5, 6, 7}) {
    const int32_t tok[] = {t};
    EXPECT_TRUE(model.DecodeStep(batch, tok, &step).ok());
    all.insert(all.end(), step.begin(), step.end());
  }
  return all;
}

}  // namespace kdn::testing
