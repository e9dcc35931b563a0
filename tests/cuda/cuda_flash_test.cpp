// The fast paths of the CUDA engine against the kernels they replace, which
// stay as the reference: FlashInfer attention (FlashAttention) against
// PrefillAttentionCuda and DecodeAttentionCuda on the same paged cache; the
// fused RoPE + KV write against ApplyRopeCuda and WriteKvSlotsCuda; and, on
// whole models, FlashInfer attention against the reference kernels, decode
// graphs against eager steps, and the device's greedy choice against the
// argmax of the logits. Skipped without a GPU (FlashAttention cases also
// without FlashInfer in the build).

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "kdn/engine/cuda/attention.cuh"
#include "kdn/engine/cuda/cuda_engine.h"
#include "kdn/engine/cuda/device_sampler.h"
#include "kdn/engine/cuda/flash_attention.h"
#include "kdn/engine/cuda/activation.cuh"
#include "kdn/engine/cuda/gemv.cuh"
#include "kdn/engine/cuda/paged_kv.cuh"
#include "kdn/engine/cuda/rope.cuh"
#include "kdn/engine/presets.h"
#include "kdn/engine/sampler.h"

namespace kdn::engine::cuda {
namespace {

using namespace ::kdn::engine::cuda::cudatest;  // NOLINT: the tests' own helpers

std::vector<bf16> RandomBf16(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<bf16> v(n);
  for (bf16& x : v) x = __float2bfloat16_rn(u(rng));
  return v;
}

// A paged pool of random K and V, and one block table per sequence drawn
// from a shuffled list of its blocks.
struct Pool {
  int kv_heads, head_dim, blocks;
  DevicePtr<bf16> k, v;
  std::vector<std::vector<int32_t>> tables;

  Pool(int kv_heads_, int head_dim_, const std::vector<int64_t>& lengths, uint32_t seed)
      : kv_heads(kv_heads_), head_dim(head_dim_) {
    int64_t need = 0;
    for (int64_t len : lengths) need += (len + 15) / 16;
    blocks = static_cast<int>(need) + 3;
    const size_t elems = size_t(blocks) * 16 * kv_heads * head_dim;
    k = std::move(ToDevice(RandomBf16(elems, seed, 2.0f)).value());
    v = std::move(ToDevice(RandomBf16(elems, seed + 1, 2.0f)).value());
    std::vector<int32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(seed + 2));
    size_t at = 0;
    for (int64_t len : lengths) {
      const size_t n = (len + 15) / 16;
      tables.emplace_back(ids.begin() + at, ids.begin() + at + n);
      at += n;
    }
  }
  PagedKvLayer<const bf16> layer() const { return {k.get(), v.get(), kv_heads, head_dim}; }
};

AttentionShape ShapeOf(int heads, int kv_heads, int dim) {
  return {heads, kv_heads, dim, 1.0f / std::sqrt(static_cast<float>(dim))};
}

// n queries on top of `start` cached tokens: FlashAttention (queries read
// with a row stride wider than the heads, as from a fused QKV row) against
// PrefillAttentionCuda.
void CheckFlashPrefill(int heads, int kv_heads, int dim, int64_t start, int64_t n, bool hopper) {
  SCOPED_TRACE(::testing::Message() << "heads " << heads << "/" << kv_heads << " dim " << dim
                                    << " start " << start << " n " << n << " hopper " << hopper);
  const AttentionShape shape = ShapeOf(heads, kv_heads, dim);
  ASSERT_TRUE(FlashAttention::Supports(shape));
  Pool pool(kv_heads, dim, {start + n}, 11);
  const int64_t q_row = int64_t{heads} * dim, stride = q_row + 2 * int64_t{kv_heads} * dim;
  const auto q_wide = RandomBf16(n * stride, 12, 2.0f);
  std::vector<bf16> q(n * q_row);
  for (int64_t r = 0; r < n; ++r) {
    std::copy_n(q_wide.begin() + r * stride, q_row, q.begin() + r * q_row);
  }
  auto d_wide = ToDevice(q_wide);
  auto d_q = ToDevice(q);
  auto d_table = ToDevice(pool.tables[0]);
  auto d_ref = ToDevice(std::vector<bf16>(q.size()));
  auto d_out = ToDevice(std::vector<bf16>(q.size(), __float2bfloat16_rn(NAN)));
  ASSERT_TRUE(d_wide.ok() && d_q.ok() && d_table.ok() && d_ref.ok() && d_out.ok());
  KDN_ASSERT_OK(PrefillAttentionCuda<bf16>(d_q->get(), n, start, pool.layer(), d_table->get(),
                                           shape, d_ref->get(), nullptr));
  auto flash = FlashAttention::Create(shape, 4, n, pool.blocks, hopper);
  ASSERT_TRUE(flash.ok()) << flash.status().ToString();
  const AttentionSequence seq{static_cast<int32_t>(n), start + n, pool.tables[0].data(),
                              static_cast<int64_t>(pool.tables[0].size())};
  KDN_ASSERT_OK((*flash)->Plan(&seq, 1, false, nullptr));
  if (!hopper || n == 1) {  // one row is a decode plan
    EXPECT_FALSE((*flash)->planned_hopper());
  }
  KDN_ASSERT_OK((*flash)->Run(d_wide->get(), stride, pool.layer(), d_out->get(), nullptr));
  std::vector<bf16> got, want;
  KDN_ASSERT_OK(ToHost(d_out->get(), q.size(), &got));
  KDN_ASSERT_OK(ToHost(d_ref->get(), q.size(), &want));
  // Both round to bf16 once; their fp32 sums differ in order (and FlashInfer
  // rounds the probabilities to bf16 for P.V).
  EXPECT_TRUE(AllClose(ToFloats(got), ToFloats(want), {2.0 / 128, 2e-2}));
}

TEST(FlashAttention, PrefillMatchesTheReferenceKernel) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  if (!FlashAttention::Supports(ShapeOf(32, 8, 128))) GTEST_SKIP() << "built without FlashInfer";
  // The Hopper kernels where the device has them, and the FA2 ones.
  for (bool hopper : {true, false}) {
    CheckFlashPrefill(32, 8, 128, 0, 300, hopper);    // Llama-3-8B's heads
    CheckFlashPrefill(32, 8, 128, 777, 65, hopper);   // after a cached prefix, unaligned
    CheckFlashPrefill(28, 4, 128, 16, 1000, hopper);  // Qwen2.5-7B's heads
    CheckFlashPrefill(8, 4, 64, 5, 129, hopper);      // the small preset's heads
    CheckFlashPrefill(8, 8, 64, 0, 1, hopper);        // one token, no grouping
  }
}

