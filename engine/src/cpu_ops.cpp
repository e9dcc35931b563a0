#include "kdn/engine/cpu_ops.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numbers>

#include <cblas.h>

#include "quant_kernels.h"

namespace kdn::engine {

// The hot loops are compiled for AVX-512, AVX2 and baseline x86-64 and the
// best one is picked at load time, so one binary runs everywhere and fast.
// Not under ThreadSanitizer: the loader calls the picking function (an ifunc
// resolver) before TSan's runtime is up, and the instrumented resolver
// crashes there.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define KDN_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KDN_CPU_CLONES
#endif

namespace {

// e^x to ~2e-7 relative error over the float range, in straight-line code the
// compiler vectorises (libm's expf is a call per element). Cody-Waite range
// reduction x = n ln2 + r, |r| <= ln2/2, then a degree-6 Taylor polynomial.
inline float FastExp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

}  // namespace

KDN_CPU_CLONES
void RmsNormRow(const float* xr, const float* weight, float eps, int dim, float* o) {
  double ss = 0.0;
#pragma omp simd reduction(+ : ss)
  for (int i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
#pragma omp simd
  for (int i = 0; i < dim; ++i) o[i] = weight[i] * (xr[i] * inv);
}

void RmsNorm(const float* x, const float* weight, float eps, int64_t rows, int dim, float* out) {
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) RmsNormRow(x + r * dim, weight, eps, dim, out + r * dim);
}

std::vector<float> RopeInvFreq(const model::ModelConfig& config) {
  const int half = config.head_dim / 2;
  const double dim = config.head_dim;
  std::vector<float> inv(half);
  const model::RopeScaling& s = config.rope_scaling;
  const double original = static_cast<double>(s.original_max_position_embeddings);
  // yarn: frequencies that turn fewer than beta_slow times over the original
  // context are interpolated (divided by factor), those that turn more than
  // beta_fast times are kept, and a linear ramp over the dimensions joins them.
  double ramp_low = 0, ramp_high = 0;
  if (s.type == model::RopeType::kYarn) {
    auto correction_dim = [&](double rotations) {
      return dim * std::log(original / (rotations * 2.0 * std::numbers::pi)) /
             (2.0 * std::log(config.rope_theta));
    };
    ramp_low = correction_dim(s.beta_fast);
    ramp_high = correction_dim(s.beta_slow);
    if (s.truncate) {
      ramp_low = std::floor(ramp_low);
      ramp_high = std::ceil(ramp_high);
    }
    ramp_low = std::max(ramp_low, 0.0);
    ramp_high = std::min(ramp_high, dim - 1);
    if (ramp_low == ramp_high) ramp_high += 0.001;  // as transformers: no division by zero
  }
  const double low_freq_wavelen = original / s.low_freq_factor;
  const double high_freq_wavelen = original / s.high_freq_factor;
  for (int i = 0; i < half; ++i) {
    double f = 1.0 / std::pow(config.rope_theta, (2.0 * i) / dim);
    switch (s.type) {
      case model::RopeType::kLinear: f /= s.factor; break;
      case model::RopeType::kYarn: {
        const double ramp = std::clamp((i - ramp_low) / (ramp_high - ramp_low), 0.0, 1.0);
        f = f / s.factor * ramp + f * (1.0 - ramp);
        break;
      }
      case model::RopeType::kLlama3: {
        // Llama 3.1: long wavelengths are slowed by `factor`, short ones kept,
        // and the band between is interpolated smoothly.
        const double wavelen = 2.0 * std::numbers::pi / f;
        if (wavelen > low_freq_wavelen) {
          f /= s.factor;
        } else if (wavelen >= high_freq_wavelen) {
          const double smooth =
              (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          f = (1.0 - smooth) * f / s.factor + smooth * f;
        }
        break;
      }
      case model::RopeType::kDefault:
      case model::RopeType::kDynamic:  // grows per position: RopeParamsFor
        break;
    }
    inv[i] = static_cast<float>(f);
  }
  return inv;
}

RopeParams RopeParamsFor(const model::ModelConfig& config) {
  RopeParams r;
  const model::RopeScaling& s = config.rope_scaling;
  if (s.type == model::RopeType::kYarn)
    r.attention_scaling = static_cast<float>(s.attention_factor);
  if (s.type == model::RopeType::kDynamic) {
    r.dynamic_threshold = s.dynamic_threshold;
    r.dynamic_factor = s.factor;
  }
  r.theta = config.rope_theta;
  r.head_dim = config.head_dim;
  return r;
}

void ApplyRope(float* x, int64_t rows, int heads, int head_dim, const int32_t* positions,
               const float* inv_freq, const RopeParams& rope) {
  const int half = head_dim / 2;
#pragma omp parallel if (rows >= 16)
  {
    // On the stack for heads up to 512 wide (no allocation per decode step).
    constexpr int kStackHalf = 256;
    float cs_stack[kStackHalf], sn_stack[kStackHalf];
    std::vector<float> cs_heap, sn_heap;
    if (half > kStackHalf) {
      cs_heap.resize(half);
      sn_heap.resize(half);
    }
    float* cs = half > kStackHalf ? cs_heap.data() : cs_stack;
    float* sn = half > kStackHalf ? sn_heap.data() : sn_stack;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      for (int i = 0; i < half; ++i) {
        // The angle in double: float32 loses ~1e-3 rad at position 32K.
        const double a = RopeAngle(rope, inv_freq, i, positions[r]);
        cs[i] = static_cast<float>(std::cos(a)) * rope.attention_scaling;
        sn[i] = static_cast<float>(std::sin(a)) * rope.attention_scaling;
      }
      RotateByAngles(x + r * heads * head_dim, heads, head_dim, cs, sn);
    }
  }
}

void RotateByAngles(float* x, int64_t vectors, int head_dim, const float* cs, const float* sn) {
  const int half = head_dim / 2;
  for (int64_t h = 0; h < vectors; ++h) {
    float* v = x + h * head_dim;
    for (int i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cs[i] - b * sn[i];
      v[i + half] = b * cs[i] + a * sn[i];
    }
  }
}

namespace {
KDN_CPU_CLONES
void SiluMulRow(const float* g, const float* u, int inter, float* o) {
#pragma omp simd
  for (int i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + FastExp(-g[i])) * u[i];
}
}  // namespace

void SiluMul(const float* gate_up, int64_t rows, int inter, float* out) {
#pragma omp parallel for schedule(static) if (rows >= 4)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate_up + r * 2 * static_cast<int64_t>(inter);
    SiluMulRow(g, g + inter, inter, out + r * inter);
  }
}

