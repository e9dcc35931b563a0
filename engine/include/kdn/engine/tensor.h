#pragma once
// Host tensors and the element types a model folder may hold.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kdn::engine {

enum class DType { kF32, kF16, kBF16 };
const char* DTypeName(DType t);  // safetensors spelling: F32, F16, BF16
int DTypeSize(DType t);

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

// Converts `n` elements of type `t` at `src` to float.
void ToFloat(DType t, const void* src, size_t n, float* dst);
// Converts `n` floats to type `t` at `dst` (rounding to nearest even).
void FromFloat(DType t, const float* src, size_t n, void* dst);

// A named fp32 tensor owned by the host, row-major.
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

std::string ShapeToString(const std::vector<int64_t>& shape);

}  // namespace kdn::engine
