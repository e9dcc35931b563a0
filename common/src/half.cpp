#include "kdn/common/half.h"

#include <cmath>

namespace kdn {

float F16ToF32(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: value = mant * 2^-24
      const float f = std::ldexp(static_cast<float>(mant), -24);
      return (h & 0x8000u) ? -f : f;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t F32ToF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (ax >= 0x47800000u) return sign | 0x7c00u;  // overflow -> inf (65520 and up)
  if (ax < 0x38800000u) {                        // subnormal or zero in half
    const float a = std::fabs(f);
    const float scaled = std::nearbyint(a * 16777216.0f);  // 2^24, round-half-even
    return sign | static_cast<uint16_t>(scaled);
  }
  // Normal: rebias exponent, round mantissa to nearest even.
  uint32_t r = ax - 0x38000000u;  // exponent -= 112
  r += 0xfffu + ((r >> 13) & 1u);
  return sign | static_cast<uint16_t>(r >> 13);
}

}  // namespace kdn
