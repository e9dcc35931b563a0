#include "kdn/engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace kdn::engine {

int32_t Argmax(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

namespace {
uint64_t SplitMix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

Sampler::Sampler(const model::SamplingParams& params) : params_(params) {
  uint64_t x = params.seed;
  for (uint64_t& s : s_) s = SplitMix64(x);
}

double Sampler::NextUniform() {
  const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = Rotl(s_[3], 45);
  return static_cast<double>(result >> 11) * 0x1.0p-53;
}

void Sampler::Advance(int samples) {
  // Sample draws one number exactly when it does not reduce to argmax.
  if (params_.temperature <= 0.0f || params_.top_k == 1) return;
  for (int i = 0; i < samples; ++i) (void)NextUniform();
}

double Sampler::NextDraw() {
  if (params_.temperature <= 0.0f || params_.top_k == 1) return -1.0;
  return NextUniform();
}

int32_t Sampler::Sample(std::span<const float> logits) {
  if (params_.temperature <= 0.0f || params_.top_k == 1) return Argmax(logits);
  const int n = static_cast<int>(logits.size());
  // Candidates by descending logit (ties: lower id first), cut to top_k.
  std::vector<int32_t> idx(n);
  std::iota(idx.begin(), idx.end(), 0);
  const int k = params_.top_k > 0 ? std::min(params_.top_k, n) : n;
  auto cmp = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), cmp);
  idx.resize(k);
  std::vector<double> p(k);
  const double mx = logits[idx[0]];
  double sum = 0.0;
  for (int i = 0; i < k; ++i) {
    p[i] = std::exp((logits[idx[i]] - mx) / params_.temperature);
    sum += p[i];
  }
  // top_p: the smallest prefix whose mass reaches top_p (at least one token).
  int keep = k;
  if (params_.top_p < 1.0f) {
    double acc = 0.0;
    for (int i = 0; i < k; ++i) {
      acc += p[i] / sum;
      if (acc >= params_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double total = 0.0;
  for (int i = 0; i < keep; ++i) total += p[i];
  double u = NextUniform() * total;
  for (int i = 0; i < keep; ++i) {
    u -= p[i];
    if (u < 0.0) return idx[i];
  }
  return idx[keep - 1];
}

}  // namespace kdn::engine