// Rows at scattered positions of one sequence of n tokens, as a row pass
// plans them: two bands of rows; each band's keys from the block of its first
// row on through the per-row mask (PlanPositions, positions counted from
// there), the keys below that, which all its rows see, without a mask on the
// Hopper kernels (PlanFull), the two merged by log-sum-exp. Against the
// reference causal prefill of all n rows, with queries large enough that a
// key seen or missed by mistake moves the output. Every position below
// `dense` is a row (deviation often keeps a run of them): the second band
// then has more rows than shared keys.
void CheckFlashScatteredRows(int heads, int kv_heads, int dim, int64_t n, bool shared_keys,
                             int64_t dense = 0) {
  SCOPED_TRACE(::testing::Message()
               << "heads " << heads << "/" << kv_heads << " dim " << dim << " n " << n << " shared "
               << shared_keys << " dense " << dense);
  const AttentionShape shape = ShapeOf(heads, kv_heads, dim);
  Pool pool(kv_heads, dim, {n}, 21);
  const int64_t q_row = int64_t{heads} * dim;
  const auto q_all = RandomBf16(n * q_row, 22, 6.0f);
  std::mt19937 rng(23);
  std::vector<int64_t> rows;
  for (int64_t p = 0; p < n; ++p) {
    if (p < dense || rng() % 4 == 0 || p == n - 1) rows.push_back(p);
  }
  const auto m = static_cast<int64_t>(rows.size());
  std::vector<bf16> q(m * q_row);
  for (int64_t r = 0; r < m; ++r) {
    std::copy_n(q_all.begin() + rows[r] * q_row, q_row, q.begin() + r * q_row);
  }
  auto d_all = ToDevice(q_all);
  auto d_q = ToDevice(q);
  auto d_table = ToDevice(pool.tables[0]);
  auto d_ref = ToDevice(std::vector<bf16>(q_all.size()));
  auto d_out = ToDevice(std::vector<bf16>(q.size(), __float2bfloat16_rn(NAN)));
  ASSERT_TRUE(d_all.ok() && d_q.ok() && d_table.ok() && d_ref.ok() && d_out.ok());
  KDN_ASSERT_OK(PrefillAttentionCuda<bf16>(d_all->get(), n, 0, pool.layer(), d_table->get(), shape,
                                           d_ref->get(), nullptr));
  // Two bands; the second's masked keys start at its first row's block.
  const int64_t split = m / 2;
  const int64_t base = shared_keys ? rows[split] / 16 * 16 : 0;
  const int32_t* table = pool.tables[0].data();
  const auto blocks = static_cast<int64_t>(pool.tables[0].size());
  const std::vector<AttentionSequence> masked = {
      {static_cast<int32_t>(split), rows[split - 1] + 1, table, blocks},
      {static_cast<int32_t>(m - split), rows[m - 1] + 1 - base, table + base / 16,
       blocks - base / 16}};
  std::vector<int32_t> rel(m);
  for (int64_t r = 0; r < m; ++r) rel[r] = static_cast<int32_t>(rows[r] - (r < split ? 0 : base));
  auto d_rel = ToDevice(rel);
  ASSERT_TRUE(d_rel.ok());
  // Each band's table is the sequence's, from its first masked key's block.
  auto flash = FlashAttention::Create(shape, 4, m, 2 * pool.blocks);
  ASSERT_TRUE(flash.ok()) << flash.status().ToString();
  if (shared_keys && !(*flash)->hopper()) GTEST_SKIP() << "no Hopper kernels on this device";
  KDN_ASSERT_OK((*flash)->PlanPositions(masked.data(), 2, d_rel->get(), nullptr));
  auto d_lse = ToDevice(std::vector<float>(m * heads));
  ASSERT_TRUE(d_lse.ok());
  KDN_ASSERT_OK(
      (*flash)->Run(d_q->get(), q_row, pool.layer(), d_out->get(), nullptr, d_lse->get()));
  if (shared_keys) {
    ASSERT_GT(base, 0);
    if (dense > 0) {
      ASSERT_LT(base, m - split) << "the case is a band of more rows than keys";
    }
    auto shared = FlashAttention::Create(shape, 4, m, pool.blocks);
    ASSERT_TRUE(shared.ok());
    const AttentionSequence keys{static_cast<int32_t>(m - split), base, table, base / 16};
    KDN_ASSERT_OK((*shared)->PlanFull(&keys, 1, nullptr));
    auto d_part = ToDevice(std::vector<bf16>((m - split) * q_row));
    auto d_part_lse = ToDevice(std::vector<float>((m - split) * heads));
    ASSERT_TRUE(d_part.ok() && d_part_lse.ok());
    KDN_ASSERT_OK((*shared)->Run(d_q->get() + split * q_row, q_row, pool.layer(), d_part->get(),
                                 nullptr, d_part_lse->get()));
    KDN_ASSERT_OK(FlashAttention::MergeInPlace(d_out->get() + split * q_row,
                                               d_lse->get() + split * heads, d_part->get(),
                                               d_part_lse->get(), m - split, heads, dim, nullptr));
  }
  std::vector<bf16> got, ref;
  KDN_ASSERT_OK(ToHost(d_out->get(), q.size(), &got));
  KDN_ASSERT_OK(ToHost(d_ref->get(), q_all.size(), &ref));
  std::vector<bf16> want(q.size());
  for (int64_t r = 0; r < m; ++r) {
    std::copy_n(ref.begin() + rows[r] * q_row, q_row, want.begin() + r * q_row);
  }
  EXPECT_TRUE(AllClose(ToFloats(got), ToFloats(want), {2.0 / 128, 2e-2}));
}

