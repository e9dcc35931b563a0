#include "kdn/engine/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace kdn::engine {

void RmsNorm(const float* x, const float* weight, float eps, int64_t rows, int dim, float* out) {
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* o = out + r * dim;
    double ss = 0.0;
    for (int i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
    for (int i = 0; i < dim; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

std::vector<float> RopeInvFreq(const ModelConfig& config) {
  const int half = config.head_dim / 2;
  std::vector<float> inv(half);
  const RopeScaling& s = config.rope_scaling;
  const double low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
  const double high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
  for (int i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(config.rope_theta, (2.0 * i) / config.head_dim);
    if (s.llama3) {
      // Llama 3.1: long wavelengths are slowed by `factor`, short ones kept,
      // and the band between is interpolated smoothly.
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen > low_freq_wavelen) {
        f /= s.factor;
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        f = (1.0 - smooth) * f / s.factor + smooth * f;
      }
    }
    inv[i] = static_cast<float>(f);
  }
  return inv;
}

void ApplyRope(float* x, int64_t rows, int heads, int head_dim, const int32_t* positions,
               const float* inv_freq) {
  const int half = head_dim / 2;
#pragma omp parallel if (rows >= 16)
  {
    std::vector<float> cs(half), sn(half);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      for (int i = 0; i < half; ++i) {
        // The angle in double: float32 loses ~1e-3 rad at position 32K.
        const double a = static_cast<double>(positions[r]) * inv_freq[i];
        cs[i] = static_cast<float>(std::cos(a));
        sn[i] = static_cast<float>(std::sin(a));
      }
      for (int h = 0; h < heads; ++h) {
        float* v = x + (r * heads + h) * head_dim;
        for (int i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * cs[i] - b * sn[i];
          v[i + half] = b * cs[i] + a * sn[i];
        }
      }
    }
  }
}

void SiluMul(const float* gate_up, int64_t rows, int inter, float* out) {
#pragma omp parallel for schedule(static) if (rows >= 4)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * static_cast<int64_t>(inter);
    const float* u = g + inter;
    float* o = out + r * inter;
    for (int i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

void Softmax(float* x, int64_t n) {
  float mx = -INFINITY;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - mx);
    sum += x[i];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace kdn::engine
