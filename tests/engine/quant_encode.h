#pragma once
// Test-only: rows of floats encoded in a weight format of quant.h's table the
// way llama.cpp's reference quantizers do (enough to make valid blocks; tests
// compare against to_float of the same bytes, not against these floats).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kdn/engine/quant.h"
#include "kdn/engine/tensor.h"

namespace kdn::engine {

// Encodes the floats `x` (a whole number of blocks) in `type`.
inline void PutHalf(float v, uint8_t* p) {
  const uint16_t h = F32ToF16(v);
  std::memcpy(p, &h, 2);
}

inline std::vector<uint8_t> Encode(model::GgmlType type, const std::vector<float>& x) {
  const QuantTraits& t = *FindQuantTraits(type);
  const int64_t n = static_cast<int64_t>(x.size());
  std::vector<uint8_t> out(static_cast<size_t>(t.RowBytes(n)));
  if (type == model::GgmlType::kF32) {
    std::memcpy(out.data(), x.data(), x.size() * 4);
    return out;
  }
  if (type == model::GgmlType::kF16 || type == model::GgmlType::kBF16) {
    FromFloat(type == model::GgmlType::kF16 ? DType::kF16 : DType::kBF16, x.data(), x.size(),
              out.data());
    return out;
  }
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const float* v = &x[b * kQuantBlock];
    uint8_t* blk = &out[b * t.block_bytes];
    float amax = 0, signed_max = 0, lo = v[0], hi = v[0];
    for (int i = 0; i < kQuantBlock; ++i) {
      if (std::fabs(v[i]) > amax) {
        amax = std::fabs(v[i]);
        signed_max = v[i];
      }
      lo = std::min(lo, v[i]);
      hi = std::max(hi, v[i]);
    }
    if (type == model::GgmlType::kQ8_0) {
      const float d = amax / 127;
      PutHalf(d, blk);
      for (int i = 0; i < kQuantBlock; ++i) {
        blk[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(d ? std::nearbyint(v[i] / d) : 0));
      }
    } else if (type == model::GgmlType::kQ4_0) {
      const float d = signed_max / -8;
      PutHalf(d, blk);
      for (int j = 0; j < kQuantBlock / 2; ++j) {
        auto q = [&](float f) { return std::clamp(d ? static_cast<int>(f / d + 8.5f) : 8, 0, 15); };
        blk[2 + j] = static_cast<uint8_t>(q(v[j]) | q(v[j + 16]) << 4);
      }
    } else {  // Q4_1
      const float d = (hi - lo) / 15;
      PutHalf(d, blk);
      PutHalf(lo, blk + 2);
      for (int j = 0; j < kQuantBlock / 2; ++j) {
        auto q = [&](float f) {
          return std::clamp(d ? static_cast<int>((f - lo) / d + 0.5f) : 0, 0, 15);
        };
        blk[4 + j] = static_cast<uint8_t>(q(v[j]) | q(v[j + 16]) << 4);
      }
    }
  }
  return out;
}

}  // namespace kdn::engine
