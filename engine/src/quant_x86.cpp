// The traits table's vector dot products of the float formats and decode
// attention's row (quant_kernels.h); the quantized formats' are in
// quant_panels_x86.cpp. Each function carries its instruction set as a
// target attribute, so that the file builds for baseline x86-64 and the
// CPU's own is chosen at run time (BestDotIsa).
#include "quant_kernels.h"

#include "kdn/common/half.h"
#include "kdn/engine/cpu_ops.h"

#include <cmath>
#include <cstring>
#include <vector>

namespace kdn::engine::internal {

#if defined(__x86_64__)

namespace {

using model::GgmlType;

KDN_AVX2 inline float Half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

KDN_AVX2 inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

KDN_AVX2 inline __m256i Load32(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

// Eight floats of a F32, F16 or BF16 row from value i.
template <GgmlType T>
KDN_AVX2 inline __m256 Load8(const uint8_t* w, int64_t i) {
  if constexpr (T == GgmlType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(w) + i);
  } else if constexpr (T == GgmlType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * i)));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 2 * i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

template <GgmlType T>
KDN_AVX2 inline float Load1(const uint8_t* w, int64_t i) {
  if constexpr (T == GgmlType::kF32) {
    float f;
    std::memcpy(&f, w + 4 * i, 4);
    return f;
  } else if constexpr (T == GgmlType::kF16) {
    return Half(w + 2 * i);
  } else {
    uint16_t h;
    std::memcpy(&h, w + 2 * i, 2);
    return Bf16ToF32(h);
  }
}

template <GgmlType T>
KDN_AVX2 float FloatDotAvx2(const uint8_t* w, const void* xv, int64_t n) {
  const auto* x = static_cast<const float*>(xv);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(Load8<T>(w, i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(Load8<T>(w, i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(Load8<T>(w, i), _mm256_loadu_ps(x + i), a0);
  float s = HSum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) s += Load1<T>(w, i) * x[i];
  return s;
}

// Sixteen floats of a F32, F16 or BF16 row from value i.
template <GgmlType T>
KDN_AVX512 inline __m512 Load16(const uint8_t* w, int64_t i) {
  if constexpr (T == GgmlType::kF32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(w) + i);
  } else if constexpr (T == GgmlType::kF16) {
    return _mm512_cvtph_ps(Load32(w + 2 * i));
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(Load32(w + 2 * i)), 16));
  }
}

// One F32, F16 or BF16 weight row against kRows float rows (x_stride bytes
// apart): each 16 weights loaded once for all of them. As for the quantized
// formats, a row's sum is taken in the same order whatever kRows is, and the
// one-row dot product is kRows 1.
template <GgmlType T, int kRows>
KDN_AVX512 void FloatDotRowsAvx512(const uint8_t* w, const uint8_t* xv, int64_t x_stride, int64_t n,
                                   float* out) {
  const float* x[kRows];
  __m512 a0[kRows], a1[kRows];
  for (int r = 0; r < kRows; ++r) {
    x[r] = reinterpret_cast<const float*>(xv + r * x_stride);
    a0[r] = _mm512_setzero_ps();
    a1[r] = _mm512_setzero_ps();
  }
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 w0 = Load16<T>(w, i), w1 = Load16<T>(w, i + 16);
    for (int r = 0; r < kRows; ++r) {
      a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[r] + i), a0[r]);
      a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[r] + i + 16), a1[r]);
    }
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 w0 = Load16<T>(w, i);
    for (int r = 0; r < kRows; ++r) a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[r] + i), a0[r]);
  }
  for (int r = 0; r < kRows; ++r) {
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
    for (int64_t j = i; j < n; ++j) s = std::fma(Load1<T>(w, j), x[r][j], s);
    out[r] = s;
  }
}

