#pragma once
// Host tensors and the element types a model folder may hold.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kdn/common/dtype.h"
#include "kdn/common/half.h"
#include "kdn/model/gguf.h"
#include "kdn/model/tensors.h"

namespace kdn::engine {

// The element types (kdn/common/dtype.h: one enum with the chunk format and
// the C ABI).
using ::kdn::DType;
using ::kdn::DTypeName;
using ::kdn::DTypeSize;
using ::kdn::SafetensorsDTypeName;

// The scalar conversions live in kdn/common/half.h (kvbus uses them too).
using kdn::Bf16ToF32;
using kdn::F16ToF32;
using kdn::F32ToBf16;
using kdn::F32ToF16;

// Converts `n` elements of type `t` at `src` to float.
void ToFloat(DType t, const void* src, size_t n, float* dst);
// Converts `n` floats to type `t` at `dst` (rounding to nearest even).
void FromFloat(DType t, const float* src, size_t n, void* dst);

// A named tensor owned by the host, row-major: fp32 values in `data`, or,
// for a weight kept in the format it was stored in (quant.h), that format
// (`type`) and its bytes (`bytes`), `data` empty.
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
  model::GgmlType type = model::GgmlType::kF32;
  std::vector<uint8_t> bytes;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

using model::ShapeToString;  // kdn/model/tensors.h

}  // namespace kdn::engine
