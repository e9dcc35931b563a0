// QuantPanels (quant_panels.h): the layout, the scalar kernel (the sum as
// written there, for CPUs without AVX2 and as the vector kernels' peer),
// and which kernel runs. Built with -ffp-contract=off like quant.cpp: each
// fma is written as one.
#include "kdn/engine/quant_panels.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "kdn/common/half.h"
#include "quant_kernels.h"

namespace kdn::engine {

namespace {

using model::GgmlType;

uint16_t U16At(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// Where a block's stored values start, and the format's bytes per block.
int ValuesOffset(GgmlType type) { return type == GgmlType::kQ4_1 ? 4 : 2; }

// Value k (0..31) of row j in a panel block: its byte and whether it is the
// high nibble (Q4) — group g = k / 4 of the block, at 64 g + 4 j + k % 4
// (Q8_0); Q4 folds groups 4..7 onto the high nibbles of groups 0..3.
int PanelByte(GgmlType type, int j, int k, bool* high) {
  if (type == GgmlType::kQ8_0) {
    *high = false;
    return 64 * (k / 4) + 4 * j + k % 4;
  }
  *high = k >= 16;
  const int kk = k % 16;
  return 64 * (kk / 4) + 4 * j + kk % 4;
}

// Row j's stored integer k of a panel block (Q4: 0..15; Q8_0: -128..127).
int PanelValue(GgmlType type, const uint8_t* q, int j, int k) {
  bool high = false;
  const uint8_t byte = q[PanelByte(type, j, k, &high)];
  if (type == GgmlType::kQ8_0) return static_cast<int>(byte) - 128;
  return high ? byte >> 4 : byte & 0x0F;
}

void ProductScalar(const internal::PanelView& w, const ActBlock* x, int64_t x_stride, int64_t rows,
                   float* out) {
  const int block_bytes = QuantPanels::BlockBytes(w.type);
  for (int64_t i = 0; i < rows; ++i) {
    const ActBlock* xi = x + i * x_stride;
    for (int j = 0; j < kPanelRows; ++j) {
      float acc = 0.0f;
      for (int64_t b = 0; b < w.blocks; ++b) {
        const uint8_t* q = w.q + b * block_bytes;
        int32_t sum = 0;
        for (int k = 0; k < kQuantBlock; ++k) sum += PanelValue(w.type, q, j, k) * xi[b].q[k];
        const float d = F16ToF32(w.d[b * kPanelRows + j]);
        acc = std::fma(static_cast<float>(sum), d * xi[b].d, acc);
        if (w.type == GgmlType::kQ4_0) acc = std::fma(-8.0f * d, xi[b].s, acc);
        if (w.type == GgmlType::kQ4_1)
          acc = std::fma(F16ToF32(w.m[b * kPanelRows + j]), xi[b].s, acc);
      }
      out[i * kPanelRows + j] = acc;
    }
  }
}

PanelIsa DetectPanelIsa() {
  PanelIsa isa = PanelIsa::kScalar;
  switch (BestDotIsa()) {
    case DotIsa::kScalar: break;
    case DotIsa::kAvx2: isa = PanelIsa::kAvx2; break;
    case DotIsa::kAvx512Vnni: isa = PanelIsa::kAvx512Vnni; break;
  }
  const char* cap = std::getenv("KDN_CPU_ISA");
  const bool capped = cap != nullptr && std::string_view(cap) == "avx512";
  if (isa == PanelIsa::kAvx512Vnni && !capped && internal::AmxUsable()) isa = PanelIsa::kAmx;
  return isa;
}

}  // namespace

const char* PanelIsaName(PanelIsa isa) {
  switch (isa) {
    case PanelIsa::kScalar: return "scalar";
    case PanelIsa::kAvx2: return "avx2";
    case PanelIsa::kAvx512Vnni: return "avx512-vnni";
    case PanelIsa::kAmx: return "amx";
  }
  return "?";
}

PanelIsa BestPanelIsa() {
  static const PanelIsa isa = DetectPanelIsa();
  return isa;
}

bool QuantPanels::Holds(GgmlType type) {
  // The formats whose dot products take quantized activations.
  const QuantTraits* t = FindQuantTraits(type);
  return t != nullptr && t->quantized_x;
}

int QuantPanels::BlockBytes(GgmlType type) { return type == GgmlType::kQ8_0 ? 512 : 256; }

QuantPanels QuantPanels::FromRows(GgmlType type, const uint8_t* data, int64_t rows, int64_t cols) {
  QuantPanels p;
  p.type_ = type;
  p.rows_ = rows;
  p.blocks_ = cols / kQuantBlock;
  const int64_t panel_blocks = p.panels() * p.blocks_;
  const int block_bytes = BlockBytes(type);
  const int stored = FindQuantTraits(type)->block_bytes;
  const int values = ValuesOffset(type);
  // Padding rows: every value zero (Q8_0 stores 0 as 128), scales zero.
  p.q_.assign(static_cast<size_t>(panel_blocks * block_bytes),
              type == GgmlType::kQ8_0 ? uint8_t{128} : uint8_t{0});
  p.d_.assign(static_cast<size_t>(panel_blocks * kPanelRows), 0);
  if (type == GgmlType::kQ4_1) p.m_.assign(p.d_.size(), 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t panel = r / kPanelRows;
    const int j = static_cast<int>(r % kPanelRows);
    for (int64_t b = 0; b < p.blocks_; ++b) {
      const uint8_t* src = data + (r * p.blocks_ + b) * stored;
      const int64_t pb = panel * p.blocks_ + b;
      uint8_t* q = &p.q_[pb * block_bytes];
      p.d_[pb * kPanelRows + j] = U16At(src);
      if (type == GgmlType::kQ4_1) p.m_[pb * kPanelRows + j] = U16At(src + 2);
      for (int k = 0; k < kQuantBlock; ++k) {
        bool high = false;
        uint8_t& byte = q[PanelByte(type, j, k, &high)];
        if (type == GgmlType::kQ8_0) {
          byte = static_cast<uint8_t>(src[values + k] ^ 0x80);
        } else {
          // GGUF: byte k % 16 holds value k in its low nibble (k < 16) or
          // its high one.
          const uint8_t v = k < 16 ? src[values + k] & 0x0F : src[values + k - 16] >> 4;
          byte = static_cast<uint8_t>(high ? (byte & 0x0F) | (v << 4) : (byte & 0xF0) | v);
        }
      }
    }
  }
  return p;
}

void QuantPanels::RowBlocks(int64_t r, int64_t b0, int64_t b1, uint8_t* out) const {
  const int64_t panel = r / kPanelRows;
  const int j = static_cast<int>(r % kPanelRows);
  const int block_bytes = BlockBytes(type_);
  const int stored = FindQuantTraits(type_)->block_bytes;
  const int values = ValuesOffset(type_);
  for (int64_t b = b0; b < b1; ++b, out += stored) {
    const int64_t pb = panel * blocks_ + b;
    const uint8_t* q = &q_[pb * block_bytes];
    std::memcpy(out, &d_[pb * kPanelRows + j], 2);
    if (type_ == GgmlType::kQ4_1) std::memcpy(out + 2, &m_[pb * kPanelRows + j], 2);
    if (type_ == GgmlType::kQ8_0) {
      for (int k = 0; k < kQuantBlock; ++k) {
        out[values + k] = static_cast<uint8_t>(PanelValue(type_, q, j, k));
      }
    } else {
      for (int k = 0; k < 16; ++k) {
        out[values + k] =
            static_cast<uint8_t>(PanelValue(type_, q, j, k) | PanelValue(type_, q, j, k + 16) << 4);
      }
    }
  }
}

void QuantPanels::Product(PanelIsa isa, int64_t panel, const ActBlock* x, int64_t x_stride,
                          int64_t rows, float* out) const {
  const int64_t pb = panel * blocks_;
  const internal::PanelView view{type_, blocks_, &q_[pb * BlockBytes(type_)], &d_[pb * kPanelRows],
                                 m_.empty() ? nullptr : &m_[pb * kPanelRows]};
  if (isa == PanelIsa::kAmx) {
    // Whole tiles of 16 rows on AMX, the rest on AVX-512 VNNI.
    const int64_t tiles = rows / kPanelRows * kPanelRows;
    if (tiles > 0) internal::PanelKernel(type_, isa)(view, x, x_stride, tiles, out);
    x += tiles * x_stride;
    out += tiles * kPanelRows;
    rows -= tiles;
    isa = PanelIsa::kAvx512Vnni;
    if (rows == 0) return;
  }
  const internal::PanelFn fn = internal::PanelKernel(type_, isa);
  if (fn == nullptr) {
    ProductScalar(view, x, x_stride, rows, out);
  } else {
    fn(view, x, x_stride, rows, out);
  }
}

}  // namespace kdn::engine
