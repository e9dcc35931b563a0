#pragma once
// The CPU reference kernels of the engine: fp32, row-major. The CPU backend
// runs them, and every CUDA kernel is tested against them.

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kdn/engine/rope.h"
#include "kdn/model/config.h"

namespace kdn::engine {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, for `rows` rows of `dim`.
// out may alias x.
void RmsNorm(const float* x, const float* weight, float eps, int64_t rows, int dim, float* out);

// The head_dim/2 inverse frequencies of RoPE for `config`, with its
// rope_theta and its linear, yarn or llama3 scaling (as transformers 5.x
// computes them, in double precision here). Dynamic scaling starts from the
// plain table; RopeParamsFor says how it grows.
std::vector<float> RopeInvFreq(const model::ModelConfig& config);

// What a rotation of `config` adds to the table (rope.h): yarn's factor on
// cos and sin, dynamic scaling's growth.
RopeParams RopeParamsFor(const model::ModelConfig& config);

// Rotates, in place, `rows` rows of `heads` heads of `head_dim` floats; row r
// sits at position positions[r]. Hugging Face's "rotate half" pairing:
// element i pairs with element i + head_dim/2, and uses inv_freq[i] (and
// `rope`: RopeAngle). The default `rope` is a plain rotation.
void ApplyRope(float* x, int64_t rows, int heads, int head_dim, const int32_t* positions,
               const float* inv_freq, const RopeParams& rope = {});

// The rotation itself: turns `vectors` consecutive vectors of head_dim floats
// by the angles whose cosines and sines are cs and sn (head_dim / 2 each),
// with the same pairing. Serial (no OpenMP).
void RotateByAngles(float* x, int64_t vectors, int head_dim, const float* cs, const float* sn);

// out[r][i] = silu(gate_up[r][i]) * gate_up[r][inter + i]; gate_up is
// [rows][2*inter] (gate then up, as the fused projection writes them).
void SiluMul(const float* gate_up, int64_t rows, int inter, float* out);

// In-place softmax of `n` floats (max-subtracted; exp to ~2e-7 relative).
void Softmax(float* x, int64_t n);

// The attention weights of `rows` rotated query rows of one head (row r at
// q + r * ldq, head_dim floats) over `keys` keys ([keys][head_dim]
// contiguous), scaled by 1/sqrt(head_dim), into w ([rows][keys]): row r's
// softmax is over keys [0, visible + r + 1) (the keys before `visible`, then
// the rows' own keys causally, the rows' keys being the last); its later
// weights are 0. What KV pruning (prune::KvzipScores) and blend's question
// selection score cached tokens by. Rows in parallel (OpenMP).
void AttentionWeights(const float* q, int64_t ldq, int64_t rows, const float* k, int64_t keys,
                      int head_dim, int64_t visible, float* w);

// One row of RmsNorm (what RmsNorm runs for each row).
void RmsNormRow(const float* x, const float* weight, float eps, int dim, float* out);

// An additive bias on attention scores (KvSequence::AttentionBias): per_head
// holds one value for each query head of a group, added to the scores of
// the keys in `spans` ([begin, end), ascending). per_head null: none.
struct ScoreBias {
  const float* per_head = nullptr;
  std::span<const std::pair<int64_t, int64_t>> spans;
};

// One query row of `heads` heads that share a KV head (grouped-query
// attention) attending over paged keys and values: key p (lo <= p < ctx) is
// k_blocks[p / 16] + (p % 16) * stride (values alike); for head h,
// out[h * head_dim ..] = sum_p softmax_p(scale * q_h.k_p) v_p, q_h being
// q[h * head_dim ..]. `scores` holds heads * (ctx - lo) floats of scratch.
// What decode attention runs per (sequence, KV head): one call, the key
// loop inside, each key and value read once for the group. A key p below
// hole_end whose holes[p] is not 0 gets no weight (pruned KV's holes:
// KvSequence::Holes); `bias` is added to the scaled scores of its keys
// before the softmax.
void AttendPagedGroup(const float* q, int heads, const float* const* k_blocks,
                      const float* const* v_blocks, int64_t stride, int64_t lo, int64_t ctx,
                      int head_dim, float scale, float* scores, float* out,
                      const uint8_t* holes = nullptr, int64_t hole_end = 0,
                      const ScoreBias& bias = {});
// AttendPagedGroup for two rows of one sequence at once (query q0 and q1,
// contexts ctx0 and ctx1, lo shared, no hole), each row's output bit for
// bit what AttendPagedGroup gives it alone; the keys and values are read
// once for both. `scores` holds heads * (ctx0 + ctx1 - 2 lo) floats. False
// (nothing computed) where this CPU has no two-row kernel for the shape:
// then the caller makes two one-row calls.
bool AttendPagedPair(const float* q0, const float* q1, int heads, const float* const* k_blocks,
                     const float* const* v_blocks, int64_t stride, int64_t lo, int64_t ctx0,
                     int64_t ctx1, int head_dim, float scale, float* scores, float* out0,
                     float* out1);

// sum a[i] * b[i], and y += alpha * x, over n floats.
float Dot(const float* a, const float* b, int n);
void Axpy(float alpha, const float* x, int n, float* y);

}  // namespace kdn::engine
