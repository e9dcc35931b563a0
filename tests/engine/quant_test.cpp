// The weight formats' kernels (quant.h) and WeightMatrix's product, each
// format one row checked in the same loops: every instruction set this CPU
// has against the scalar reference, and the product against the dequantized
// matrix's f32 product with a bound derived from the activation's rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kdn/engine/cpu_engine.h"
#include "kdn/engine/cpu_ops.h"
#include "kdn/engine/presets.h"
#include "kdn/engine/quant.h"
#include "kdn/engine/quant_panels.h"
#include "kdn/engine/weight_matrix.h"
#include "quant_encode.h"
#include "kdn/testing/tiny_model.h"

namespace kdn::engine {
namespace {

using model::GgmlType;

std::vector<float> Random(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& f : v) f = dist(rng);
  return v;
}

WeightMatrix Matrix(GgmlType type, int64_t rows, int64_t cols, uint32_t seed) {
  HostTensor t;
  t.shape = {rows, cols};
  t.type = type;
  const std::vector<float> v = Random(rows * cols, seed, 0.05f);
  if (type == GgmlType::kF32) {
    t.data = v;
  } else {
    t.bytes = Encode(type, v);
  }
  auto w = WeightMatrix::FromTensor(std::move(t), "w");
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  return std::move(w).value();
}

// Columns to try per format: block multiples for the quantized ones (an odd
// number of blocks exercises the AVX-512 pair loop's tail), any width else.
std::vector<int64_t> Widths(const QuantTraits& t) {
  if (t.block_values > 1) return {32, 96, 160, 576};
  return {1, 7, 37, 64, 100, 576};
}

std::vector<DotIsa> Isas() {
  std::vector<DotIsa> out;
  for (DotIsa i : {DotIsa::kScalar, DotIsa::kAvx2, DotIsa::kAvx512Vnni}) {
    if (static_cast<int>(i) <= static_cast<int>(BestDotIsa())) out.push_back(i);
  }
  return out;
}

TEST(Quant, EveryFormatHasARow) {
  for (GgmlType t : {GgmlType::kF32, GgmlType::kF16, GgmlType::kBF16, GgmlType::kQ8_0,
                     GgmlType::kQ4_0, GgmlType::kQ4_1}) {
    ASSERT_NE(FindQuantTraits(t), nullptr) << static_cast<int>(t);
  }
  EXPECT_EQ(FindQuantTraits(GgmlType::kQ6_K), nullptr);
}

TEST(Quant, ActivationsRoundToHalfAStep) {
  std::vector<float> x = Random(96, 3);
  x[40] = 0.0f;
  std::fill(x.begin() + 64, x.end(), 0.0f);  // an all-zero block
  std::vector<ActBlock> q(3);
  QuantizeActivations(x.data(), 96, q.data());
  for (int b = 0; b < 3; ++b) {
    int sum = 0;
    for (int i = 0; i < kQuantBlock; ++i) {
      EXPECT_LE(std::fabs(x[b * 32 + i] - q[b].d * q[b].q[i]), q[b].d / 2 + 1e-7f);
      sum += q[b].q[i];
    }
    EXPECT_FLOAT_EQ(q[b].s, q[b].d * sum);
  }
  EXPECT_EQ(q[2].d, 0.0f);
}

// QuantizeActivations (AVX-512 where the CPU has it) against the scalar
// loop, bit for bit: scales of several binades, an all-zero block, a block
// whose maximum is tiny, values exactly halfway between steps.
TEST(Quant, ActivationsAreTheScalarLoopsBitForBit) {
  std::vector<float> x = Random(32 * 40, 8);
  for (int b = 0; b < 40; ++b) {
    for (int i = 0; i < 32; ++i) x[b * 32 + i] *= std::exp2(static_cast<float>(b % 20 - 10));
  }
  std::fill_n(&x[32 * 3], 32, 0.0f);
  std::fill_n(&x[32 * 4], 32, 1e-40f);
  for (int i = 0; i < 32; ++i) x[32 * 5 + i] = (i - 16) * 0.5f + (i == 0 ? 127 : 0);  // halves
  std::vector<ActBlock> a(40), b(40);
  QuantizeActivations(x.data(), 32 * 40, a.data());
  QuantizeActivationsScalar(x.data(), 32 * 40, b.data());
  // The tiny block quantizes to zero (its scale's inverse is not finite).
  EXPECT_EQ(b[4].d, 0.0f);
  EXPECT_EQ(b[4].sum, 0);
  for (int k = 0; k < 40; ++k) {
    EXPECT_EQ(std::memcmp(a[k].q, b[k].q, 32), 0) << "block " << k;
    EXPECT_EQ(a[k].d, b[k].d) << k;
    EXPECT_EQ(a[k].s, b[k].s) << k;
    EXPECT_EQ(a[k].sum, b[k].sum) << k;
  }
}

// Each instruction set's dot product against the scalar one on the same
// inputs: equal up to float summation order (the quantized formats' is the
// scalar one at every level; their vector sums are QuantPanels').
TEST(Quant, VectorDotProductsMatchTheScalarReference) {
  for (const QuantTraits& t : AllQuantTraits()) {
    for (int64_t n : Widths(t)) {
      const std::vector<float> wf = Random(n, 11, 0.05f), xf = Random(n, 12);
      const std::vector<uint8_t> w = Encode(t.type, wf);
      std::vector<ActBlock> xq(static_cast<size_t>(std::max<int64_t>(1, n / kQuantBlock)));
      if (t.quantized_x) QuantizeActivations(xf.data(), n, xq.data());
      const void* x = t.quantized_x ? static_cast<const void*>(xq.data()) : xf.data();
      std::vector<float> wd(n);
      t.to_float(w.data(), n, wd.data());
      double mag = 0;
      for (int64_t i = 0; i < n; ++i) mag += std::fabs(wd[i] * xf[i]);
      const float ref = t.dot[0](w.data(), x, n);
      for (DotIsa isa : Isas()) {
        const float got = DotFor(t, isa)(w.data(), x, n);
        EXPECT_NEAR(got, ref, 1e-5 * mag + 1e-7) << t.name << " n=" << n << " " << DotIsaName(isa);
      }
    }
  }
}

// The float formats' multi-row dot products (where the CPU has them)
// against the scalar one per row, for 1 to kDotRowsMax rows.
TEST(Quant, MultiRowDotProductsMatchTheScalarReference) {
  for (const QuantTraits& t : AllQuantTraits()) {
    const DotRowsFn rows_fn = DotRowsFor(t, BestDotIsa());
    if (rows_fn == nullptr) continue;
    for (int64_t n : Widths(t)) {
      const std::vector<uint8_t> w = Encode(t.type, Random(n, 41, 0.05f));
      std::vector<float> xf(kDotRowsMax * n);
      for (int r = 0; r < kDotRowsMax; ++r) {
        const std::vector<float> v = Random(n, 50 + r);
        std::copy(v.begin(), v.end(), &xf[r * n]);
      }
      for (int rows = 1; rows <= kDotRowsMax; ++rows) {
        float out[kDotRowsMax];
        rows_fn(w.data(), xf.data(), n * 4, rows, n, out);
        for (int r = 0; r < rows; ++r) {
          const float ref = t.dot[0](w.data(), &xf[r * n], n);
          EXPECT_NEAR(out[r], ref, 1e-5 * std::fabs(ref) + 1e-4)
              << t.name << " n=" << n << " rows=" << rows << " r=" << r;
          // The same ISA's one-row dot product, bit for bit.
          EXPECT_EQ(out[r], DotFor(t, DotIsa::kAvx512Vnni)(w.data(), &xf[r * n], n))
              << t.name << " n=" << n << " rows=" << rows << " r=" << r;
        }
      }
    }
  }
}

// Rows of random blocks in a quantized format: any stored byte, scales
// (and Q4_1's minimums) of either sign over several binades, so that Q8_0's
// -128 and every nibble occur.
std::vector<uint8_t> RandomBlocks(const QuantTraits& t, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> mag(-12.0f, -2.0f), sign(-1.0f, 1.0f);
  std::vector<uint8_t> out(static_cast<size_t>(rows * t.RowBytes(cols)));
  const int halves = t.type == GgmlType::kQ4_1 ? 2 : 1;
  for (size_t b = 0; b < out.size(); b += static_cast<size_t>(t.block_bytes)) {
    for (int h = 0; h < halves; ++h) {
      PutHalf(std::copysign(std::exp2(mag(rng)), sign(rng)), &out[b + 2 * h]);
    }
    for (int i = 2 * halves; i < t.block_bytes; ++i) out[b + i] = static_cast<uint8_t>(byte(rng));
  }
  return out;
}

// QuantPanels: every row read back as stored, and every kernel this CPU has
// (scalar, AVX2, AVX-512 VNNI, AMX) giving, bit for bit, the scalar dot
// product of the row as the file stores it (quant.cpp, written apart from
// the panels), at row counts that fill AMX tiles, leave tails of each
// kernel's row groups and cross kRowBlock, on a matrix whose last panel is
// padded.
TEST(QuantPanels, EveryKernelGivesTheStoredRowsScalarSumBitForBit) {
  std::vector<PanelIsa> isas;
  for (PanelIsa i : {PanelIsa::kScalar, PanelIsa::kAvx2, PanelIsa::kAvx512Vnni, PanelIsa::kAmx}) {
    if (static_cast<int>(i) <= static_cast<int>(BestPanelIsa())) isas.push_back(i);
  }
  for (const QuantTraits& t : AllQuantTraits()) {
    if (!QuantPanels::Holds(t.type)) continue;
    for (int64_t cols : {32, 96, 576}) {
      const int64_t rows = 37, row_bytes = t.RowBytes(cols), blocks = cols / kQuantBlock;
      const std::vector<uint8_t> raw = RandomBlocks(t, rows, cols, 90 + static_cast<int>(cols));
      HostTensor tensor;
      tensor.shape = {rows, cols};
      tensor.type = t.type;
      tensor.bytes = raw;
      auto w = WeightMatrix::FromTensor(std::move(tensor), "w");
      ASSERT_TRUE(w.ok()) << w.status().ToString();
      const QuantPanels panels = QuantPanels::FromRows(t.type, raw.data(), rows, cols);
      std::vector<uint8_t> back(static_cast<size_t>(row_bytes));
      for (int64_t r = 0; r < rows; ++r) {
        panels.RowBlocks(r, 0, blocks, back.data());
        ASSERT_TRUE(std::equal(back.begin(), back.end(), raw.begin() + r * row_bytes))
            << t.name << " row " << r;
      }
      const int64_t most = 2 * WeightMatrix::kRowBlock + 5;
      const std::vector<float> x = Random(most * cols, 91);
      std::vector<ActBlock> xq(static_cast<size_t>(most * blocks));
      for (int64_t i = 0; i < most; ++i) QuantizeActivations(&x[i * cols], cols, &xq[i * blocks]);
      for (PanelIsa isa : isas) {
        for (int64_t m : std::initializer_list<int64_t>{1, 2, 3, 5, 8, 9, 16, 17, 20, 31, 33, 48,
                                                        64, 70, most}) {
          std::vector<float> y(m * rows);
          w->ProductWith(isa, m, x.data(), cols, y.data(), rows);
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < rows; ++j) {
              const float ref = t.dot[0](&raw[j * row_bytes], &xq[i * blocks], cols);
              ASSERT_EQ(y[i * rows + j], ref) << t.name << " cols=" << cols << " m=" << m << " ("
                                              << i << "," << j << ") " << PanelIsaName(isa);
            }
          }
        }
      }
    }
  }
}

