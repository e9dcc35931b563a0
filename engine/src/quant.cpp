// Built with -ffp-contract=off (engine/CMakeLists.txt): Q4_1's d * q + m must
// round twice, as the gguf package's numpy does, not once in a fused
// multiply-add. The scalar dot products here are the tests' reference.
#include "kdn/engine/quant.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "kdn/common/half.h"
#include "kdn/engine/tensor.h"
#include "quant_kernels.h"

namespace kdn::engine {

namespace {

using model::GgmlType;

constexpr int kQ8_0Bytes = 34;  // f16 d, 32 x int8
constexpr int kQ4_0Bytes = 18;  // f16 d, 16 bytes of nibbles
constexpr int kQ4_1Bytes = 20;  // f16 d, f16 m, 16 bytes of nibbles

float HalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return F16ToF32(h);
}

// F32, F16 and BF16 rows: the conversions of kdn/engine/tensor.h.
template <DType kType>
void FloatRowToFloat(const uint8_t* w, int64_t n, float* out) {
  ToFloat(kType, w, static_cast<size_t>(n), out);
}

void Q8_0ToFloat(const uint8_t* w, int64_t n, float* out) {
  for (int64_t b = 0; b < n / kQuantBlock; ++b, w += kQ8_0Bytes, out += kQuantBlock) {
    const float d = HalfAt(w);
    for (int i = 0; i < kQuantBlock; ++i) {
      out[i] = static_cast<float>(static_cast<int8_t>(w[2 + i])) * d;
    }
  }
}

// Q4_0 and Q4_1: byte j of a block holds value j in its low nibble and value
// j + 16 in its high one.
void Q4_0ToFloat(const uint8_t* w, int64_t n, float* out) {
  for (int64_t b = 0; b < n / kQuantBlock; ++b, w += kQ4_0Bytes, out += kQuantBlock) {
    const float d = HalfAt(w);
    const uint8_t* qs = w + 2;
    for (int j = 0; j < kQuantBlock / 2; ++j) {
      out[j] = d * static_cast<float>((qs[j] & 0x0F) - 8);
      out[j + kQuantBlock / 2] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  }
}

void Q4_1ToFloat(const uint8_t* w, int64_t n, float* out) {
  for (int64_t b = 0; b < n / kQuantBlock; ++b, w += kQ4_1Bytes, out += kQuantBlock) {
    const float d = HalfAt(w), m = HalfAt(w + 2);
    const uint8_t* qs = w + 4;
    for (int j = 0; j < kQuantBlock / 2; ++j) {
      out[j] = d * static_cast<float>(qs[j] & 0x0F) + m;
      out[j + kQuantBlock / 2] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
}

// The scalar dot products: the float formats in float, the quantized ones
// one integer sum per block.
template <ToFloatFn kToFloat, int kStep>
float FloatDotScalar(const uint8_t* w, const void* xv, int64_t n) {
  const auto* x = static_cast<const float*>(xv);
  float row[64];
  float s = 0.0f;
  for (int64_t i = 0; i < n; i += 64) {
    const int64_t len = std::min<int64_t>(64, n - i);
    kToFloat(w + i * kStep, len, row);
    for (int64_t j = 0; j < len; ++j) s += row[j] * x[i + j];
  }
  return s;
}

// The quantized formats' sum (quant_panels.h): per block in order, the
// exact integer sum of the stored integers' products, then two fused steps.
// Q8_0's values are d * q; Q4_0's d * (q - 8), whose -8 d multiplies the
// activation block's scaled sum s; Q4_1's d * q + m, whose m does.
float Q8_0DotScalar(const uint8_t* w, const void* xv, int64_t n) {
  const auto* x = static_cast<const ActBlock*>(xv);
  float acc = 0.0f;
  for (int64_t b = 0; b < n / kQuantBlock; ++b, w += kQ8_0Bytes) {
    int32_t sum = 0;
    for (int i = 0; i < kQuantBlock; ++i) sum += static_cast<int8_t>(w[2 + i]) * x[b].q[i];
    acc = std::fma(static_cast<float>(sum), HalfAt(w) * x[b].d, acc);
  }
  return acc;
}

template <bool kMin>
float Q4DotScalar(const uint8_t* w, const void* xv, int64_t n) {
  constexpr int kQs = kMin ? 4 : 2;
  const auto* x = static_cast<const ActBlock*>(xv);
  float acc = 0.0f;
  for (int64_t b = 0; b < n / kQuantBlock; ++b, w += kMin ? kQ4_1Bytes : kQ4_0Bytes) {
    int32_t sum = 0;
    for (int j = 0; j < kQuantBlock / 2; ++j) {
      sum += (w[kQs + j] & 0x0F) * x[b].q[j] + (w[kQs + j] >> 4) * x[b].q[j + kQuantBlock / 2];
    }
    const float d = HalfAt(w);
    acc = std::fma(static_cast<float>(sum), d * x[b].d, acc);
    acc = std::fma(kMin ? HalfAt(w + 2) : -8.0f * d, x[b].s, acc);
  }
  return acc;
}

std::vector<QuantTraits> MakeTable() {
  using internal::Avx2Dot;
  using internal::Avx512Dot;
  auto row = [](GgmlType t, const char* name, int values, int bytes, bool qx, ToFloatFn f,
                DotFn scalar) {
    return QuantTraits{t,
                       name,
                       values,
                       bytes,
                       qx,
                       f,
                       {scalar, Avx2Dot(t), Avx512Dot(t)},
                       internal::Avx512DotRows(t)};
  };
  return {
      row(GgmlType::kF32, "F32", 1, 4, false, FloatRowToFloat<DType::kF32>,
          FloatDotScalar<FloatRowToFloat<DType::kF32>, 4>),
      row(GgmlType::kF16, "F16", 1, 2, false, FloatRowToFloat<DType::kF16>,
          FloatDotScalar<FloatRowToFloat<DType::kF16>, 2>),
      row(GgmlType::kBF16, "BF16", 1, 2, false, FloatRowToFloat<DType::kBF16>,
          FloatDotScalar<FloatRowToFloat<DType::kBF16>, 2>),
      row(GgmlType::kQ8_0, "Q8_0", kQuantBlock, kQ8_0Bytes, true, Q8_0ToFloat, Q8_0DotScalar),
      row(GgmlType::kQ4_0, "Q4_0", kQuantBlock, kQ4_0Bytes, true, Q4_0ToFloat, Q4DotScalar<false>),
      row(GgmlType::kQ4_1, "Q4_1", kQuantBlock, kQ4_1Bytes, true, Q4_1ToFloat, Q4DotScalar<true>),
  };
}

DotIsa DetectIsa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  DotIsa isa = DotIsa::kScalar;
  // F16C through CPUID: clang's __builtin_cpu_supports does not know it.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) {
    isa = DotIsa::kAvx2;
  }
  if (isa == DotIsa::kAvx2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vnni")) {
    isa = DotIsa::kAvx512Vnni;
  }
#else
  DotIsa isa = DotIsa::kScalar;
#endif
  if (const char* cap = std::getenv("KDN_CPU_ISA")) {
    const std::string_view c(cap);
    if (c == "scalar") isa = DotIsa::kScalar;
    if (c == "avx2" && isa == DotIsa::kAvx512Vnni) isa = DotIsa::kAvx2;
  }
  return isa;
}

}  // namespace

void QuantizeActivations(const float* x, int64_t n, ActBlock* out) {
  static const internal::QuantizeFn fast = internal::FastQuantize();
  if (fast != nullptr) return fast(x, n, out);
  QuantizeActivationsScalar(x, n, out);
}

void QuantizeActivationsScalar(const float* x, int64_t n, ActBlock* out) {
  for (int64_t b = 0; b < n / kQuantBlock; ++b, x += kQuantBlock) {
    float amax = 0.0f;
    for (int i = 0; i < kQuantBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
    float d = amax / 127.0f;
    float inv = d > 0.0f ? 1.0f / d : 0.0f;
    // A block so small that its scale has no finite inverse (|x| under
    // about 4e-37) quantizes to zero, as an all-zero block does.
    if (!(inv < INFINITY)) d = inv = 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < kQuantBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(x[i] * inv));
      out[b].q[i] = static_cast<int8_t>(std::clamp(v, -127, 127));
      sum += out[b].q[i];
    }
    out[b].d = d;
    out[b].sum = sum;
    out[b].s = d * static_cast<float>(sum);
  }
}

const char* DotIsaName(DotIsa isa) {
  switch (isa) {
    case DotIsa::kScalar: return "scalar";
    case DotIsa::kAvx2: return "avx2";
    case DotIsa::kAvx512Vnni: return "avx512-vnni";
  }
  return "?";
}

DotIsa BestDotIsa() {
  static const DotIsa isa = DetectIsa();
  return isa;
}

const std::vector<QuantTraits>& AllQuantTraits() {
  static const std::vector<QuantTraits> table = MakeTable();
  return table;
}

DotRowsFn DotRowsFor(const QuantTraits& t, DotIsa isa) {
  return isa == DotIsa::kAvx512Vnni ? t.dot_rows : nullptr;
}

const QuantTraits* FindQuantTraits(GgmlType type) {
  for (const QuantTraits& t : AllQuantTraits()) {
    if (t.type == type) return &t;
  }
  return nullptr;
}

DotFn DotFor(const QuantTraits& t, DotIsa isa) {
  for (int i = static_cast<int>(isa); i > 0; --i) {
    if (t.dot[i] != nullptr) return t.dot[i];
  }
  return t.dot[0];
}

}  // namespace kdn::engine