TEST(FlashAttention, ScatteredRowsSeeTheirKeysThroughTheMaskAndTheSharedPart) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  if (!FlashAttention::Supports(ShapeOf(32, 8, 128))) GTEST_SKIP() << "built without FlashInfer";
  CheckFlashScatteredRows(32, 8, 128, 1500, /*shared_keys=*/false);
  CheckFlashScatteredRows(8, 4, 64, 777, /*shared_keys=*/false);
  CheckFlashScatteredRows(32, 8, 128, 1500, /*shared_keys=*/true);
  CheckFlashScatteredRows(8, 4, 64, 777, /*shared_keys=*/true);
  // More rows in the second band than keys below its first row.
  CheckFlashScatteredRows(32, 8, 128, 1500, /*shared_keys=*/true, /*dense=*/400);
  CheckFlashScatteredRows(8, 4, 64, 777, /*shared_keys=*/true, /*dense=*/300);
}

// A decode batch of sequences of different lengths, planned eagerly and for a
// graph (the same batch size planned twice with other lengths, as replays
// are), against DecodeAttentionCuda.
void CheckFlashDecode(int heads, int kv_heads, int dim, const std::vector<int64_t>& lengths,
                      bool graph) {
  SCOPED_TRACE(::testing::Message()
               << "heads " << heads << "/" << kv_heads << " dim " << dim << " graph " << graph);
  const AttentionShape shape = ShapeOf(heads, kv_heads, dim);
  const int64_t batch = static_cast<int64_t>(lengths.size());
  Pool pool(kv_heads, dim, lengths, 21);
  const int64_t q_row = int64_t{heads} * dim;
  const auto q = RandomBf16(batch * q_row, 22, 2.0f);
  int64_t stride = 0, max_len = 0;
  for (const auto& t : pool.tables) stride = std::max<int64_t>(stride, t.size());
  for (int64_t len : lengths) max_len = std::max(max_len, len);
  std::vector<int32_t> tables(batch * stride, 0), lens(lengths.begin(), lengths.end());
  std::vector<AttentionSequence> seqs;
  for (int64_t b = 0; b < batch; ++b) {
    std::copy(pool.tables[b].begin(), pool.tables[b].end(), tables.begin() + b * stride);
    seqs.push_back(
        {1, lengths[b], pool.tables[b].data(), static_cast<int64_t>(pool.tables[b].size())});
  }
  auto d_q = ToDevice(q);
  auto d_tables = ToDevice(tables);
  auto d_lens = ToDevice(lens);
  auto d_ref = ToDevice(std::vector<bf16>(q.size()));
  auto d_out = ToDevice(std::vector<bf16>(q.size(), __float2bfloat16_rn(NAN)));
  auto d_ws = ToDevice(std::vector<float>(DecodeAttentionWorkspaceBytes(batch, shape, 16) / 4));
  ASSERT_TRUE(d_q.ok() && d_tables.ok() && d_lens.ok() && d_ref.ok() && d_out.ok() && d_ws.ok());
  KDN_ASSERT_OK(DecodeAttentionCuda<bf16>(d_q->get(), pool.layer(), d_tables->get(), stride,
                                          d_lens->get(), batch, max_len, shape, 16, d_ws->get(),
                                          d_ref->get(), nullptr));
  auto flash = FlashAttention::Create(shape, 64, 64, pool.blocks);
  ASSERT_TRUE(flash.ok()) << flash.status().ToString();
  if (graph) {
    // A plan of the same batch size with other lengths first: the second
    // plan must serve a launch shaped by the first.
    std::vector<AttentionSequence> other = seqs;
    for (auto& s : other) s.kv_len = 1;
    KDN_ASSERT_OK((*flash)->Plan(other.data(), static_cast<int>(batch), true, nullptr));
  }
  KDN_ASSERT_OK((*flash)->Plan(seqs.data(), static_cast<int>(batch), graph, nullptr));
  KDN_ASSERT_OK((*flash)->Run(d_q->get(), q_row, pool.layer(), d_out->get(), nullptr));
  std::vector<bf16> got, want;
  KDN_ASSERT_OK(ToHost(d_out->get(), q.size(), &got));
  KDN_ASSERT_OK(ToHost(d_ref->get(), q.size(), &want));
  EXPECT_TRUE(AllClose(ToFloats(got), ToFloats(want), {2.0 / 128, 2e-2}));
}