// WeightMatrix::Product against the f32 product of the dequantized matrix,
// at row counts within one pass and past kRowBlock, accumulating and with
// strides. The bound: the activation's rounding (half a step per value)
// times |w|, plus float rounding; exact formats get the float rounding alone.
TEST(Quant, ProductMatchesTheDequantizedF32Product) {
  for (const QuantTraits& t : AllQuantTraits()) {
    for (int64_t cols : Widths(t)) {
      const int64_t rows = 45;
      const WeightMatrix w = Matrix(t.type, rows, cols, 21);
      std::vector<float> wd(rows * cols);
      for (int64_t r = 0; r < rows; ++r) w.RowToFloat(r, &wd[r * cols]);
      for (int64_t m : {1, 3, 8, 9, 32, 33, 130}) {
        const int64_t ldx = cols + 3, ldy = rows + 5;
        const std::vector<float> x = Random(m * ldx, 31 + m);
        std::vector<float> y(m * ldy, 0.5f);
        ProductScratch scratch;
        w.Product(m, x.data(), ldx, y.data(), ldy, /*accumulate=*/m % 2 == 1, scratch);
        for (int64_t i = 0; i < m; ++i) {
          // Half an activation step per block, as QuantizeActivations rounds.
          std::vector<float> step(cols, 0.0f);
          if (t.quantized_x) {
            for (int64_t b = 0; b < cols / kQuantBlock; ++b) {
              float amax = 0;
              for (int k = 0; k < kQuantBlock; ++k)
                amax = std::max(amax, std::fabs(x[i * ldx + b * 32 + k]));
              std::fill_n(&step[b * kQuantBlock], kQuantBlock, amax / 127 / 2);
            }
          }
          for (int64_t j = 0; j < rows; ++j) {
            double ref = m % 2 == 1 ? 0.5 : 0.0, mag = 0, bound = 0;
            for (int64_t k = 0; k < cols; ++k) {
              ref += static_cast<double>(wd[j * cols + k]) * x[i * ldx + k];
              mag += std::fabs(wd[j * cols + k] * x[i * ldx + k]);
              bound += std::fabs(wd[j * cols + k]) * step[k];
            }
            ASSERT_NEAR(y[i * ldy + j], ref, bound * 1.01 + 2e-6 * mag + 1e-6)
                << t.name << " " << rows << "x" << cols << " m=" << m << " (" << i << "," << j
                << ")";
          }
        }
        // Columns past rows() in y are left alone.
        for (int64_t i = 0; i < m; ++i) EXPECT_EQ(y[i * ldy + rows], 0.5f);
      }
    }
  }
}

