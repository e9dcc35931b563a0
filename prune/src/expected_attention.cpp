#include "kdn/prune/expected_attention.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kdn/engine/cpu_ops.h"
#include "kdn/engine/rope.h"

namespace kdn::prune {

namespace {

// RoPE's rotation averaged over positions [first, first + count): per
// frequency i, the mean cosine and sine (the matrix is cos I + sin P, with P
// pairing dimension i with i + d/2, as the engine's RoPE does).
void AveragedRotation(const model::ModelConfig& config, int64_t first, int count,
                      std::vector<double>* cs, std::vector<double>* sn) {
  const std::vector<float> inv_freq = engine::RopeInvFreq(config);
  const engine::RopeParams rope = engine::RopeParamsFor(config);
  const int half = config.head_dim / 2;
  cs->assign(half, 0.0);
  sn->assign(half, 0.0);
  for (int64_t p = first; p < first + count; ++p) {
    for (int i = 0; i < half; ++i) {
      const double a = engine::RopeAngle(rope, inv_freq.data(), i, p);
      (*cs)[i] += static_cast<float>(std::cos(a)) * rope.attention_scaling;
      (*sn)[i] += static_cast<float>(std::sin(a)) * rope.attention_scaling;
    }
  }
  for (int i = 0; i < half; ++i) {
    (*cs)[i] /= count;
    (*sn)[i] /= count;
  }
}

// y = R x for the averaged rotation (x, y of head_dim; may not alias).
void Rotate(const std::vector<double>& cs, const std::vector<double>& sn, const double* x,
            int64_t stride, double* y, int64_t ystride) {
  const size_t half = cs.size();
  for (size_t i = 0; i < half; ++i) {
    const double a = x[i * stride], b = x[(i + half) * stride];
    y[i * ystride] = cs[i] * a - sn[i] * b;
    y[(i + half) * ystride] = cs[i] * b + sn[i] * a;
  }
}

}  // namespace

Result<Scores> ExpectedAttentionScores(const model::ModelConfig& c, const engine::KvCache& kv,
                                       const engine::KvSequence& seq, int64_t tokens,
                                       const engine::QueryStats& stats,
                                       const ExpectedAttentionOptions& o) {
  const int sinks = o.sinks;
  if (sinks < 0 || tokens <= sinks || tokens > seq.length()) {
    return InvalidArgument("expected attention: a context of " + std::to_string(tokens) +
                           " tokens (" + std::to_string(seq.length()) +
                           " held) has none past its " + std::to_string(sinks) + " sink tokens");
  }
  if (stats.skip != sinks || stats.count <= 0 || stats.sum.empty()) {
    return InvalidArgument("expected attention: query statistics of " +
                           std::to_string(stats.count) + " rows past " +
                           std::to_string(stats.skip) + " sinks, for " + std::to_string(sinks));
  }
  if (o.future_positions <= 0) {
    return InvalidArgument("expected attention: future_positions must be positive");
  }
  const int hd = c.head_dim, H = c.num_heads, G = c.num_kv_heads, group = H / G;
  const int64_t kvd = c.kv_dim(), n = tokens - sinks;
  std::vector<double> cs, sn;
  AveragedRotation(c, tokens, o.future_positions, &cs, &sn);
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(hd));
  const double rows = static_cast<double>(stats.count);

  Scores out{c.num_layers, G, tokens, std::vector<float>(size_t(c.num_layers) * G * tokens)};
  std::vector<float> layer_kv(2 * tokens * kvd);
  for (int l = 0; l < c.num_layers; ++l) {
    KDN_RETURN_IF_ERROR(
        kv.Read(seq, l, 0, tokens, engine::DType::kF32,
                {reinterpret_cast<uint8_t*>(layer_kv.data()), layer_kv.size() * sizeof(float)}));
    const float* K = layer_kv.data();
    const float* V = K + tokens * kvd;
    // Per query head: its softmaxed expected attention over the non-sink tokens.
    std::vector<double> attn(size_t(H) * n);
#pragma omp parallel for schedule(dynamic, 1)
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      const size_t at = (size_t(l) * H + h) * hd;
      std::vector<double> mu0(hd), mu(hd), S0(size_t(hd) * hd), T(size_t(hd) * hd),
          S(size_t(hd) * hd), Sk(hd);
      for (int i = 0; i < hd; ++i) mu0[i] = stats.sum[at + i] / rows;
      for (int i = 0; i < hd; ++i) {
        for (int j = 0; j < hd; ++j) {
          S0[size_t(i) * hd + j] =
              stats.outer[at * hd + size_t(i) * hd + j] / rows - mu0[i] * mu0[j];
        }
      }
      Rotate(cs, sn, mu0.data(), 1, mu.data(), 1);
      // S = R S0 R^T: R on S0's columns, then on the result's rows.
      for (int j = 0; j < hd; ++j) Rotate(cs, sn, &S0[j], hd, &T[j], hd);
      for (int i = 0; i < hd; ++i) Rotate(cs, sn, &T[size_t(i) * hd], 1, &S[size_t(i) * hd], 1);
      double* z = &attn[size_t(h) * n];
      double zmax = -INFINITY;
      for (int64_t t = 0; t < n; ++t) {
        const float* k = K + (sinks + t) * kvd + int64_t{g} * hd;
        double dot = 0.0, quad = 0.0;
        for (int i = 0; i < hd; ++i) dot += mu[i] * k[i];
        if (o.use_covariance) {
          for (int i = 0; i < hd; ++i) {
            const double* row = &S[size_t(i) * hd];
            double s = 0.0;
            for (int j = 0; j < hd; ++j) s += row[j] * k[j];
            quad += s * k[i];
          }
        }
        z[t] = dot * inv_sqrt_d + quad / hd / 2.0;
        zmax = std::max(zmax, z[t]);
      }
      double total = 0.0;
      for (int64_t t = 0; t < n; ++t) total += (z[t] = std::exp(z[t] - zmax));
      for (int64_t t = 0; t < n; ++t) z[t] /= total;
    }
    float best = -INFINITY;
    for (int g = 0; g < G; ++g) {
      for (int64_t t = 0; t < n; ++t) {
        double s = 0.0;
        for (int h = g * group; h < (g + 1) * group; ++h) s += attn[size_t(h) * n + t];
        s /= group;
        if (o.use_value_norm) {
          const float* v = V + (sinks + t) * kvd + int64_t{g} * hd;
          double norm = 0.0;
          for (int i = 0; i < hd; ++i) norm += double{v[i]} * v[i];
          s = (s + o.epsilon) * std::sqrt(norm);
        }
        out.at(l, g, sinks + t) = static_cast<float>(s);
        best = std::max(best, static_cast<float>(s));
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int t = 0; t < sinks; ++t) out.at(l, g, t) = best + 1.0f;
    }
  }
  return out;
}

}  // namespace kdn::prune
