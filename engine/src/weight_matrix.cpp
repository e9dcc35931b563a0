#include "kdn/engine/weight_matrix.h"

#include <cblas.h>
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
    w.bytes_ = std::move(t.bytes);
  }
  return w;
}

Result<WeightMatrix> WeightMatrix::Stack(WeightMatrix a, WeightMatrix b) {
  if (a.traits_ != b.traits_ || a.cols_ != b.cols_) {
    return InvalidArgument(std::string("cannot stack a ") + a.traits_->name + " matrix of " +
                           std::to_string(a.cols_) + " columns on a " + b.traits_->name +
                           " one of " + std::to_string(b.cols_));
  }
  a.f32_.insert(a.f32_.end(), b.f32_.begin(), b.f32_.end());
  a.bytes_.insert(a.bytes_.end(), b.bytes_.begin(), b.bytes_.end());
  a.rows_ += b.rows_;
  return a;
}

void WeightMatrix::RowToFloat(int64_t r, float* out) const {
  traits_->to_float(Row(r), cols_, out);
}

void WeightMatrix::DotRows(int64_t m, const float* x, int64_t ldx, float* y, int64_t ldy,
                           bool accumulate, ProductScratch& scratch, DotIsa isa) const {
  const DotFn dot = DotFor(*traits_, isa);
  const void* xs = x;
  int64_t x_stride = ldx * static_cast<int64_t>(sizeof(float));  // bytes between rows
  if (traits_->quantized_x) {
    const int64_t blocks = cols_ / kQuantBlock;
    scratch.act.resize(static_cast<size_t>(m * blocks));
    for (int64_t i = 0; i < m; ++i)
      QuantizeActivations(x + i * ldx, cols_, &scratch.act[i * blocks]);
    xs = scratch.act.data();
    x_stride = blocks * static_cast<int64_t>(sizeof(ActBlock));
  }
  const auto* xb = static_cast<const uint8_t*>(xs);
  const int64_t row_bytes = traits_->RowBytes(cols_);
  const uint8_t* base = data();
  const int64_t n = rows_, k = cols_;
  if (const DotRowsFn dot_rows = m > 1 ? DotRowsFor(*traits_, isa) : nullptr) {
    // Activation rows kDotRowsMax at a time against each weight row.
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && n * m * k > 16384)
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* wj = base + j * row_bytes;
      float v[kDotRowsMax];
      for (int64_t i = 0; i < m; i += kDotRowsMax) {
        const int rows = static_cast<int>(std::min<int64_t>(kDotRowsMax, m - i));
        dot_rows(wj, xb + i * x_stride, x_stride, rows, k, v);
        for (int r = 0; r < rows; ++r) {
          float& out = y[(i + r) * ldy + j];
          out = accumulate ? out + v[r] : v[r];
        }
      }
    }
    return;
  }
  // Serial under a parallel region (a caller's threads) and for tiny work.
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && n * m * k > 16384)
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* wj = base + j * row_bytes;
    for (int64_t i = 0; i < m; ++i) {
      const float v = dot(wj, xb + i * x_stride, k);
      float& out = y[i * ldy + j];
      out = accumulate ? out + v : v;
    }
  }
}

void WeightMatrix::Product(int64_t m, const float* x, int64_t ldx, float* y, int64_t ldy,
                           bool accumulate, ProductScratch& scratch) const {
  if (m <= 0 || rows_ == 0) return;
  const float beta = accumulate ? 1.0f : 0.0f;
  if (traits_->type == GgmlType::kF32) {
    // f32: sgemm repacks the whole weight per call, which only pays for
    // itself past a few rows.
    if (m > 8) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, rows_, cols_, 1.0f, x, ldx,
                  f32_.data(), cols_, beta, y, ldy);
      return;
    }
    DotRows(m, x, ldx, y, ldy, accumulate, scratch, BestDotIsa());
    return;
  }
  if (m <= kIntegerMaxRows) {
    DotRows(m, x, ldx, y, ldy, accumulate, scratch, BestDotIsa());
    return;
  }
  const int64_t tile = std::min(kTileRows, rows_);
  scratch.tile.resize(static_cast<size_t>(tile * cols_));
  for (int64_t j0 = 0; j0 < rows_; j0 += tile) {
    const int64_t t = std::min(tile, rows_ - j0);
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < t; ++j) RowToFloat(j0 + j, &scratch.tile[j * cols_]);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, t, cols_, 1.0f, x, ldx,
                scratch.tile.data(), cols_, beta, y + j0, ldy);
  }
}

void WeightMatrix::ProductScalar(int64_t m, const float* x, int64_t ldx, float* y,
                                 int64_t ldy) const {
  ProductScratch scratch;
  DotRows(m, x, ldx, y, ldy, /*accumulate=*/false, scratch, DotIsa::kScalar);
}

}  // namespace kdn::engine