// Batch invariance (weight_matrix.h): each row of a product of m rows,
// whatever m (one, a decode batch, a prefill past kRowBlock; rows in any
// position of the batch), equals that row's product alone, bit for bit, in
// every format, through the dot products this CPU runs.
TEST(Quant, ARowsProductDoesNotDependOnTheRowsBesideIt) {
  for (const QuantTraits& t : AllQuantTraits()) {
    for (int64_t cols : Widths(t)) {
      const int64_t rows = 37;
      const WeightMatrix w = Matrix(t.type, rows, cols, 71);
      const int64_t most = 2 * WeightMatrix::kRowBlock + 5;
      const std::vector<float> x = Random(most * cols, 72);
      // Each row alone.
      std::vector<float> alone(most * rows);
      ProductScratch scratch;
      for (int64_t i = 0; i < most; ++i) {
        w.Product(1, &x[i * cols], cols, &alone[i * rows], rows, false, scratch);
      }
      for (int64_t m : std::initializer_list<int64_t>{2, 3, 4, 5, 7, 31, 32, 33, 64, 65, most}) {
        // The last m rows, so that each sits at another place in the batch.
        const int64_t first = most - m;
        std::vector<float> y(m * rows);
        w.Product(m, &x[first * cols], cols, y.data(), rows, false, scratch);
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < rows; ++j) {
            ASSERT_EQ(y[i * rows + j], alone[(first + i) * rows + j])
                << t.name << " " << rows << "x" << cols << " m=" << m << " row " << i << " output "
                << j << " (" << PanelIsaName(BestPanelIsa()) << ")";
          }
        }
      }
    }
  }
}