TEST(FlashAttention, DecodeMatchesTheReferenceKernelEagerAndForGraphs) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  if (!FlashAttention::Supports(ShapeOf(32, 8, 128))) GTEST_SKIP() << "built without FlashInfer";
  for (bool graph : {false, true}) {
    CheckFlashDecode(32, 8, 128, {1}, graph);
    CheckFlashDecode(32, 8, 128, {5000}, graph);  // one long sequence: split
    CheckFlashDecode(32, 8, 128, {1, 17, 300, 4096, 33, 16}, graph);
    CheckFlashDecode(8, 4, 64, {40, 1000, 2}, graph);
  }
}

TEST(FlashAttention, RefusesBadPlans) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const AttentionShape shape = ShapeOf(8, 4, 64);
  if (!FlashAttention::Supports(shape)) GTEST_SKIP() << "built without FlashInfer";
  EXPECT_FALSE(FlashAttention::Supports(ShapeOf(4, 2, 16)));
  auto flash = FlashAttention::Create(shape, 2, 32, 4);
  ASSERT_TRUE(flash.ok());
  const int32_t table[2] = {0, 1};
  const AttentionSequence longer_q{8, 4, table, 2};  // more queries than keys
  const AttentionSequence short_table{1, 40, table, 2};
  const AttentionSequence prefill{4, 8, table, 2};
  EXPECT_EQ((*flash)->Plan(&longer_q, 1, false, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*flash)->Plan(&short_table, 1, false, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*flash)->Plan(&prefill, 1, true, nullptr).code(), StatusCode::kInvalidArgument);
  const AttentionSequence three[3] = {prefill, prefill, prefill};
  EXPECT_EQ((*flash)->Plan(three, 3, false, nullptr).code(), StatusCode::kInvalidArgument);
}

