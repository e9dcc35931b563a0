#pragma once
// The engine's x86 kernels written with intrinsics: the traits table's float
// dot products (quant.h) and decode attention's row in quant_x86.cpp, the
// quantized panel products (quant_panels.h) in quant_panels_x86.cpp. Each is
// compiled for its instruction set by function target attributes and runs
// only where BestDotIsa (BestPanelIsa) says the CPU has it.

#include <type_traits>

#include "kdn/engine/quant.h"
#include "kdn/engine/quant_panels.h"

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's avx512fintrin.h widens 256-bit values through _mm512_undefined_*,
// which -Wuninitialized flags wherever a cast is inlined (a known false
// positive of the header, not of the kernels).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// Each kernel's instruction set, as a function (or lambda: its call
// operator is a function too) attribute.
#define KDN_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KDN_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define KDN_AMX \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#endif

namespace kdn::engine::internal {

// Runs f(std::integral_constant<int, k>{}, first) over `rows` rows in
// groups of kMax from row 0 and one last group of the rest: a kernel
// templated on its row count, called for any count.
template <int kMax, typename F>
inline void InRowGroups(int64_t rows, F&& f) {
  int64_t first = 0;
  for (; rows - first >= kMax; first += kMax) f(std::integral_constant<int, kMax>{}, first);
  if constexpr (kMax > 1) {
    if (rows > first) {
      InRowGroups<kMax - 1>(rows - first, [&](auto k, int64_t at) { f(k, first + at); });
    }
  }
}

// The dot product of a float format (F32, F16, BF16) for that instruction
// set; null for the others or off x86.
DotFn Avx2Dot(model::GgmlType type);
DotFn Avx512Dot(model::GgmlType type);
// The AVX-512 multi-row dot product of a float format (null for the
// others): quant.h's DotRowsFn.
DotRowsFn Avx512DotRows(model::GgmlType type);

// One panel of a QuantPanels matrix (quant_panels.h), as its kernels read it.
struct PanelView {
  model::GgmlType type;
  int64_t blocks;
  const uint8_t* q;   // blocks * QuantPanels::BlockBytes(type)
  const uint16_t* d;  // blocks * kPanelRows
  const uint16_t* m;  // Q4_1: as d; else null
};
// QuantPanels::Product's kernel for one instruction set (quant_panels_x86.cpp):
// out[i * kPanelRows + j], i < rows. The AMX one takes rows in whole tiles
// of 16 only.
using PanelFn = void (*)(const PanelView& w, const ActBlock* x, int64_t x_stride, int64_t rows,
                         float* out);
// Null where that instruction set has none (or off x86).
PanelFn PanelKernel(model::GgmlType type, PanelIsa isa);
// QuantizeActivations in AVX-512 where the CPU has it (bit for bit the
// scalar loop), else null.
using QuantizeFn = void (*)(const float* x, int64_t n, ActBlock* out);
QuantizeFn FastQuantize();
// Whether the CPU has AMX-INT8 and Linux granted this process the tile state.
bool AmxUsable();

// AttendPagedRows (cpu_ops.h) for up to two rows of `heads` heads of
// `head_dim`: row r's query q[r], output out[r], scratch scores[r] and
// context ctx[r], the key range's start lo shared.
struct AttendRowsArgs {
  const float* q[2];
  float* out[2];
  float* scores[2];
  int64_t ctx[2];
  const float* const* k_blocks;
  const float* const* v_blocks;
  int64_t stride, lo;
  float scale;
};
using AttendRowsFn = void (*)(const AttendRowsArgs& args);
// The AVX-512 one for `rows` (1 or 2) rows of head_dim 32 or 64 with up to
// 4 heads, or 128 with up to 2 (two rows: as long as their outputs fit the
// registers), where BestDotIsa is kAvx512Vnni; null otherwise (the
// portable loop runs, a row at a time).
AttendRowsFn FastAttendRows(int head_dim, int heads, int rows);

}  // namespace kdn::engine::internal
