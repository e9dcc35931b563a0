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
  // One quantized row goes through the one-row dot product unpaired (the
  // same sums, bit for bit: quant.h); more through the multi-row one.
  const DotRowsFn dot_rows = m == 1 && traits_->quantized_x ? nullptr : DotRowsFor(*traits_, isa);
  const void* xs = x;
  int64_t x_stride = ldx * static_cast<int64_t>(sizeof(float));  // bytes between rows
  if (traits_->quantized_x) {
    const int64_t blocks = cols_ / kQuantBlock;
    scratch.act.resize(static_cast<size_t>(m * blocks));
    for (int64_t i = 0; i < m; ++i)
      QuantizeActivations(x + i * ldx, cols_, &scratch.act[i * blocks]);
    xs = scratch.act.data();
    x_stride = blocks * static_cast<int64_t>(sizeof(ActBlock));
    if (dot_rows != nullptr) {
      const int64_t pairs = ActPairCount(cols_);
      scratch.pairs.resize(static_cast<size_t>(m * pairs));
      for (int64_t i = 0; i < m; ++i) {
        PairActivations(&scratch.act[i * blocks], cols_, &scratch.pairs[i * pairs]);
      }
      xs = scratch.pairs.data();
      x_stride = pairs * static_cast<int64_t>(sizeof(ActPair));
    }
  }
  const auto* xb = static_cast<const uint8_t*>(xs);
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

void WeightMatrix::Product(int64_t m, const float* x, int64_t ldx, float* y, int64_t ldy,
                           bool accumulate, ProductScratch& scratch) const {
  if (m <= 0 || rows_ == 0) return;
  DotRows(m, x, ldx, y, ldy, accumulate, scratch, BestDotIsa());
}

void WeightMatrix::ProductScalar(int64_t m, const float* x, int64_t ldx, float* y,
                                 int64_t ldy) const {
  ProductScratch scratch;
  DotRows(m, x, ldx, y, ldy, /*accumulate=*/false, scratch, DotIsa::kScalar);
}

}  // namespace kdn::engine