// RopeQkvToCacheCuda against ApplyRopeCuda on the queries and keys, then
// WriteKvSlotsCuda of the rotated keys and the values.
TEST(RopeQkvToCacheCuda, EqualsRopeThenTheSlotWrite) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const int heads = 8, kv_heads = 2, dim = 64, rows = 37, blocks = 6;
  const int64_t qd = heads * dim, kd = kv_heads * dim, wide = qd + 2 * kd;
  const auto qkv = RandomBf16(rows * wide, 31, 3.0f);
  std::vector<bf16> q(rows * qd), k(rows * kd), v(rows * kd);
  for (int r = 0; r < rows; ++r) {
    std::copy_n(qkv.begin() + r * wide, qd, q.begin() + r * qd);
    std::copy_n(qkv.begin() + r * wide + qd, kd, k.begin() + r * kd);
    std::copy_n(qkv.begin() + r * wide + qd + kd, kd, v.begin() + r * kd);
  }
  std::vector<int32_t> pos(rows);
  std::vector<int64_t> slots(rows);
  for (int r = 0; r < rows; ++r) {
    pos[r] = 1000 + 97 * r;
    slots[r] = (r * 7 + 3) % (blocks * 16);  // distinct slots, scattered
  }
  std::vector<float> inv_freq(dim / 2);
  for (int i = 0; i < dim / 2; ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * i / dim);
  const size_t pool = size_t(blocks) * 16 * kd;
  auto d_qkv = ToDevice(qkv);
  auto d_q = ToDevice(q);
  auto d_k = ToDevice(k);
  auto d_v = ToDevice(v);
  auto d_pos = ToDevice(pos);
  auto d_slots = ToDevice(slots);
  auto d_freq = ToDevice(inv_freq);
  auto kc = ToDevice(std::vector<bf16>(pool)), vc = ToDevice(std::vector<bf16>(pool));
  auto rk = ToDevice(std::vector<bf16>(pool)), rv = ToDevice(std::vector<bf16>(pool));
  ASSERT_TRUE(d_qkv.ok() && d_q.ok() && d_k.ok() && d_v.ok() && d_pos.ok() && d_slots.ok() &&
              d_freq.ok() && kc.ok() && vc.ok() && rk.ok() && rv.ok());
  KDN_ASSERT_OK(RopeQkvToCacheCuda<bf16>(d_qkv->get(), rows, heads, kv_heads, dim, d_pos->get(),
                                         d_freq->get(), d_slots->get(),
                                         {kc->get(), vc->get(), kv_heads, dim}, nullptr));
  KDN_ASSERT_OK(
      ApplyRopeCuda<bf16>(d_q->get(), rows, heads, dim, d_pos->get(), d_freq->get(), nullptr));
  KDN_ASSERT_OK(
      ApplyRopeCuda<bf16>(d_k->get(), rows, kv_heads, dim, d_pos->get(), d_freq->get(), nullptr));
  KDN_ASSERT_OK(WriteKvSlotsCuda<bf16>(d_k->get(), d_v->get(), kd, rows, d_slots->get(),
                                       {rk->get(), rv->get(), kv_heads, dim}, nullptr));
  std::vector<bf16> got_qkv, want_q, got_k, want_k, got_v, want_v;
  KDN_ASSERT_OK(ToHost(d_qkv->get(), qkv.size(), &got_qkv));
  KDN_ASSERT_OK(ToHost(d_q->get(), q.size(), &want_q));
  KDN_ASSERT_OK(ToHost(kc->get(), pool, &got_k));
  KDN_ASSERT_OK(ToHost(rk->get(), pool, &want_k));
  KDN_ASSERT_OK(ToHost(vc->get(), pool, &got_v));
  KDN_ASSERT_OK(ToHost(rv->get(), pool, &want_v));
  std::vector<bf16> got_q(rows * qd);
  for (int r = 0; r < rows; ++r) {
    std::copy_n(got_qkv.begin() + r * wide, qd, got_q.begin() + r * qd);
    // The key and value parts of the row are left as they were.
    for (int64_t i = qd; i < wide; ++i) {
      ASSERT_EQ(__bfloat162float(got_qkv[r * wide + i]), __bfloat162float(qkv[r * wide + i]));
    }
  }
  // The same arithmetic in the same order: bit for bit.
  EXPECT_TRUE(AllClose(ToFloats(got_q), ToFloats(want_q), {0, 0}));
  EXPECT_TRUE(AllClose(ToFloats(got_k), ToFloats(want_k), {0, 0}));
  EXPECT_TRUE(AllClose(ToFloats(got_v), ToFloats(want_v), {0, 0}));
}