TEST(Quant, ScalarProductMatchesTheDispatchedOne) {
  for (const QuantTraits& t : AllQuantTraits()) {
    const WeightMatrix w = Matrix(t.type, 40, 160, 5);
    const std::vector<float> x = Random(4 * 160, 6);
    std::vector<float> a(4 * 40), b(4 * 40);
    ProductScratch scratch;
    w.Product(4, x.data(), 160, a.data(), 40, false, scratch);
    w.ProductScalar(4, x.data(), 160, b.data(), 40);
    EXPECT_LT(testing::RelError(a.data(), b.data(), a.size()), 1e-5) << t.name;
  }
}

TEST(Quant, FromTensorRefusesWhatItCannotHold) {
  HostTensor t;
  t.shape = {2, 48};  // 48 is not whole Q8_0 blocks
  t.type = GgmlType::kQ8_0;
  t.bytes.resize(2 * 48 / 32 * 34);
  auto r = WeightMatrix::FromTensor(t, "blk.0.attn_q.weight");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("blk.0.attn_q.weight"), std::string::npos);
  EXPECT_NE(r.status().message().find("Q8_0"), std::string::npos);

  t.shape = {2, 64};
  t.bytes.resize(3);
  EXPECT_FALSE(WeightMatrix::FromTensor(t, "w").ok());  // bytes for another shape
  t.shape = {128};
  EXPECT_FALSE(WeightMatrix::FromTensor(t, "w").ok());  // not a matrix
  t.shape = {2, 64};
  t.type = GgmlType::kQ6_K;
  EXPECT_FALSE(WeightMatrix::FromTensor(t, "w").ok());  // no traits

  auto stacked =
      WeightMatrix::Stack(Matrix(GgmlType::kQ8_0, 4, 64, 1), Matrix(GgmlType::kQ4_1, 4, 64, 2));
  EXPECT_FALSE(stacked.ok());
}

