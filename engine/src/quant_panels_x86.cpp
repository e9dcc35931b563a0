// QuantPanels' vector kernels (quant_panels.h): AVX2, AVX-512 VNNI and AMX,
// each the same sum as the scalar kernel, bit for bit. The integer sums of
// a block come from different instructions (AVX2 maddubs + madd, VNNI
// dpbusd with the activation's four bytes broadcast, AMX tdpbsud over a
// 16 x 32 tile of activations and the panel block) but are exact; the two
// float steps per block are the same fused multiply-adds in the same order
// in every lane. Each function carries its instruction set as a target
// attribute; PanelKernel hands out only what BestPanelIsa allows.
#include "quant_kernels.h"

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kdn::engine::internal {

#if defined(__x86_64__)

namespace {

using model::GgmlType;

constexpr int kQ4Bytes = 256, kQ8Bytes = 512;

template <GgmlType T>
constexpr int BlockBytes() {
  return T == GgmlType::kQ8_0 ? kQ8Bytes : kQ4Bytes;
}

// The activation's values 4g..4g+3 as one int32, for broadcasting.
inline int32_t Four(const ActBlock& a, int g) {
  int32_t v;
  std::memcpy(&v, a.q + 4 * g, 4);
  return v;
}

// ---- AVX2: eight weight rows per register, the panel in two halves.

// Half h (rows 8h..8h+7) of the block's eight groups.
template <GgmlType T>
KDN_AVX2 inline void GroupsAvx2(const uint8_t* q, int h, __m256i* g) {
  if constexpr (T == GgmlType::kQ8_0) {
    for (int i = 0; i < 8; ++i) {
      g[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * i + 32 * h));
    }
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * c + 32 * h));
      g[c] = _mm256_and_si256(v, low);
      g[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
  }
}

// The eight rows' integer sums with one activation block. Q8_0's stored
// bytes are the value plus 128: the value's magnitude times the activation
// with the value's sign keeps maddubs's pairs within int16.
template <GgmlType T>
KDN_AVX2 inline __m256i SumAvx2(const __m256i* g, const ActBlock& a) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s = _mm256_setzero_si256();
  for (int i = 0; i < 8; ++i) {
    const __m256i a4 = _mm256_set1_epi32(Four(a, i));
    __m256i p;
    if constexpr (T == GgmlType::kQ8_0) {
      const __m256i w = _mm256_xor_si256(g[i], _mm256_set1_epi8(static_cast<char>(0x80)));
      p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a4, w));
    } else {
      p = _mm256_maddubs_epi16(g[i], a4);
    }
    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
  }
  return s;
}

template <GgmlType T, int kRows>
KDN_AVX2 void PanelRowsAvx2(const PanelView& w, const ActBlock* x, int64_t x_stride, float* out) {
  for (int h = 0; h < 2; ++h) {
    __m256 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* q = w.q;
    for (int64_t b = 0; b < w.blocks; ++b, q += BlockBytes<T>()) {
      __m256i g[8];
      GroupsAvx2<T>(q, h, g);
      const int64_t s = b * kPanelRows + 8 * h;
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + s)));
      __m256 cw = _mm256_setzero_ps();
      if constexpr (T == GgmlType::kQ4_0) cw = _mm256_mul_ps(_mm256_set1_ps(-8.0f), dw);
      if constexpr (T == GgmlType::kQ4_1) {
        cw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.m + s)));
      }
      for (int r = 0; r < kRows; ++r) {
        const ActBlock& a = x[r * x_stride + b];
        const __m256 sum = _mm256_cvtepi32_ps(SumAvx2<T>(g, a));
        acc[r] = _mm256_fmadd_ps(sum, _mm256_mul_ps(dw, _mm256_set1_ps(a.d)), acc[r]);
        if constexpr (T != GgmlType::kQ8_0) {
          acc[r] = _mm256_fmadd_ps(cw, _mm256_set1_ps(a.s), acc[r]);
        }
      }
    }
    for (int r = 0; r < kRows; ++r) _mm256_storeu_ps(out + r * kPanelRows + 8 * h, acc[r]);
  }
}

template <GgmlType T>
KDN_AVX2 void PanelAvx2(const PanelView& w, const ActBlock* x, int64_t x_stride, int64_t rows,
                        float* out) {
  InRowGroups<4>(rows, [&](auto k, int64_t first) {
    PanelRowsAvx2<T, decltype(k)::value>(w, x + first * x_stride, x_stride,
                                         out + first * kPanelRows);
  });
}