// GemvCuda against cublasGemmEx (bf16 in, fp32 accumulation), with and
// without accumulation into the output, for every row count it takes.
template <typename OutT>
void CheckGemv(int rows, int in_dim, int out_dim, bool accumulate) {
  SCOPED_TRACE(::testing::Message() << "rows " << rows << " " << in_dim << " -> " << out_dim
                                    << " accumulate " << accumulate);
  const auto x = RandomBf16(size_t(rows) * in_dim, 41 + rows, 1.0f);
  const auto w = RandomBf16(size_t(out_dim) * in_dim, 42, 0.05f);
  std::vector<float> init(size_t(rows) * out_dim);
  for (size_t i = 0; i < init.size(); ++i) init[i] = 0.25f * std::sin(0.1f * i);
  const auto init_t = FromFloats<OutT>(init);
  auto d_x = ToDevice(x);
  auto d_w = ToDevice(w);
  auto d_out = ToDevice(init_t);
  auto d_ref = ToDevice(init_t);
  ASSERT_TRUE(d_x.ok() && d_w.ok() && d_out.ok() && d_ref.ok());
  KDN_ASSERT_OK(GemvCuda<OutT>(d_x->get(), rows, in_dim, d_w->get(), out_dim, d_out->get(),
                               accumulate, nullptr));
  cublasHandle_t h = nullptr;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const cudaDataType_t out_type = std::is_same_v<OutT, float> ? CUDA_R_32F : CUDA_R_16BF;
  ASSERT_EQ(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, out_dim, rows, in_dim, &alpha, d_w->get(),
                         CUDA_R_16BF, in_dim, d_x->get(), CUDA_R_16BF, in_dim, &beta, d_ref->get(),
                         out_type, out_dim, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  std::vector<OutT> got, want;
  KDN_ASSERT_OK(ToHost(d_out->get(), init.size(), &got));
  KDN_ASSERT_OK(ToHost(d_ref->get(), init.size(), &want));
  cublasDestroy(h);
  const Tolerance tol =
      std::is_same_v<OutT, float> ? Tolerance{1e-4, 1e-4} : Tolerance{1.0 / 128, 1e-3};
  EXPECT_TRUE(AllClose(ToFloats(got), ToFloats(want), tol));
}

TEST(GemvCuda, MatchesCublasForEveryRowCount) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  for (int rows = 1; rows <= kGemvMaxRows; ++rows) {
    CheckGemv<bf16>(rows, 4096, 6144, false);  // Llama-3-8B's fused QKV
    CheckGemv<bf16>(rows, 14336, 4096, true);  // its down projection into the residual
    CheckGemv<float>(rows, 512, 258, false);   // a small LM head, fp32 logits
    CheckGemv<float>(rows, 512, 20000, true);  // many rows, accumulated
  }
  CheckGemv<bf16>(1, 8 * 37, 13, true);  // widths off every unrolled step
  // The fused gate/up product and SwiGLU gate: bit for bit the unfused pair.
  for (int rows = 1; rows <= kGemvMaxRows; ++rows) {
    const int in_dim = 4096, inter = 1000;
    auto d_x = ToDevice(RandomBf16(size_t(rows) * in_dim, 50 + rows, 1.0f));
    auto d_w = ToDevice(RandomBf16(size_t(2) * inter * in_dim, 51, 0.05f));
    auto d_gu = ToDevice(std::vector<bf16>(size_t(rows) * 2 * inter));
    auto d_ref = ToDevice(std::vector<bf16>(size_t(rows) * inter));
    auto d_out = ToDevice(std::vector<bf16>(size_t(rows) * inter, __float2bfloat16_rn(NAN)));
    ASSERT_TRUE(d_x.ok() && d_w.ok() && d_gu.ok() && d_ref.ok() && d_out.ok());
    KDN_ASSERT_OK(GemvCuda<bf16>(d_x->get(), rows, in_dim, d_w->get(), 2 * inter, d_gu->get(),
                                 false, nullptr));
    KDN_ASSERT_OK(SiluMulCuda<bf16>(d_gu->get(), rows, inter, d_ref->get(), nullptr));
    KDN_ASSERT_OK(
        GemvSwiGluCuda(d_x->get(), rows, in_dim, d_w->get(), inter, d_out->get(), nullptr));
    std::vector<bf16> got, want;
    KDN_ASSERT_OK(ToHost(d_out->get(), size_t(rows) * inter, &got));
    KDN_ASSERT_OK(ToHost(d_ref->get(), size_t(rows) * inter, &want));
    EXPECT_TRUE(AllClose(ToFloats(got), ToFloats(want), {0, 0})) << "rows " << rows;
  }
  EXPECT_EQ(GemvCuda<float>(nullptr, 5, 64, nullptr, 8, nullptr, false, nullptr).code(),
            StatusCode::kInvalidArgument);
}

