#pragma once
// RoPE beyond the inverse frequencies: what the scaling types of
// docs/engine.md ("RoPE") add to a rotation, shared by the CPU engine and the
// CUDA kernels (host and device code; no CUDA headers needed).
//
// - yarn multiplies cos and sin by its attention factor (so q.k by its
//   square), as transformers does.
// - dynamic grows RoPE's base with the position once a sequence passes
//   max_position_embeddings. transformers computes one set of frequencies per
//   forward pass, from the pass's last position, and rotates every token of
//   the pass with it; kdn takes each token's own position (pos + 1 as the
//   length), which is what transformers does when it generates that token,
//   so that a token's KV depends on its prefix only (the KDN's keys promise
//   that), not on how the prompt was cut into passes.
//
// Everything else (default, linear, llama3, yarn's frequencies) is in the
// table of inverse frequencies (RopeInvFreq). Thread-safe (values).

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define KDN_ROPE_HD __host__ __device__
#else
#define KDN_ROPE_HD
#endif

namespace kdn::engine {

struct RopeParams {
  float attention_scaling = 1.0f;  // yarn: cos and sin are multiplied by it
  // dynamic: positions p with p + 1 > dynamic_threshold use the base
  // theta * (factor * (p + 1) / threshold - (factor - 1)) ^ (d / (d - 2)).
  // 0: no dynamic scaling.
  int64_t dynamic_threshold = 0;
  double dynamic_factor = 1.0;
  double theta = 10000.0;
  int head_dim = 0;
};

// The angle of frequency i at `position`: position * inv_freq[i], or with
// the position's own base under dynamic scaling. In double, as both engines
// form it (float angles are off by ~1e-3 rad at position 32K).
KDN_ROPE_HD inline double RopeAngle(const RopeParams& r, const float* inv_freq, int i,
                                    int64_t position) {
  if (r.dynamic_threshold > 0 && position + 1 > r.dynamic_threshold) {
    const double d = r.head_dim;
    const double g = r.dynamic_factor * static_cast<double>(position + 1) / r.dynamic_threshold -
                     (r.dynamic_factor - 1.0);
    const double base = r.theta * pow(g, d / (d - 2.0));
    // Rounded to float as transformers' float32 table is.
    const float f = static_cast<float>(1.0 / pow(base, 2.0 * i / d));
    return static_cast<double>(position) * f;
  }
  return static_cast<double>(position) * inv_freq[i];
}

}  // namespace kdn::engine

#undef KDN_ROPE_HD