template <GgmlType T>
KDN_AVX512 void FloatDotRowsAvx512(const uint8_t* w, const void* x, int64_t x_stride, int rows,
                                   int64_t n, float* out) {
  const auto* xb = static_cast<const uint8_t*>(x);
  switch (rows) {
    case 1: return FloatDotRowsAvx512<T, 1>(w, xb, x_stride, n, out);
    case 2: return FloatDotRowsAvx512<T, 2>(w, xb, x_stride, n, out);
    case 3: return FloatDotRowsAvx512<T, 3>(w, xb, x_stride, n, out);
    case 4: return FloatDotRowsAvx512<T, 4>(w, xb, x_stride, n, out);
    case 5: return FloatDotRowsAvx512<T, 5>(w, xb, x_stride, n, out);
    case 6: return FloatDotRowsAvx512<T, 6>(w, xb, x_stride, n, out);
    case 7: return FloatDotRowsAvx512<T, 7>(w, xb, x_stride, n, out);
    default: return FloatDotRowsAvx512<T, 8>(w, xb, x_stride, n, out);
  }
}

template <GgmlType T>
KDN_AVX512 float FloatDotAvx512(const uint8_t* w, const void* x, int64_t n) {
  float out;
  FloatDotRowsAvx512<T, 1>(w, static_cast<const uint8_t*>(x), 0, n, &out);
  return out;
}

// The sums of 16 vectors' lanes, a[t] -> lane t, each added in the tree
// _mm512_reduce_add_ps takes (lane i with i + 8, then with i + 4, then
// i + 2, then i + 1), so that each is bit for bit that function's result.
KDN_AVX512 inline __m512 Reduce16(const __m512* a) {
  // Two keys per vector: halves added (i + 8).
  __m512 b[8];
  for (int k = 0; k < 8; ++k) {
    const __m512 x = _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 y = _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2));
    b[k] = _mm512_add_ps(x, y);  // 128-bit lanes: 2k lo, 2k hi, 2k+1 lo, 2k+1 hi
  }
  // Four keys per vector, one per 128-bit lane (i + 4).
  __m512 c[4];
  for (int k = 0; k < 4; ++k) {
    const __m512 x = _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 y = _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1));
    c[k] = _mm512_add_ps(x, y);  // lanes: keys 4k, 4k+1, 4k+2, 4k+3
  }
  // Eight keys per vector, two per 128-bit lane (i + 2).
  __m512 d[2];
  for (int k = 0; k < 2; ++k) {
    const __m512 x = _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 y = _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2));
    d[k] = _mm512_add_ps(x, y);  // lane l: keys (4(2k)+l) x2, (4(2k+1)+l) x2
  }
  // Sixteen keys (i + 1).
  const __m512 x = _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 y = _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1));
  const __m512 e = _mm512_add_ps(x, y);
  // 128-bit lane l of e holds keys l, 4 + l, 8 + l, 12 + l.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

// One key's scores for the kHeads heads of query q (kNv vectors per head).
template <int kNv, int kHeads>
KDN_AVX512 inline void ScoreOne(const float* q, const float* const* k_blocks, int64_t stride,
                                int64_t p, int64_t lo, int64_t n, float scale, float* scores) {
  const float* kp = k_blocks[p / 16] + (p % 16) * stride;
  __m512 kv[kNv];
  for (int j = 0; j < kNv; ++j) kv[j] = _mm512_loadu_ps(kp + 16 * j);
  for (int h = 0; h < kHeads; ++h) {
    const float* qh = q + h * 16 * kNv;
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0]);
    for (int j = 1; j < kNv; ++j) a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * j), kv[j], a);
    scores[h * n + p - lo] = _mm512_reduce_add_ps(a) * scale;
  }
}

// The scores of a whole block of 16 keys (from p, a multiple of 16) for the
// kHeads heads of query q: each key's 16 lane products reduced together
// with the others' (Reduce16), the sums the same as ScoreOne's one key at a
// time.
template <int kNv, int kHeads>
KDN_AVX512 inline void ScorePage(const float* q, const float* kb, int64_t stride, int64_t p,
                                 int64_t lo, int64_t n, float scale, float* scores) {
  constexpr int64_t kBlock = 16;  // kKvBlockTokens
  for (int h = 0; h < kHeads; ++h) {
    const float* qh = q + h * 16 * kNv;
    __m512 qv[kNv];
    for (int j = 0; j < kNv; ++j) qv[j] = _mm512_loadu_ps(qh + 16 * j);
    __m512 a[kBlock];
    for (int t = 0; t < kBlock; ++t) {
      const float* kp = kb + t * stride;
      a[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kp));
      for (int j = 1; j < kNv; ++j)
        a[t] = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kp + 16 * j), a[t]);
    }
    _mm512_storeu_ps(scores + h * n + p - lo, _mm512_mul_ps(Reduce16(a), _mm512_set1_ps(scale)));
  }
}