// ---- AVX-512 VNNI: the panel's sixteen rows in one register.

template <GgmlType T>
KDN_AVX512 inline void Groups512(const uint8_t* q, __m512i* g) {
  if constexpr (T == GgmlType::kQ8_0) {
    for (int i = 0; i < 8; ++i) g[i] = _mm512_loadu_si512(q + 64 * i);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(q + 64 * c);
      g[c] = _mm512_and_si512(v, low);
      g[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
  }
}

// The block's scales (and Q4's offset coefficients) for the 16 rows.
template <GgmlType T>
KDN_AVX512 inline void Scales512(const PanelView& w, int64_t b, __m512* dw, __m512* cw) {
  const int64_t s = b * kPanelRows;
  *dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + s)));
  if constexpr (T == GgmlType::kQ4_0) *cw = _mm512_mul_ps(_mm512_set1_ps(-8.0f), *dw);
  if constexpr (T == GgmlType::kQ4_1) {
    *cw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m + s)));
  }
  if constexpr (T == GgmlType::kQ8_0) *cw = _mm512_setzero_ps();
}

// The block's two float steps for one activation row, from its integer
// sums; Q8_0's sums take back 128 times the activation block's sum.
template <GgmlType T>
KDN_AVX512 inline __m512 Step512(__m512 acc, __m512i sum, const ActBlock& a, __m512 dw, __m512 cw) {
  if constexpr (T == GgmlType::kQ8_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * a.sum));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(a.d)), acc);
  if constexpr (T != GgmlType::kQ8_0) acc = _mm512_fmadd_ps(cw, _mm512_set1_ps(a.s), acc);
  return acc;
}

template <GgmlType T, int kRows>
KDN_AVX512 void PanelRows512(const PanelView& w, const ActBlock* x, int64_t x_stride, float* out) {
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* q = w.q;
  for (int64_t b = 0; b < w.blocks; ++b, q += BlockBytes<T>()) {
    __m512i g[8];
    Groups512<T>(q, g);
    __m512 dw, cw;
    Scales512<T>(w, b, &dw, &cw);
    for (int r = 0; r < kRows; ++r) {
      const ActBlock& a = x[r * x_stride + b];
      // Two chains of four, so that one row's sums do not wait on each
      // dpbusd's latency in turn.
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int i = 0; i < 8; i += 2) {
        s0 = _mm512_dpbusd_epi32(s0, g[i], _mm512_set1_epi32(Four(a, i)));
        s1 = _mm512_dpbusd_epi32(s1, g[i + 1], _mm512_set1_epi32(Four(a, i + 1)));
      }
      acc[r] = Step512<T>(acc[r], _mm512_add_epi32(s0, s1), a, dw, cw);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(out + r * kPanelRows, acc[r]);
}

template <GgmlType T>
KDN_AVX512 void Panel512(const PanelView& w, const ActBlock* x, int64_t x_stride, int64_t rows,
                         float* out) {
  InRowGroups<8>(rows, [&](auto k, int64_t first) {
    PanelRows512<T, decltype(k)::value>(w, x + first * x_stride, x_stride,
                                        out + first * kPanelRows);
  });
}

// ---- Activations: QuantizeActivations's blocks, 32 values in two
// registers. Bit for bit the scalar loop: the maximum is exact in any
// order, the scale and its inverse are the same divisions, the conversion
// rounds to nearest even as nearbyint does, and the sum is exact.
KDN_AVX512 void QuantizeAvx512(const float* x, int64_t n, ActBlock* out) {
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (int64_t b = 0; b < n / kQuantBlock; ++b, x += kQuantBlock) {
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const __m512 a = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
    const float amax = _mm512_reduce_max_ps(a);
    float d = amax / 127.0f;
    float inv = d > 0.0f ? 1.0f / d : 0.0f;
    if (!(inv < INFINITY)) d = inv = 0.0f;  // as the scalar loop: too small, zero
    const __m512 s = _mm512_set1_ps(inv);
    const __m512i q0 =
        _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(v0, s))));
    const __m512i q1 =
        _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(v1, s))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[b].q), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out[b].q + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    out[b].d = d;
    out[b].sum = sum;
    out[b].s = d * static_cast<float>(sum);
  }
}

