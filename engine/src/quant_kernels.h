#pragma once
// The engine's x86 kernels written with intrinsics, in quant_x86.cpp: the
// traits table's dot products (quant.h) and decode attention's row, compiled
// for AVX2 (with FMA and F16C) and AVX-512 VNNI by function target
// attributes, run only where BestDotIsa says the CPU has them.

#include "kdn/engine/quant.h"

namespace kdn::engine::internal {

// The dot product of `type` for that instruction set; null where there is
// none (or off x86).
DotFn Avx2Dot(model::GgmlType type);
DotFn Avx512Dot(model::GgmlType type);
// The AVX-512 VNNI multi-row dot product of a quantized format (null for
// the others): quant.h's DotRowsFn.
DotRowsFn Avx512DotRows(model::GgmlType type);

// AttendPagedGroup (cpu_ops.h) for `heads` heads of `head_dim`, less those.
using AttendGroupFn = void (*)(const float* q, const float* const* k_blocks,
                               const float* const* v_blocks, int64_t stride, int64_t lo,
                               int64_t ctx, float scale, float* scores, float* out);
// The AVX-512 one for head_dim 32 or 64 with up to 4 heads, or 128 with up
// to 2, where BestDotIsa is kAvx512Vnni; null otherwise (the portable loop
// runs).
AttendGroupFn FastAttendGroup(int head_dim, int heads);

}  // namespace kdn::engine::internal