// Decode (and prefill) attention for the kHeads query heads that share one
// KV head, for kRows rows of one sequence at once (lo shared, ctx[r] each):
// each block of keys and each value vector is read once for all of them.
// Each row's result is bit for bit what the same function gives it alone
// (kRows 1): its scores are the same sums, its softmax the same call, its
// output the same fused steps over its keys in order; only the loads are
// shared. The outputs stay in registers (kRows * kHeads * kNv vectors).
template <int kNv, int kHeads, int kRows>
KDN_AVX512 void AttendRowsAvx512(const AttendRowsArgs& a) {
  constexpr int64_t kBlock = 16;  // kKvBlockTokens
  constexpr int kHd = 16 * kNv;
  const int64_t lo = a.lo;
  int64_t n[kRows], ctx_min = a.ctx[0], ctx_max = a.ctx[0];
  for (int r = 0; r < kRows; ++r) {
    n[r] = a.ctx[r] - lo;
    ctx_min = std::min(ctx_min, a.ctx[r]);
    ctx_max = std::max(ctx_max, a.ctx[r]);
  }
  int64_t p = lo;
  for (; p < ctx_max && p % kBlock != 0; ++p) {
    for (int r = 0; r < kRows; ++r) {
      if (p < a.ctx[r]) {
        ScoreOne<kNv, kHeads>(a.q[r], a.k_blocks, a.stride, p, lo, n[r], a.scale, a.scores[r]);
      }
    }
  }
  for (; p + kBlock <= ctx_max; p += kBlock) {
    const float* kb = a.k_blocks[p / kBlock];
    if (p + 2 * kBlock <= ctx_max) {
      // The next block's keys, while this one's are scored.
      const char* next = reinterpret_cast<const char*>(a.k_blocks[p / kBlock + 1]);
      for (int t = 0; t < kBlock; ++t) {
        for (int j = 0; j < kNv; ++j) _mm_prefetch(next + 4 * t * a.stride + 64 * j, _MM_HINT_T0);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      if (p + kBlock <= a.ctx[r]) {
        ScorePage<kNv, kHeads>(a.q[r], kb, a.stride, p, lo, n[r], a.scale, a.scores[r]);
      } else {
        for (int64_t t = p; t < a.ctx[r]; ++t) {
          ScoreOne<kNv, kHeads>(a.q[r], a.k_blocks, a.stride, t, lo, n[r], a.scale, a.scores[r]);
        }
      }
    }
  }
  for (; p < ctx_max; ++p) {
    for (int r = 0; r < kRows; ++r) {
      if (p < a.ctx[r]) {
        ScoreOne<kNv, kHeads>(a.q[r], a.k_blocks, a.stride, p, lo, n[r], a.scale, a.scores[r]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int h = 0; h < kHeads; ++h) Softmax(a.scores[r] + h * n[r], n[r]);
  }
  __m512 o[kRows][kHeads][kNv];
  for (int r = 0; r < kRows; ++r) {
    for (int h = 0; h < kHeads; ++h) {
      for (int j = 0; j < kNv; ++j) o[r][h][j] = _mm512_setzero_ps();
    }
  }
  const auto add = [&](int64_t p, int r, const __m512(&vv)[kNv]) KDN_AVX512 {
    for (int h = 0; h < kHeads; ++h) {
      const __m512 w = _mm512_set1_ps(a.scores[r][h * n[r] + p - lo]);
      for (int j = 0; j < kNv; ++j) o[r][h][j] = _mm512_fmadd_ps(w, vv[j], o[r][h][j]);
    }
  };
  // The values a few keys ahead are fetched while these are added: a
  // value row sits a token stride from the next, past what the hardware
  // prefetcher follows from the paged cache's blocks.
  constexpr int64_t kAhead = 8;
  for (int64_t p = lo; p < ctx_max; ++p) {
    const float* vp = a.v_blocks[p / kBlock] + (p % kBlock) * a.stride;
    if (p + kAhead < ctx_max) {
      const char* ahead = reinterpret_cast<const char*>(a.v_blocks[(p + kAhead) / kBlock] +
                                                        ((p + kAhead) % kBlock) * a.stride);
      for (int j = 0; j < kNv; ++j) _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
    }
    __m512 vv[kNv];
    for (int j = 0; j < kNv; ++j) vv[j] = _mm512_loadu_ps(vp + 16 * j);
    if (p < ctx_min) {
      for (int r = 0; r < kRows; ++r) add(p, r, vv);
    } else {
      for (int r = 0; r < kRows; ++r) {
        if (p < a.ctx[r]) add(p, r, vv);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int h = 0; h < kHeads; ++h) {
      for (int j = 0; j < kNv; ++j) _mm512_storeu_ps(a.out[r] + h * kHd + 16 * j, o[r][h][j]);
    }
  }
}

}  // namespace

DotRowsFn Avx512DotRows(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: return FloatDotRowsAvx512<GgmlType::kF32>;
    case GgmlType::kF16: return FloatDotRowsAvx512<GgmlType::kF16>;
    case GgmlType::kBF16: return FloatDotRowsAvx512<GgmlType::kBF16>;
    default: return nullptr;
  }
}

DotFn Avx2Dot(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: return FloatDotAvx2<GgmlType::kF32>;
    case GgmlType::kF16: return FloatDotAvx2<GgmlType::kF16>;
    case GgmlType::kBF16: return FloatDotAvx2<GgmlType::kBF16>;
    default: return nullptr;
  }
}

DotFn Avx512Dot(GgmlType type) {
  switch (type) {
    case GgmlType::kF32: return FloatDotAvx512<GgmlType::kF32>;
    case GgmlType::kF16: return FloatDotAvx512<GgmlType::kF16>;
    case GgmlType::kBF16: return FloatDotAvx512<GgmlType::kBF16>;
    default: return nullptr;
  }
}

AttendRowsFn FastAttendRows(int head_dim, int heads, int rows) {
  if (BestDotIsa() != DotIsa::kAvx512Vnni || rows < 1 || rows > 2) return nullptr;
  // The outputs of every row and head in registers, with the value
  // vectors and a weight beside them: rows * heads * head_dim / 16 of at
  // most 24.
  switch (rows * 100000 + head_dim * 100 + heads) {
    case 103201: return AttendRowsAvx512<2, 1, 1>;
    case 103202: return AttendRowsAvx512<2, 2, 1>;
    case 103203: return AttendRowsAvx512<2, 3, 1>;
    case 103204: return AttendRowsAvx512<2, 4, 1>;
    case 106401: return AttendRowsAvx512<4, 1, 1>;
    case 106402: return AttendRowsAvx512<4, 2, 1>;
    case 106403: return AttendRowsAvx512<4, 3, 1>;
    case 106404: return AttendRowsAvx512<4, 4, 1>;
    case 112801: return AttendRowsAvx512<8, 1, 1>;
    case 112802: return AttendRowsAvx512<8, 2, 1>;
    case 203201: return AttendRowsAvx512<2, 1, 2>;
    case 203202: return AttendRowsAvx512<2, 2, 2>;
    case 203203: return AttendRowsAvx512<2, 3, 2>;
    case 203204: return AttendRowsAvx512<2, 4, 2>;
    case 206401: return AttendRowsAvx512<4, 1, 2>;
    case 206402: return AttendRowsAvx512<4, 2, 2>;
    case 206403: return AttendRowsAvx512<4, 3, 2>;
    case 212801: return AttendRowsAvx512<8, 1, 2>;
    default: return nullptr;
  }
}

#else  // not x86-64: the scalar table alone

DotFn Avx2Dot(model::GgmlType) { return nullptr; }
DotFn Avx512Dot(model::GgmlType) { return nullptr; }
DotRowsFn Avx512DotRows(model::GgmlType) { return nullptr; }
AttendRowsFn FastAttendRows(int, int, int) { return nullptr; }

#endif

}  // namespace kdn::engine::internal