KDN_CPU_CLONES
void AttentionWeights(const float* q, int64_t ldq, int64_t rows, const float* k, int64_t keys,
                      int head_dim, int64_t visible, float* w) {
  if (rows <= 0 || keys <= 0) return;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
              static_cast<int>(keys), head_dim, scale, q, static_cast<int>(ldq), k, head_dim, 0.0f,
              w, static_cast<int>(keys));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t seen = std::min(keys, visible + r + 1);
    Softmax(&w[r * keys], seen);
    std::fill(&w[r * keys + seen], &w[(r + 1) * keys], 0.0f);
  }
}

KDN_CPU_CLONES
void Softmax(float* x, int64_t n) {
  // The maximum in 16 lanes (a > b ? a : b is one vector max; std::max
  // under a reduction clause stays a scalar chain). Any order gives the same
  // maximum, up to the sign of a zero, which changes no weight below.
  float lanes[16];
  for (float& m : lanes) m = -INFINITY;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
#pragma omp simd
    for (int j = 0; j < 16; ++j) lanes[j] = lanes[j] > x[i + j] ? lanes[j] : x[i + j];
  }
  float mx = -INFINITY;
  for (float m : lanes) mx = std::max(mx, m);
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    // -inf (a masked key) weighs exactly nothing; FastExp alone clamps.
    x[i] = x[i] == -INFINITY ? 0.0f : FastExp(x[i] - mx);
    sum += x[i];
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // every key masked: no weight
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= inv;
}

KDN_CPU_CLONES
void AttendPagedGroup(const float* q, int heads, const float* const* k_blocks,
                      const float* const* v_blocks, int64_t stride, int64_t lo, int64_t ctx, int hd,
                      float scale, float* scores, float* out, const uint8_t* holes,
                      int64_t hole_end, const ScoreBias& bias) {
  // AVX-512 where the CPU has it and the group fits its registers.
  const internal::AttendRowsFn fast =
      hole_end > 0 || bias.per_head != nullptr ? nullptr : internal::FastAttendRows(hd, heads, 1);
  if (fast != nullptr) {
    return fast({{q, nullptr},
                 {out, nullptr},
                 {scores, nullptr},
                 {ctx, 0},
                 k_blocks,
                 v_blocks,
                 stride,
                 lo,
                 scale});
  }
  constexpr int64_t kBlock = 16;  // kKvBlockTokens
  const int64_t n = ctx - lo;
  for (int h = 0; h < heads; ++h) {
    const float* qh = q + h * hd;
    float* sh = scores + h * n;
    for (int64_t p = lo; p < ctx; ++p) {
      const float* kp = k_blocks[p / kBlock] + (p % kBlock) * stride;
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int i = 0; i < hd; ++i) s += qh[i] * kp[i];
      sh[p - lo] = s * scale;
    }
    if (bias.per_head != nullptr) {
      for (const auto& [begin, end] : bias.spans) {
        for (int64_t p = std::max(begin, lo); p < std::min(end, ctx); ++p) {
          sh[p - lo] += bias.per_head[h];
        }
      }
    }
    for (int64_t p = lo; p < std::min(hole_end, ctx); ++p) {
      if (holes[p] != 0) sh[p - lo] = -INFINITY;
    }
    Softmax(sh, n);
    float* oh = out + h * hd;
    for (int i = 0; i < hd; ++i) oh[i] = 0.0f;
    for (int64_t p = lo; p < ctx; ++p) {
      const float* vp = v_blocks[p / kBlock] + (p % kBlock) * stride;
      const float w = sh[p - lo];
#pragma omp simd
      for (int i = 0; i < hd; ++i) oh[i] += w * vp[i];
    }
  }
}

bool AttendPagedPair(const float* q0, const float* q1, int heads, const float* const* k_blocks,
                     const float* const* v_blocks, int64_t stride, int64_t lo, int64_t ctx0,
                     int64_t ctx1, int hd, float scale, float* scores, float* out0, float* out1) {
  const internal::AttendRowsFn fast = internal::FastAttendRows(hd, heads, 2);
  if (fast == nullptr) return false;
  fast({{q0, q1},
        {out0, out1},
        {scores, scores + heads * (ctx0 - lo)},
        {ctx0, ctx1},
        k_blocks,
        v_blocks,
        stride,
        lo,
        scale});
  return true;
}

KDN_CPU_CLONES
float Dot(const float* a, const float* b, int n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

KDN_CPU_CLONES
void Axpy(float alpha, const float* x, int n, float* y) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace kdn::engine
