#pragma once
// Scalar conversions between float and the 16-bit float formats KV and
// weights are kept in: bf16 (bfloat16) and f16 (IEEE binary16). Narrowing
// rounds to nearest, ties to even; NaN stays NaN; f16 overflows to infinity.

#include <cstdint>
#include <cstring>

namespace kdn {

inline float Bf16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// Round to nearest even, NaN kept NaN (as PyTorch does).
inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

}  // namespace kdn