// ---- AMX: a block of 16 activation rows by the panel's 16 weight rows per
// tile product (tdpbsud: signed activations, unsigned weights).

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 the sums (16 x 16 int32), 1 the activations (16 rows x 32
// bytes), 2 the panel block (8 groups x 64 bytes).
constexpr TileConfig MakeTileConfig() {
  TileConfig c;
  c.colsb[0] = 64;
  c.rows[0] = 16;
  c.colsb[1] = 32;
  c.rows[1] = 16;
  c.colsb[2] = 64;
  c.rows[2] = 8;
  return c;
}

template <GgmlType T>
KDN_AMX void PanelAmx(const PanelView& w, const ActBlock* x, int64_t x_stride, int64_t rows,
                      float* out) {
  // Q4's nibbles widened to bytes once per call, for every tile of rows.
  thread_local std::vector<uint8_t> widened;
  const uint8_t* wb = w.q;
  if constexpr (T != GgmlType::kQ8_0) {
    widened.resize(static_cast<size_t>(w.blocks * kQ8Bytes));
    for (int64_t b = 0; b < w.blocks; ++b) {
      __m512i g[8];
      Groups512<T>(w.q + b * kQ4Bytes, g);
      for (int i = 0; i < 8; ++i) _mm512_storeu_si512(&widened[b * kQ8Bytes + 64 * i], g[i]);
    }
    wb = widened.data();
  }
  static constexpr TileConfig kConfig = MakeTileConfig();
  _tile_loadconfig(&kConfig);
  alignas(64) int32_t sums[kPanelRows * kPanelRows];
  const int64_t stride = x_stride * static_cast<int64_t>(sizeof(ActBlock));
  for (int64_t t = 0; t < rows; t += kPanelRows) {
    const ActBlock* xt = x + t * x_stride;
    __m512 acc[kPanelRows];
    for (int r = 0; r < kPanelRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < w.blocks; ++b) {
      _tile_loadd(2, wb + b * kQ8Bytes, 64);
      _tile_loadd(1, xt[b].q, stride);
      _tile_zero(0);
      _tile_dpbsud(0, 1, 2);
      _tile_stored(0, sums, 64);
      __m512 dw, cw;
      Scales512<T>(w, b, &dw, &cw);
      for (int r = 0; r < kPanelRows; ++r) {
        const __m512i sum = _mm512_load_si512(sums + r * kPanelRows);
        acc[r] = Step512<T>(acc[r], sum, xt[r * x_stride + b], dw, cw);
      }
    }
    for (int r = 0; r < kPanelRows; ++r) _mm512_storeu_ps(out + (t + r) * kPanelRows, acc[r]);
  }
  _tile_release();
}

template <GgmlType T>
PanelFn KernelFor(PanelIsa isa) {
  switch (isa) {
    case PanelIsa::kScalar: return nullptr;
    case PanelIsa::kAvx2: return PanelAvx2<T>;
    case PanelIsa::kAvx512Vnni: return Panel512<T>;
    case PanelIsa::kAmx: return PanelAmx<T>;
  }
  return nullptr;
}

}  // namespace

QuantizeFn FastQuantize() { return BestDotIsa() == DotIsa::kAvx512Vnni ? QuantizeAvx512 : nullptr; }

namespace {

bool DetectAmx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  const bool tile = (edx & (1u << 24)) != 0, int8 = (edx & (1u << 25)) != 0;
  if (!tile || !int8) return false;
  // Linux hands out the 8 KiB tile state only on request (ARCH_REQ_XCOMP_PERM
  // for XFEATURE_XTILEDATA); a kernel before 5.16 refuses, and AMX is off.
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

}  // namespace

PanelFn PanelKernel(model::GgmlType type, PanelIsa isa) {
  switch (type) {
    case GgmlType::kQ8_0: return KernelFor<GgmlType::kQ8_0>(isa);
    case GgmlType::kQ4_0: return KernelFor<GgmlType::kQ4_0>(isa);
    case GgmlType::kQ4_1: return KernelFor<GgmlType::kQ4_1>(isa);
    default: return nullptr;
  }
}

bool AmxUsable() {
  static const bool usable = DetectAmx();
  return usable;
}

#else  // not x86-64: the scalar kernel alone

PanelFn PanelKernel(model::GgmlType, PanelIsa) { return nullptr; }
bool AmxUsable() { return false; }
QuantizeFn FastQuantize() { return nullptr; }

#endif

}  // namespace kdn::engine::internal
