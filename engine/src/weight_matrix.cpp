#include "kdn/engine/weight_matrix.h"

#include <omp.h>

#include <algorithm>

namespace kdn::engine {

using model::GgmlType;

Result<WeightMatrix> WeightMatrix::FromTensor(HostTensor t, const std::string& name) {
  if (t.shape.size() != 2) {
    return InvalidArgument("weight \"" + name + "\" has shape " + ShapeToString(t.shape) +
                           "; a matrix has two dimensions");
  }
  const QuantTraits* traits = FindQuantTraits(t.type);
  if (traits == nullptr) {
    return InvalidArgument("weight \"" + name + "\": ggml type " +
                           std::to_string(static_cast<uint32_t>(t.type)) +
                           " has no dot product here (F32, F16, BF16, Q8_0, Q4_0, Q4_1)");
  }
  WeightMatrix w;
  w.traits_ = traits;
  w.rows_ = t.shape[0];
  w.cols_ = t.shape[1];
  if (w.cols_ % traits->block_values != 0) {
    return InvalidArgument("weight \"" + name + "\": rows of " + std::to_string(w.cols_) +
                           " values are not whole " + traits->name + " blocks of " +
                           std::to_string(traits->block_values));
  }
  const size_t want = static_cast<size_t>(traits->RowBytes(w.cols_) * w.rows_);
  if (t.type == GgmlType::kF32) {
    if (t.data.size() * 4 != want) {
      return InvalidArgument("weight \"" + name + "\": " + std::to_string(t.data.size()) +
                             " floats for shape " + ShapeToString(t.shape));
    }
    w.f32_ = std::move(t.data);
  } else {
    if (t.bytes.size() != want) {
      return InvalidArgument("weight \"" + name + "\": " + std::to_string(t.bytes.size()) +
                             " bytes of " + traits->name + " for shape " + ShapeToString(t.shape) +
                             ", expected " + std::to_string(want));
    }
    if (QuantPanels::Holds(t.type)) {
      w.panels_ = QuantPanels::FromRows(t.type, t.bytes.data(), w.rows_, w.cols_);
    } else {
      w.bytes_ = std::move(t.bytes);
    }
  }
  return w;
}

Result<WeightMatrix> WeightMatrix::Stack(WeightMatrix a, WeightMatrix b) {
  if (a.traits_ != b.traits_ || a.cols_ != b.cols_) {
    return InvalidArgument(std::string("cannot stack a ") + a.traits_->name + " matrix of " +
                           std::to_string(a.cols_) + " columns on a " + b.traits_->name +
                           " one of " + std::to_string(b.cols_));
  }
  if (a.quantized()) {
    // The panels rebuilt over both matrices' rows as the file stored them.
    const int64_t row_bytes = a.traits_->RowBytes(a.cols_);
    std::vector<uint8_t> rows(static_cast<size_t>((a.rows_ + b.rows_) * row_bytes));
    const int64_t blocks = a.panels_.blocks();
    for (int64_t r = 0; r < a.rows_; ++r) a.panels_.RowBlocks(r, 0, blocks, &rows[r * row_bytes]);
    for (int64_t r = 0; r < b.rows_; ++r) {
      b.panels_.RowBlocks(r, 0, blocks, &rows[(a.rows_ + r) * row_bytes]);
    }
    a.panels_ = QuantPanels::FromRows(a.traits_->type, rows.data(), a.rows_ + b.rows_, a.cols_);
  }
  a.f32_.insert(a.f32_.end(), b.f32_.begin(), b.f32_.end());
  a.bytes_.insert(a.bytes_.end(), b.bytes_.begin(), b.bytes_.end());
  a.rows_ += b.rows_;
  return a;
}

void WeightMatrix::RowToFloat(int64_t r, float* out) const {
  if (!quantized()) {
    traits_->to_float(Row(r), cols_, out);
    return;
  }
  // A quantized row rebuilt from its panel a few blocks at a time (no
  // allocation: an embedding lookup per token runs this).
  constexpr int64_t kStep = 8;
  uint8_t blocks[kStep * 34];  // 34 bytes: a Q8_0 block, the largest
  for (int64_t b = 0; b < panels_.blocks(); b += kStep) {
    const int64_t e = std::min(panels_.blocks(), b + kStep);
    panels_.RowBlocks(r, b, e, blocks);
    traits_->to_float(blocks, (e - b) * kQuantBlock, out + b * kQuantBlock);
  }
}

void WeightMatrix::DotRows(int64_t m, const float* x, int64_t ldx, float* y, int64_t ldy,
                           bool accumulate, DotIsa isa) const {
  const DotFn dot = DotFor(*traits_, isa);
  const DotRowsFn dot_rows = DotRowsFor(*traits_, isa);
  const auto* xb = reinterpret_cast<const uint8_t*>(x);
  const int64_t x_stride = ldx * static_cast<int64_t>(sizeof(float));  // bytes between rows
  const int64_t row_bytes = traits_->RowBytes(cols_);
  const uint8_t* base = data();
  const int64_t n = rows_, k = cols_;
  // kRowBlock activation rows at a time, so that they stay in cache while
  // every weight row passes; threads split the weight rows. Which rows are
  // computed together changes nothing in any one row's result: every
  // (weight row, activation row) is the same dot product in the same order.
  for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
    const int64_t i1 = std::min(m, i0 + kRowBlock);
    // Serial under a parallel region (a caller's threads) and for tiny work.
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && n * (i1 - i0) * k > 16384)
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* wj = base + j * row_bytes;
      float v[kDotRowsMax];
      for (int64_t i = i0; i < i1; i += kDotRowsMax) {
        const int rows = static_cast<int>(std::min<int64_t>(kDotRowsMax, i1 - i));
        if (dot_rows != nullptr) {
          dot_rows(wj, xb + i * x_stride, x_stride, rows, k, v);
        } else {
          for (int r = 0; r < rows; ++r) v[r] = dot(wj, xb + (i + r) * x_stride, k);
        }
        for (int r = 0; r < rows; ++r) {
          float& out = y[(i + r) * ldy + j];
          out = accumulate ? out + v[r] : v[r];
        }
      }
    }
  }
}