// DeviceSampler against engine::Sampler::Sample with twin samplers (same
// parameters, same seed): the same ids, row after row, and the same number
// of draws taken from each stream.
TEST(DeviceSampler, DrawsWhatTheHostSamplerDraws) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  for (int64_t vocab : {int64_t{1000}, int64_t{128256}}) {
    const int rows = 6;
    std::mt19937 rng(static_cast<uint32_t>(vocab));
    std::normal_distribution<float> nd(0.0f, 3.0f);
    const std::vector<model::SamplingParams> params = {{0.7f, 0, 0.9f, 1}, {1.0f, 50, 1.0f, 2},
                                                       {0.0f, 0, 1.0f, 3}, {1.3f, 0, 1.0f, 4},
                                                       {0.5f, 1, 1.0f, 5}, {1.0f, 20, 0.5f, 6}};
    auto sampler = DeviceSampler::Create(rows, vocab);
    ASSERT_TRUE(sampler.ok()) << sampler.status().ToString();
    std::vector<Sampler> host, device;
    for (const auto& p : params) host.emplace_back(p), device.emplace_back(p);
    auto d_out = ToDevice(std::vector<int32_t>(rows, -1));
    ASSERT_TRUE(d_out.ok());
    for (int step = 0; step < 5; ++step) {
      std::vector<float> logits(rows * vocab);
      for (float& x : logits) x = nd(rng);
      logits[7] = logits[8] = 12.0f;  // a tie at the top: the lower id goes first
      auto d_logits = ToDevice(logits);
      ASSERT_TRUE(d_logits.ok());
      std::vector<DeviceSamplingRow> rows_params;
      for (int r = 0; r < rows; ++r) {
        const double u = device[r].NextDraw();
        const model::SamplingParams& p = params[r];
        rows_params.push_back({u < 0 ? 0.0f : p.temperature, p.top_k, p.top_p, u < 0 ? 0.0 : u});
      }
      KDN_ASSERT_OK(
          (*sampler)->Sample(d_logits->get(), rows_params.data(), rows, d_out->get(), nullptr));
      std::vector<int32_t> got;
      KDN_ASSERT_OK(ToHost(d_out->get(), rows, &got));
      for (int r = 0; r < rows; ++r) {
        const std::span<const float> row(logits.data() + r * vocab, vocab);
        EXPECT_EQ(got[r], host[r].Sample(row))
            << "vocab " << vocab << " step " << step << " row " << r;
      }
    }
  }
}

// ---------------------------------------------------------------- models

std::unique_ptr<CudaEngine> SmallModel(bool flash, bool graphs) {
  auto p = FindPreset("small");
  EXPECT_TRUE(p.ok());
  ModelWeights w = GenerateWeights(p->config, 3, DType::kBF16);
  CudaEngineOptions o;
  o.kv_tokens = 8192;
  o.max_prefill_tokens = 1024;
  o.max_batch = 16;
  o.flash_attention = flash;
  o.cuda_graphs = graphs;
  auto m = CudaEngine::Create(p->config, w, o);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::move(m).value() : nullptr;
}

double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(double(x)));
  return m;
}

::testing::AssertionResult Near(const std::vector<float>& a, const std::vector<float>& b,
                                double fraction) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  if (worst <= fraction * MaxAbs(b)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "largest difference " << worst << " of " << MaxAbs(b);
}

// Three sequences (one after a prefix split) through prefill and 12 batched
// decode steps on two models with the same weights.
void RunThree(CudaEngine& m, std::vector<std::vector<float>>* prefill_logits,
              std::vector<std::vector<float>>* step_logits) {
  std::vector<KvSequence> seqs = NewSequences(m, 3);
  const std::vector<std::vector<int32_t>> prompts = {Tokens(300, 1), Tokens(17, 2), Tokens(600, 3)};
  for (int i = 0; i < 3; ++i) {
    std::vector<float> l;
    if (i == 2) {  // a cached prefix, then the rest
      const std::span<const int32_t> all(prompts[i]);
      ASSERT_TRUE(m.Prefill(seqs[i], all.first(256), {}, &l).ok());
      ASSERT_TRUE(m.Prefill(seqs[i], all.subspan(256), {}, &l).ok());
    } else {
      ASSERT_TRUE(m.Prefill(seqs[i], prompts[i], {}, &l).ok());
    }
    prefill_logits->push_back(l);
  }
  std::vector<KvSequence*> ptrs = {&seqs[0], &seqs[1], &seqs[2]};
  std::vector<int32_t> next = {65, 66, 67};
  for (int s = 0; s < 12; ++s) {
    std::vector<float> l;
    ASSERT_TRUE(m.DecodeStep(ptrs, next, &l).ok());
    step_logits->push_back(l);
    for (int b = 0; b < 3; ++b) next[b] = (next[b] * 31 + s) % 256;
  }
  for (auto& s : seqs) s.Reset();
}