// The engine on quantized weights against the same engine on those weights
// dequantized to f32: a prefill with every row's logits and a decode step
// agree within the 8-bit activations' rounding (BF16, whose activations stay
// floats, to float rounding).
TEST(Quant, EngineOnQuantizedWeightsMatchesTheDequantizedEngine) {
  for (GgmlType type : {GgmlType::kQ8_0, GgmlType::kQ4_0, GgmlType::kQ4_1, GgmlType::kBF16}) {
    for (const char* preset : {"tiny-qwen2", "tiny-mistral"}) {
      auto p = FindPreset(preset);
      ASSERT_TRUE(p.ok());
      ModelWeights native = GenerateWeights(p->config, 9, DType::kF32);
      ModelWeights widened;
      for (auto& [name, t] : native) {
        if (t.shape.size() == 2) {
          t.bytes = Encode(type, t.data);
          t.type = type;
          t.data.clear();
        }
        HostTensor copy = t;
        ToF32(&copy);
        widened.emplace(name, std::move(copy));
      }
      EngineOptions o;
      o.threads = 1;
      auto q = CpuEngine::Create(p->config, std::move(native), o);
      auto f = CpuEngine::Create(p->config, std::move(widened), o);
      ASSERT_TRUE(q.ok() && f.ok()) << q.status().ToString() << f.status().ToString();
      const std::vector<int32_t> prompt = testing::RandomTokens(40, p->config.vocab_size, 3);
      KvSequence sq = (*q)->kv_cache().NewSequence(), sf = (*f)->kv_cache().NewSequence();
      std::vector<float> lq, lf;
      PrefillOptions all;
      all.all_logits = true;  // 40 rows of logits: the output projection in tiles too
      ASSERT_TRUE((*q)->Prefill(sq, prompt, all, &lq).ok());
      ASSERT_TRUE((*f)->Prefill(sf, prompt, all, &lf).ok());
      const double tol = type == GgmlType::kBF16 ? 1e-4 : 0.05;
      EXPECT_LT(testing::RelError(lq.data(), lf.data(), lf.size()), tol)
          << preset << " " << FindQuantTraits(type)->name;
      // One decode step, each engine on its own (equal to 1e-4) KV.
      KvSequence* one[] = {&sq};
      KvSequence* other[] = {&sf};
      const int32_t next[] = {prompt[5]};
      ASSERT_TRUE((*q)->DecodeStep(one, next, &lq).ok());
      ASSERT_TRUE((*f)->DecodeStep(other, next, &lf).ok());
      EXPECT_LT(testing::RelError(lq.data(), lf.data(), lf.size()), tol)
          << preset << " " << FindQuantTraits(type)->name;
    }
  }
}

