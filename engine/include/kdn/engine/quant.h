#pragma once
// The weight formats the CPU engine computes with as they are stored, one row
// of a traits table each (ggml's idea: block size, to-float, dot product):
// F32, F16, BF16, Q8_0, Q4_0 and Q4_1.
//
// A quantized format's dot product takes the activation row quantized once
// to 8 bits per block of 32 (QuantizeActivations: a scale, the block's sum
// and 32 int8 values, as llama.cpp quantizes activations for its integer dot
// products), so the inner loop is integer multiply-adds; F16, BF16 and F32
// rows are dotted with the float activations. Each dot product has a
// portable scalar version (the reference the tests compare against); the
// float formats' have AVX2 and AVX-512 ones chosen at run time, and the
// quantized formats' vector products are QuantPanels' (quant_panels.h),
// which sum as the scalar one here does, bit for bit.
//
// Thread-safe (functions over values; the table is constant).

#include <cstdint>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/model/gguf.h"

namespace kdn::engine {

// Values per block of the 8-bit activation rows (and of Q8_0, Q4_0, Q4_1).
constexpr int kQuantBlock = 32;

// One block of an activation row quantized to 8 bits: x[i] ~ d * q[i];
// sum = sum(q) (exact), s = d * sum (what Q4_0's offset and Q4_1's minimum
// multiply).
struct ActBlock {
  float d;
  float s;
  int32_t sum;
  int8_t q[kQuantBlock];
};

// Quantizes n floats (a whole number of blocks) to n / kQuantBlock blocks:
// d = max|x| / 127, q = round(x / d).
// (AVX-512 where the CPU has it, bit for bit the scalar loop.)
void QuantizeActivations(const float* x, int64_t n, ActBlock* out);
// The scalar loop alone (the tests' reference).
void QuantizeActivationsScalar(const float* x, int64_t n, ActBlock* out);

// Which instructions the dot products use.
enum class DotIsa { kScalar, kAvx2, kAvx512Vnni };
const char* DotIsaName(DotIsa isa);
// The best this CPU runs, unless KDN_CPU_ISA=scalar|avx2 lowers it.
DotIsa BestDotIsa();

// sum over `n` values (whole blocks of the format) of w[i] * x[i]: `w` is a
// row in the format, `x` is ActBlock[n / kQuantBlock] for quantized formats
// and float[n] for F32, F16 and BF16.
using DotFn = float (*)(const uint8_t* w, const void* x, int64_t n);
// The dot products of one row of a float format (F32, F16, BF16) with
// `rows` (1 to kDotRowsMax) float activation rows, x_stride bytes apart:
// out[r]. (The quantized formats' products are QuantPanels'.)
// What a batch's product runs, the weight's blocks unpacked once for all.
// Each out[r] is, bit for bit, what the same ISA's DotFn gives for that row
// alone, whatever `rows`.
constexpr int kDotRowsMax = 8;
using DotRowsFn = void (*)(const uint8_t* w, const void* x, int64_t x_stride, int rows, int64_t n,
                           float* out);
// Writes n values of a row in the format (whole blocks) to `out` as floats.
using ToFloatFn = void (*)(const uint8_t* w, int64_t n, float* out);

struct QuantTraits {
  model::GgmlType type;
  const char* name;
  int block_values;    // values per block (1 for F32, F16, BF16)
  int block_bytes;     // bytes per block
  bool quantized_x;    // the dot products take quantized rows (else floats)
  ToFloatFn to_float;  // bit for bit the gguf package's dequantize
  DotFn dot[3];        // by DotIsa; a null entry falls back to scalar
  DotRowsFn dot_rows;  // AVX-512, the float formats; else null
  int64_t RowBytes(int64_t n) const { return n / block_values * block_bytes; }
};

// The traits of `type`, or null for a format the engine does not compute in.
const QuantTraits* FindQuantTraits(model::GgmlType type);
// Every row of the table.
const std::vector<QuantTraits>& AllQuantTraits();

// The dot product of `t` for `isa` (or the best below it that exists).
DotFn DotFor(const QuantTraits& t, DotIsa isa);
// The multi-row one for `isa`, or null (then rows go one DotFor call each).
DotRowsFn DotRowsFor(const QuantTraits& t, DotIsa isa);

}  // namespace kdn::engine