void WeightMatrix::PanelRows(int64_t m, const float* x, int64_t ldx, float* y, int64_t ldy,
                             bool accumulate, ProductScratch& scratch, PanelIsa isa) const {
  const int64_t blocks = cols_ / kQuantBlock;
  scratch.act.resize(static_cast<size_t>(m * blocks));
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && m * cols_ > 16384)
  for (int64_t i = 0; i < m; ++i) QuantizeActivations(x + i * ldx, cols_, &scratch.act[i * blocks]);
  const ActBlock* act = scratch.act.data();
  const int64_t panels = panels_.panels(), k = cols_;
  // As DotRows: kRowBlock activation rows per pass, threads splitting the
  // panels; each panel's product gives every row the same bits whatever
  // rows are beside it (quant_panels.h).
  for (int64_t i0 = 0; i0 < m; i0 += kRowBlock) {
    const int64_t i1 = std::min(m, i0 + kRowBlock);
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && \
                                              panels * kPanelRows * (i1 - i0) * k > 16384)
    for (int64_t p = 0; p < panels; ++p) {
      float v[kRowBlock * kPanelRows];
      panels_.Product(isa, p, act + i0 * blocks, blocks, i1 - i0, v);
      const int64_t j0 = p * kPanelRows, cols = std::min<int64_t>(kPanelRows, rows_ - j0);
      for (int64_t i = i0; i < i1; ++i) {
        const float* vi = v + (i - i0) * kPanelRows;
        float* yi = y + i * ldy + j0;
        for (int64_t j = 0; j < cols; ++j) yi[j] = accumulate ? yi[j] + vi[j] : vi[j];
      }
    }
  }
}

void WeightMatrix::Product(int64_t m, const float* x, int64_t ldx, float* y, int64_t ldy,
                           bool accumulate, ProductScratch& scratch) const {
  if (m <= 0 || rows_ == 0) return;
  if (quantized()) {
    PanelRows(m, x, ldx, y, ldy, accumulate, scratch, BestPanelIsa());
  } else {
    DotRows(m, x, ldx, y, ldy, accumulate, BestDotIsa());
  }
}

void WeightMatrix::ProductScalar(int64_t m, const float* x, int64_t ldx, float* y,
                                 int64_t ldy) const {
  ProductWith(PanelIsa::kScalar, m, x, ldx, y, ldy);
}

void WeightMatrix::ProductWith(PanelIsa isa, int64_t m, const float* x, int64_t ldx, float* y,
                               int64_t ldy) const {
  if (m <= 0 || rows_ == 0) return;
  if (quantized()) {
    ProductScratch scratch;
    PanelRows(m, x, ldx, y, ldy, /*accumulate=*/false, scratch, isa);
  } else {
    const DotIsa dot = isa == PanelIsa::kScalar ? DotIsa::kScalar
                       : isa == PanelIsa::kAvx2 ? DotIsa::kAvx2
                                                : BestDotIsa();
    DotRows(m, x, ldx, y, ldy, /*accumulate=*/false, dot);
  }
}

}  // namespace kdn::engine