// Batch invariance through the whole CPU engine (docs/engine.md): a prompt
// computed whole, in two prefills (a cached prefix, then the rest), and
// token by token in decode steps beside another sequence gives each
// position the same logits, bit for bit, in every weight format.
TEST(Quant, APromptsLogitsAreTheSameWholeInPiecesAndTokenByToken) {
  for (GgmlType type : {GgmlType::kF32, GgmlType::kBF16, GgmlType::kQ8_0, GgmlType::kQ4_1}) {
    auto p = FindPreset("tiny-qwen2");
    ASSERT_TRUE(p.ok());
    ModelWeights w = GenerateWeights(p->config, 13, DType::kF32);
    for (auto& [name, t] : w) {
      if (t.shape.size() == 2 && type != GgmlType::kF32) {
        t.bytes = Encode(type, t.data);
        t.type = type;
        t.data.clear();
      }
    }
    EngineOptions o;
    o.threads = 1;  // threads split output rows: they change no row's sums
    auto e = CpuEngine::Create(p->config, std::move(w), o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    const int64_t vocab = p->config.vocab_size;
    const std::vector<int32_t> prompt = testing::RandomTokens(70, vocab, 14);
    const std::span<const int32_t> all(prompt);
    PrefillOptions rows;
    rows.all_logits = true;
    // Whole: every position's logits.
    KvSequence whole = (*e)->kv_cache().NewSequence();
    std::vector<float> want;
    ASSERT_TRUE((*e)->Prefill(whole, all, rows, &want).ok());
    // A prefix of 37, then the other 33.
    KvSequence pieces = (*e)->kv_cache().NewSequence();
    std::vector<float> head, tail;
    ASSERT_TRUE((*e)->Prefill(pieces, all.first(37), rows, &head).ok());
    ASSERT_TRUE((*e)->Prefill(pieces, all.subspan(37), rows, &tail).ok());
    head.insert(head.end(), tail.begin(), tail.end());
    ASSERT_EQ(head.size(), want.size());
    EXPECT_TRUE(head == want) << FindQuantTraits(type)->name << ": in two prefills";
    // Token by token, each step in a batch of two (the other sequence's
    // tokens differ).
    KvSequence steps = (*e)->kv_cache().NewSequence(), other = (*e)->kv_cache().NewSequence();
    std::vector<float> first, step;
    ASSERT_TRUE((*e)->Prefill(steps, all.first(1), rows, &first).ok());
    ASSERT_TRUE((*e)->Prefill(other, all.first(1), rows, &step).ok());
    int64_t differ = first == std::vector<float>(want.begin(), want.begin() + vocab) ? 0 : 1;
    for (size_t i = 1; i < prompt.size(); ++i) {
      KvSequence* batch[] = {&steps, &other};
      const int32_t next[] = {prompt[i], prompt[prompt.size() - i]};
      ASSERT_TRUE((*e)->DecodeStep(batch, next, &step).ok());
      differ += !std::equal(step.begin(), step.begin() + vocab, want.begin() + i * vocab);
    }
    EXPECT_EQ(differ, 0) << FindQuantTraits(type)->name << ": positions whose decode-step logits "
                         << "differ from the whole prefill's";
  }
}

// `pages` pages of 16 tokens of random keys and values (seeds seed + page
// and seed + 100 + page), three KV heads of head_dim per token; kb and vb
// point at the second head's, as the engine hands attention one KV head.
struct PagedKv {
  std::vector<std::vector<float>> k, v;
  std::vector<const float*> kb, vb;
  PagedKv(int head_dim, int64_t pages, uint32_t seed) {
    for (int64_t b = 0; b < pages; ++b) {
      k.push_back(Random(16 * 3 * head_dim, seed + static_cast<uint32_t>(b)));
      v.push_back(Random(16 * 3 * head_dim, seed + 100 + static_cast<uint32_t>(b)));
    }
    for (int64_t b = 0; b < pages; ++b) {
      kb.push_back(k[b].data() + head_dim);
      vb.push_back(v[b].data() + head_dim);
    }
  }
};

// Decode attention over paged keys and values for a group of query heads
// sharing a KV head (the AVX-512 kernels where the CPU has them and the
// group fits, the portable loop otherwise) against a plain softmax in
// double, with a window's first key.
TEST(CpuOps, AttendPagedGroupMatchesAPlainSoftmax) {
  for (auto [hd, heads] : {std::pair{8, 1},
                           {32, 3},
                           {48, 2},
                           {64, 1},
                           {64, 3},
                           {64, 4},
                           {64, 5},
                           {128, 2},
                           {128, 3}}) {
    for (int64_t ctx : {1, 17, 100}) {
      const int64_t stride = 3 * hd;
      const PagedKv kv(hd, (ctx + 15) / 16, 100);
      const std::vector<const float*>&kb = kv.kb, &vb = kv.vb;
      const std::vector<float> q = Random(heads * hd, 7);
      const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
      for (int64_t lo : {int64_t{0}, ctx / 2}) {
        std::vector<float> scores(heads * ctx), out(heads * hd);
        AttendPagedGroup(q.data(), heads, kb.data(), vb.data(), stride, lo, ctx, hd, scale,
                         scores.data(), out.data());
        for (int h = 0; h < heads; ++h) {
          std::vector<double> w;
          double mx = -1e30, sum = 0;
          for (int64_t p = lo; p < ctx; ++p) {
            const float* kp = kb[p / 16] + (p % 16) * stride;
            double s = 0;
            for (int i = 0; i < hd; ++i) s += static_cast<double>(q[h * hd + i]) * kp[i];
            w.push_back(s * scale);
            mx = std::max(mx, w.back());
          }
          for (double& x : w) sum += (x = std::exp(x - mx));
          for (int i = 0; i < hd; ++i) {
            double ref = 0;
            for (int64_t p = lo; p < ctx; ++p) {
              ref += w[p - lo] / sum * (vb[p / 16] + (p % 16) * stride)[i];
            }
            ASSERT_NEAR(out[h * hd + i], ref, 1e-5)
                << "hd " << hd << " heads " << heads << " ctx " << ctx << " lo " << lo;
          }
        }
      }
    }
  }
}

// A bias on two spans, one value per query head, against a plain softmax in
// double with the bias added (the portable loop: a bias skips the AVX-512
// kernels).
TEST(CpuOps, AttendPagedGroupAddsItsBiasToTheScoresOfItsSpans) {
  const int hd = 64, heads = 3;
  const int64_t ctx = 70, lo = 3, stride = 3 * hd;
  const PagedKv kv(hd, (ctx + 15) / 16, 200);
  const std::vector<float> q = Random(heads * hd, 9);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float per_head[] = {2.0f, -1.5f, 0.5f};
  const std::pair<int64_t, int64_t> spans[] = {{0, 10}, {40, 90}};
  std::vector<float> scores(heads * ctx), out(heads * hd), plain(heads * hd);
  AttendPagedGroup(q.data(), heads, kv.kb.data(), kv.vb.data(), stride, lo, ctx, hd, scale,
                   scores.data(), out.data(), nullptr, 0, {per_head, spans});
  AttendPagedGroup(q.data(), heads, kv.kb.data(), kv.vb.data(), stride, lo, ctx, hd, scale,
                   scores.data(), plain.data());
  double moved = 0;
  for (int h = 0; h < heads; ++h) {
    std::vector<double> w;
    double mx = -1e30, sum = 0;
    for (int64_t p = lo; p < ctx; ++p) {
      const float* kp = kv.kb[p / 16] + (p % 16) * stride;
      double s = 0;
      for (int i = 0; i < hd; ++i) s += static_cast<double>(q[h * hd + i]) * kp[i];
      s *= scale;
      if (p < 10 || p >= 40) s += per_head[h];
      w.push_back(s);
      mx = std::max(mx, s);
    }
    for (double& x : w) sum += (x = std::exp(x - mx));
    for (int i = 0; i < hd; ++i) {
      double ref = 0;
      for (int64_t p = lo; p < ctx; ++p)
        ref += w[p - lo] / sum * (kv.vb[p / 16] + (p % 16) * stride)[i];
      ASSERT_NEAR(out[h * hd + i], ref, 1e-5) << "head " << h << " dim " << i;
      moved = std::max(moved, std::fabs(static_cast<double>(out[h * hd + i]) - plain[h * hd + i]));
    }
  }
  EXPECT_GT(moved, 1e-3);  // the bias changed the result
}

// Two rows at once (AttendPagedPair, where this CPU has it) against each
// row alone, bit for bit: contexts equal, one past the other, across page
// boundaries and inside one page, the second shorter than the first, from
// key 0 and from inside the range.
TEST(CpuOps, AttendPagedPairIsEachRowAloneBitForBit) {
  int paired = 0;
  for (auto [hd, heads] : {std::pair{32, 3}, {64, 1}, {64, 3}, {128, 1}, {64, 4}}) {
    const int64_t stride = 3 * hd;
    const PagedKv kv(hd, 10, 300);
    const std::vector<const float*>&kb = kv.kb, &vb = kv.vb;
    const std::vector<float> q = Random(2 * heads * hd, 9);
    const float* q1 = q.data() + heads * hd;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    for (auto [c0, c1] : {std::pair<int64_t, int64_t>{1, 2},
                          {16, 17},
                          {15, 16},
                          {40, 40},
                          {33, 35},
                          {100, 3},
                          {64, 150},
                          {159, 160}}) {
      for (int64_t lo : {int64_t{0}, std::min(c0, c1) / 2}) {
        std::vector<float> scores(heads * (c0 + c1)), o0(heads * hd), o1(heads * hd);
        if (!AttendPagedPair(q.data(), q1, heads, kb.data(), vb.data(), stride, lo, c0, c1, hd,
                             scale, scores.data(), o0.data(), o1.data())) {
          continue;
        }
        ++paired;
        std::vector<float> a0(heads * hd), a1(heads * hd);
        AttendPagedGroup(q.data(), heads, kb.data(), vb.data(), stride, lo, c0, hd, scale,
                         scores.data(), a0.data());
        AttendPagedGroup(q1, heads, kb.data(), vb.data(), stride, lo, c1, hd, scale, scores.data(),
                         a1.data());
        for (int64_t i = 0; i < heads * hd; ++i) {
          ASSERT_EQ(o0[i], a0[i]) << "hd " << hd << " heads " << heads << " ctx " << c0 << "," << c1
                                  << " lo " << lo << " row 0 value " << i;
          ASSERT_EQ(o1[i], a1[i]) << "hd " << hd << " heads " << heads << " ctx " << c0 << "," << c1
                                  << " lo " << lo << " row 1 value " << i;
        }
      }
    }
  }
  if (BestDotIsa() == DotIsa::kAvx512Vnni) {
    EXPECT_GT(paired, 0);
  }
}

}  // namespace
}  // namespace kdn::engine