TEST(CudaModelFastPaths, FlashAttentionAgreesWithTheReferenceKernels) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto fast = SmallModel(true, false);
  auto ref = SmallModel(false, false);
  ASSERT_TRUE(fast && ref);
  if (!fast->uses_flash_attention()) GTEST_SKIP() << "built without FlashInfer";
  ASSERT_FALSE(ref->uses_flash_attention());
  std::vector<std::vector<float>> fp, fs, rp, rs;
  RunThree(*fast, &fp, &fs);
  RunThree(*ref, &rp, &rs);
  ASSERT_EQ(fp.size(), rp.size());
  ASSERT_EQ(fs.size(), rs.size());
  // bf16 noise over 16 layers, as the GPU-vs-CPU model tests allow: the two
  // round probabilities and partial sums differently (measured on an H100:
  // at most 2.1% of the largest logit, on the 17-token prompt).
  for (size_t i = 0; i < fp.size(); ++i) EXPECT_TRUE(Near(fp[i], rp[i], 0.03)) << "prefill " << i;
  for (size_t i = 0; i < fs.size(); ++i) EXPECT_TRUE(Near(fs[i], rs[i], 0.03)) << "step " << i;
}

TEST(CudaModelFastPaths, GraphStepsEqualEagerStepsAndDeviceSamplingEqualsTheHosts) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto graphs = SmallModel(true, true);
  auto eager = SmallModel(true, false);
  ASSERT_TRUE(graphs && eager);
  if (!graphs->uses_cuda_graphs()) GTEST_SKIP() << "built without FlashInfer";
  std::vector<std::vector<float>> gp, gs, ep, es;
  RunThree(*graphs, &gp, &gs);
  RunThree(*eager, &ep, &es);
  // The same kernels on the same rows, but a graph plan always splits the
  // keys across CTAs where an eager one may not, and cuBLAS may choose
  // another algorithm for a padded batch: bf16 noise, as between backends
  // (measured on an H100: up to 1.7% of the largest logit when the splits
  // differed).
  for (size_t i = 0; i < gs.size(); ++i) EXPECT_TRUE(Near(gs[i], es[i], 0.03)) << "step " << i;

  // Greedy on the device: each sequence's choice is the argmax of its logits.
  const int batch = 5;  // padded to a bucket of 8
  std::vector<KvSequence> seqs = NewSequences(*graphs, batch);
  std::vector<KvSequence*> ptrs;
  std::vector<int32_t> next(batch);
  for (int i = 0; i < batch; ++i) {
    std::vector<float> l;
    ASSERT_TRUE(graphs->Prefill(seqs[i], Tokens(40 + 30 * i, 10 + i), {}, &l).ok());
    next[i] = Argmax(l);
    ptrs.push_back(&seqs[i]);
  }
  for (int s = 0; s < 8; ++s) {
    std::vector<float> l;
    std::vector<int32_t> chosen;
    // The logits of this step from a copy of the state: step, look, undo by
    // truncating the sequence (the KV row is rewritten by the greedy step).
    std::vector<int64_t> lengths;
    for (auto* p : ptrs) lengths.push_back(p->length());
    ASSERT_TRUE(graphs->DecodeStep(ptrs, next, &l).ok());
    for (int i = 0; i < batch; ++i) ptrs[i]->Truncate(lengths[i]);
    ASSERT_TRUE(graphs->DecodeGreedy(ptrs, next, &chosen).ok());
    ASSERT_EQ(chosen.size(), size_t(batch));
    const int vocab = graphs->config().vocab_size;
    for (int i = 0; i < batch; ++i) {
      const std::vector<float> row(l.begin() + i * vocab, l.begin() + (i + 1) * vocab);
      EXPECT_EQ(chosen[i], Argmax(row)) << "step " << s << " sequence " << i;
    }
    next = chosen;
  }
  // Sampling on the device: what each sequence's twin Sampler draws from the
  // same step's logits on the host.
  std::vector<Sampler> on_device, on_host;
  for (int i = 0; i < batch; ++i) {
    const model::SamplingParams p{0.8f, i % 2 == 0 ? 0 : 40, i % 3 == 0 ? 0.9f : 1.0f, uint64_t(i)};
    on_device.emplace_back(p);
    on_host.emplace_back(p);
  }
  std::vector<Sampler*> sampler_ptrs;
  for (auto& s : on_device) sampler_ptrs.push_back(&s);
  for (int s = 0; s < 6; ++s) {
    std::vector<float> l;
    std::vector<int32_t> chosen;
    std::vector<int64_t> lengths;
    for (auto* p : ptrs) lengths.push_back(p->length());
    ASSERT_TRUE(graphs->DecodeStep(ptrs, next, &l).ok());
    for (int i = 0; i < batch; ++i) ptrs[i]->Truncate(lengths[i]);
    ASSERT_TRUE(graphs->DecodeSample(ptrs, next, sampler_ptrs, &chosen).ok());
    const int vocab = graphs->config().vocab_size;
    for (int i = 0; i < batch; ++i) {
      const std::span<const float> row(l.data() + i * vocab, vocab);
      EXPECT_EQ(chosen[i], on_host[i].Sample(row)) << "step " << s << " sequence " << i;
    }
    next = chosen;
  }
  for (auto& s : seqs) s.Reset();
}

}  // namespace
}  // namespace kdn::engine::cuda
