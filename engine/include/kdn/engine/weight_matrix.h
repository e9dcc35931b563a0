#pragma once
// WeightMatrix: a weight matrix [rows][cols] of a Linear layer kept in the
// format it was stored in (quant.h: F32, F16, BF16, Q8_0, Q4_0, Q4_1), and its
// product with a few rows of activations, apart from attention's own matrix
// products.
//
// Product: the quantized formats (Q8_0, Q4_0, Q4_1) are held as panels of 16
// rows (quant_panels.h) and each activation row is quantized once to 8 bits;
// a panel's product takes AMX tiles of 16 activation rows where the CPU has
// them, else AVX-512 VNNI (or AVX2) a few rows at a time. F32, F16 and BF16
// rows are dotted with the floats as they are, up to kDotRowsMax activation
// rows against one weight row at a time. kRowBlock activation rows per pass
// over the weight, threads splitting the output rows.
//
// Batch invariance: a row's result does not depend on how many rows are
// computed beside it, nor on which: one row alone, a decode batch of 32 and
// a prefill of thousands give each row the same bits (every kernel sums each
// row in one order whatever the rows beside it, quant_panels.h). So a prompt
// computed whole, in pieces after a cached prefix, or beside other requests
// gives the same logits, and greedy answers do not depend on the path a
// request took (docs/engine.md, "Batch invariance").
// No allocation per call once the ProductScratch has grown.
//
// Thread-compatible: Product runs OpenMP threads inside; one caller at a time
// per scratch.

#include <cstdint>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/quant.h"
#include "kdn/engine/quant_panels.h"
#include "kdn/engine/tensor.h"

namespace kdn::engine {

// A caller's buffers for WeightMatrix::Product, kept across calls.
struct ProductScratch {
  std::vector<ActBlock> act;  // the activation rows, quantized
};

class WeightMatrix {
 public:
  // Activation rows per pass over the weight.
  static constexpr int64_t kRowBlock = 64;

  WeightMatrix() = default;
  // From a 2-D tensor (HostTensor: f32 values or a format's bytes), consumed.
  // InvalidArgument for another rank, a format without traits, or columns
  // that are not whole blocks of the format; `name` goes into the message.
  static Result<WeightMatrix> FromTensor(HostTensor tensor, const std::string& name);
  // The rows of `b` after those of `a` (a fused projection); both of one
  // format and width, else InvalidArgument.
  static Result<WeightMatrix> Stack(WeightMatrix a, WeightMatrix b);

  bool empty() const { return rows_ == 0; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  const QuantTraits& traits() const { return *traits_; }
  // Bytes the matrix holds.
  size_t bytes() const {
    if (traits_ == nullptr) return 0;
    return quantized() ? panels_.bytes() : traits_->RowBytes(cols_) * rows_;
  }

  // Row r as cols() floats.
  void RowToFloat(int64_t r, float* out) const;
  // y[i][j] = (accumulate ? y[i][j] : 0) + sum_k x[i][k] * W[j][k], for
  // i < m, j < rows(); x has leading dimension ldx, y ldy.
  void Product(int64_t m, const float* x, int64_t ldx, float* y, int64_t ldy, bool accumulate,
               ProductScratch& scratch) const;
  // The same through the scalar dot products alone (the tests' reference).
  void ProductScalar(int64_t m, const float* x, int64_t ldx, float* y, int64_t ldy) const;
  // The same with a quantized format's panel kernels for `isa` (up to
  // BestPanelIsa()); the tests hold every level to the same bits.
  void ProductWith(PanelIsa isa, int64_t m, const float* x, int64_t ldx, float* y,
                   int64_t ldy) const;

 private:
  // Held as QuantPanels (QuantPanels::Holds).
  bool quantized() const { return traits_->quantized_x; }
  const uint8_t* Row(int64_t r) const { return data() + r * traits_->RowBytes(cols_); }
  const uint8_t* data() const {
    return f32_.empty() ? bytes_.data() : reinterpret_cast<const uint8_t*>(f32_.data());
  }
  void DotRows(int64_t m, const float* x, int64_t ldx, float* y, int64_t ldy, bool accumulate,
               DotIsa isa) const;
  void PanelRows(int64_t m, const float* x, int64_t ldx, float* y, int64_t ldy, bool accumulate,
                 ProductScratch& scratch, PanelIsa isa) const;

  const QuantTraits* traits_ = nullptr;
  int64_t rows_ = 0, cols_ = 0;
  std::vector<float> f32_;      // an F32 matrix
  std::vector<uint8_t> bytes_;  // an F16 or BF16 matrix
  QuantPanels panels_;          // a Q8_0, Q4_0 or Q4_1 matrix
};

}  // namespace kdn::engine
