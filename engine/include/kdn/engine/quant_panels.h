#pragma once
// QuantPanels: a Q8_0, Q4_0 or Q4_1 weight matrix laid out for its products,
// and the one sum every product of it computes, whatever the instructions.
//
// Layout: the rows in panels of kPanelRows (the last panel padded with zero
// rows); in a panel, each block of 32 columns holds its 16 rows' values four
// columns at a time: group g (columns 4g..4g+3) is 64 bytes, row j's four
// values at bytes 4j..4j+3. That is the B operand of an AMX tile product and
// of a VNNI dot product with the activation's four bytes broadcast, so lane
// j of one instruction accumulates row j. Q8_0 stores each value plus 128
// (an unsigned byte; the sum takes 128 times the activation block's sum
// back); Q4_0 and Q4_1 store two groups per 64 bytes, group c (c < 4) in the
// low nibbles and group c + 4 in the high ones. The scales (and Q4_1's
// minimums) stay f16, 16 per panel block, side by side.
//
// The sum (one per weight row j and activation row i): for each block b in
// order, with the exact integer sum isum_b of the 32 products of the
// weight's stored integers (Q4's unsigned nibbles, Q8_0's signed bytes) and
// the activation's int8 values,
//   acc = fma(float(isum_b), d_w * d_a, acc)
//   acc = fma(c_w, s_a, acc)        (Q4_0: c_w = -8 d_w; Q4_1: c_w = m_w)
// from acc = 0, where d_a and s_a are the activation block's scale and
// scaled sum (ActBlock). Integer sums are exact in any order and every float
// step is one rounding in a fixed order, so each kernel below (scalar, AVX2,
// AVX-512 VNNI, AMX) gives the same bits for every row, whatever rows are
// computed beside it: the engine's batch invariance (docs/engine.md) and the
// same products from every x86 CPU.
//
// Thread-safe: const after construction.

#include <cstdint>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/quant.h"

namespace kdn::engine {

constexpr int kPanelRows = 16;

// The instructions a panel product runs, each level needing the one below.
enum class PanelIsa { kScalar, kAvx2, kAvx512Vnni, kAmx };
const char* PanelIsaName(PanelIsa isa);
// The best this CPU and kernel allow: AMX where the CPU has AMX-INT8 and
// Linux grants the tile state (arch_prctl), else BestDotIsa's level.
// KDN_CPU_ISA=scalar|avx2|avx512 lowers it.
PanelIsa BestPanelIsa();

class QuantPanels {
 public:
  // Whether `type` is one of the formats held this way.
  static bool Holds(model::GgmlType type);
  // From `rows` rows of `cols` values (whole blocks) in the format's blocks
  // as a GGUF file stores them, row after row.
  static QuantPanels FromRows(model::GgmlType type, const uint8_t* data, int64_t rows,
                              int64_t cols);

  model::GgmlType type() const { return type_; }
  int64_t rows() const { return rows_; }
  int64_t blocks() const { return blocks_; }
  int64_t panels() const { return (rows_ + kPanelRows - 1) / kPanelRows; }
  size_t bytes() const { return q_.size() + 2 * (d_.size() + m_.size()); }

  // Blocks b0..b1-1 of row r as the format stores them, bit for bit what
  // FromRows was given.
  void RowBlocks(int64_t r, int64_t b0, int64_t b1, uint8_t* out) const;

  // The sums of the panel's 16 rows with `rows` activation rows (each
  // blocks() ActBlocks, x_stride ActBlocks apart): out[i * kPanelRows + j]
  // for row j of the panel and activation row i. Padding rows give zeros.
  // The same bits for every isa up to BestPanelIsa().
  void Product(PanelIsa isa, int64_t panel, const ActBlock* x, int64_t x_stride, int64_t rows,
               float* out) const;

  // Bytes of one panel block of values: 512 for Q8_0, 256 for Q4.
  static int BlockBytes(model::GgmlType type);

 private:
  model::GgmlType type_ = model::GgmlType::kF32;
  int64_t rows_ = 0, blocks_ = 0;
  std::vector<uint8_t> q_;   // [panel][block][BlockBytes]
  std::vector<uint16_t> d_;  // [panel][block][kPanelRows], f16
  std::vector<uint16_t> m_;  // Q4_1's minimums, as d_; else empty
};

}  // namespace kdn::engine
