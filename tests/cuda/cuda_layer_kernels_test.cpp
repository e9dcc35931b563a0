// The CUDA kernels a transformer layer needs beyond RMSNorm and RoPE
// (activation, embedding, sampling, seeded init, paged KV, attention), each
// against a CPU reference on seeded random inputs. The references compute in
// double from the very values the kernels see (bf16-rounded where the kernel
// reads bf16), so the tolerances only cover fp32 summation order and one
// final rounding.
//
// Tests that need a device skip without one; argument checks run everywhere.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "cuda_test_util.h"
#include "kdn/engine/cpu_ops.h"
#include "kdn/engine/sampler.h"
#include "kdn/engine/cuda/activation.cuh"
#include "kdn/engine/cuda/attention.cuh"
#include "kdn/engine/cuda/embedding.cuh"
#include "kdn/engine/cuda/init.cuh"
#include "kdn/engine/cuda/paged_kv.cuh"
#include "kdn/engine/cuda/sampling.cuh"

namespace kdn::engine::cuda {
namespace {

using namespace ::kdn::engine::cuda::cudatest;  // NOLINT: the tests' own helpers

std::vector<float> Uniforms(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Values as the kernel sees them: rounded to T.
template <typename T>
std::vector<float> Rounded(const std::vector<float>& v) {
  return ToFloats(FromFloats<T>(v));
}

// ---------------------------------------------------------------- SiluMul

template <typename T>
void CheckSiluMul(int64_t rows, int inter) {
  const auto gate_up = Rounded<T>(Uniforms(rows * 2 * inter, 7, -6.0f, 6.0f));
  auto d_in = ToDevice(FromFloats<T>(gate_up));
  ASSERT_TRUE(d_in.ok());
  auto d_out = ToDevice(std::vector<T>(rows * inter));
  ASSERT_TRUE(d_out.ok());
  KDN_ASSERT_OK(SiluMulCuda<T>(d_in->get(), rows, inter, d_out->get(), nullptr));
  std::vector<T> got;
  KDN_ASSERT_OK(ToHost(d_out->get(), rows * inter, &got));
  std::vector<float> want(rows * inter);
  for (int64_t r = 0; r < rows; ++r) {
    for (int i = 0; i < inter; ++i) {
      const double g = gate_up[r * 2 * inter + i], u = gate_up[r * 2 * inter + inter + i];
      want[r * inter + i] = static_cast<float>(g / (1.0 + std::exp(-g)) * u);
    }
  }
  EXPECT_TRUE(AllClose(ToFloats(got), want, ToleranceFor<T>()));
}

TEST(SiluMulCuda, MatchesTheReferenceInFp32AndBf16) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  CheckSiluMul<float>(37, 344);
  CheckSiluMul<bf16>(37, 344);
  CheckSiluMul<bf16>(1, 14336);
  CheckSiluMul<bf16>(5, 100);  // not a multiple of 8: the scalar kernel
}

// -------------------------------------------------------------- embedding

TEST(EmbedCuda, CopiesRowsAndFlagsIdsOutsideTheVocabulary) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const int vocab = 300, dim = 72;
  const auto table = Rounded<bf16>(Uniforms(vocab * dim, 3));
  const std::vector<int32_t> ids = {0, 299, 17, 17, 300, -1, 5};
  auto d_table = ToDevice(FromFloats<bf16>(table));
  auto d_ids = ToDevice(ids);
  auto d_out = ToDevice(std::vector<bf16>(ids.size() * dim));
  auto d_bad = ToDevice(std::vector<int32_t>{0});
  ASSERT_TRUE(d_table.ok() && d_ids.ok() && d_out.ok() && d_bad.ok());
  KDN_ASSERT_OK(EmbedCuda<bf16>(d_table->get(), vocab, dim, d_ids->get(),
                                static_cast<int64_t>(ids.size()), d_out->get(), d_bad->get(),
                                nullptr));
  std::vector<bf16> got;
  std::vector<int32_t> bad;
  KDN_ASSERT_OK(ToHost(d_out->get(), ids.size() * dim, &got));
  KDN_ASSERT_OK(ToHost(d_bad->get(), 1, &bad));
  for (size_t r = 0; r < ids.size(); ++r) {
    for (int i = 0; i < dim; ++i) {
      const float want = ids[r] >= 0 && ids[r] < vocab ? table[ids[r] * dim + i] : 0.0f;
      ASSERT_EQ(__bfloat162float(got[r * dim + i]), want) << "row " << r << " [" << i << "]";
    }
  }
  EXPECT_EQ(bad[0], 1);
}

// --------------------------------------------------------------- sampling

TEST(ArgmaxCuda, EqualsTheEngineIncludingTiesAndNaN) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t vocab = 128256;
  std::vector<float> logits = Uniforms(4 * vocab, 11, -10.0f, 10.0f);
  logits[0 * vocab + 77777] = 50.0f;  // a clear winner
  logits[1 * vocab + 9] = 60.0f;      // a tie: the first index wins
  logits[1 * vocab + 90000] = 60.0f;
  logits[2 * vocab + 3] = NAN;  // NaN is never chosen
  logits[2 * vocab + 128255] = 70.0f;
  std::fill(logits.begin() + 3 * vocab, logits.end(), -1.0f);  // all equal: index 0
  auto d_logits = ToDevice(logits);
  auto d_out = ToDevice(std::vector<int32_t>(4));
  ASSERT_TRUE(d_logits.ok() && d_out.ok());
  KDN_ASSERT_OK(ArgmaxCuda(d_logits->get(), 4, vocab, d_out->get(), nullptr));
  std::vector<int32_t> got;
  KDN_ASSERT_OK(ToHost(d_out->get(), 4, &got));
  EXPECT_EQ(got, (std::vector<int32_t>{77777, 9, 128255, 0}));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r], engine::Argmax(std::span<const float>(logits.data() + r * vocab, vocab)));
  }
  // The same rows split across blocks (with a workspace), and a vocabulary
  // narrower than the split.
  auto d_ws = ToDevice(std::vector<char>(ArgmaxWorkspaceBytes(4)));
  ASSERT_TRUE(d_ws.ok());
  KDN_ASSERT_OK(ArgmaxCuda(d_logits->get(), 4, vocab, d_out->get(), nullptr, d_ws->get()));
  KDN_ASSERT_OK(ToHost(d_out->get(), 4, &got));
  EXPECT_EQ(got, (std::vector<int32_t>{77777, 9, 128255, 0}));
  const std::vector<float> narrow = {1.0f, NAN, 3.0f, 3.0f, -2.0f};
  auto d_narrow = ToDevice(narrow);
  ASSERT_TRUE(d_narrow.ok());
  KDN_ASSERT_OK(ArgmaxCuda(d_narrow->get(), 1, 5, d_out->get(), nullptr, d_ws->get()));
  KDN_ASSERT_OK(ToHost(d_out->get(), 1, &got));
  EXPECT_EQ(got[0], 2);
}

// ------------------------------------------------------------------- init

TEST(FillUniformCuda, WritesTheHostsValuesWithinTheScale) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t n = 1 << 20;
  auto d = ToDevice(std::vector<float>(n));
  ASSERT_TRUE(d.ok());
  KDN_ASSERT_OK(FillUniformCuda<float>(d->get(), n, 42, 7, 0.02f, nullptr));
  std::vector<float> got;
  KDN_ASSERT_OK(ToHost(d->get(), n, &got));
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(got[i], UniformAt(42, 7, i, 0.02f)) << i;
    ASSERT_LE(std::fabs(got[i]), 0.02f);
    sum += got[i];
  }
  EXPECT_LT(std::fabs(sum / n), 1e-4);                              // centred
  EXPECT_NE(UniformAt(42, 8, 0, 1.0f), UniformAt(42, 7, 0, 1.0f));  // streams differ
}

// --------------------------------------------------------------- paged KV

// A paged layer in device memory with a shuffled block table, and its host
// mirror.
template <typename T>
struct PagedFixture {
  int kv_heads, head_dim, blocks;
  std::vector<int32_t> table;
  DevicePtr<T> k, v;
  DevicePtr<int32_t> d_table;

  PagedFixture(int kvh, int hd, int n_blocks, uint32_t seed)
      : kv_heads(kvh), head_dim(hd), blocks(n_blocks), table(n_blocks) {
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(seed));
    const size_t elems = static_cast<size_t>(blocks) * kKvBlockTokensCuda * kvh * hd;
    k = std::move(ToDevice(std::vector<T>(elems)).value());
    v = std::move(ToDevice(std::vector<T>(elems)).value());
    d_table = std::move(ToDevice(table).value());
  }
  int row() const { return kv_heads * head_dim; }
  PagedKvLayer<T> layer() { return {k.get(), v.get(), kv_heads, head_dim}; }
  PagedKvLayer<const T> const_layer() { return {k.get(), v.get(), kv_heads, head_dim}; }
  // Writes `rows` (count rows of K then of V) at positions [first, ...).
  Status Write(const std::vector<float>& kv, int64_t first, int64_t count) {
    KDN_ASSIGN_OR_RETURN(auto d, ToDevice(FromFloats<T>(kv)));
    return WriteKvCuda<T>(d.get(), d.get() + count * row(), row(), count, d_table.get(), first,
                          layer(), nullptr);
  }
};

TEST(PagedKvCuda, WriteGatherScatterAndCopyKeepEveryRowInItsSlot) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  PagedFixture<bf16> f(8, 128, 10, 1);
  const int64_t first = 13, count = 130;  // starts mid-block, ends mid-block
  const auto kv = Rounded<bf16>(Uniforms(2 * count * f.row(), 2));
  KDN_ASSERT_OK(f.Write(kv, first, count));
  // Gather returns exactly what was written.
  auto d_out = ToDevice(std::vector<bf16>(2 * count * f.row()));
  ASSERT_TRUE(d_out.ok());
  KDN_ASSERT_OK(
      GatherKvCuda<bf16>(f.layer(), f.d_table.get(), first, count, d_out->get(), nullptr));
  std::vector<bf16> got;
  KDN_ASSERT_OK(ToHost(d_out->get(), kv.size(), &got));
  EXPECT_EQ(ToFloats(got), kv);
  // The slot of position p is block table[p / 16], row p % 16.
  std::vector<bf16> k_host;
  KDN_ASSERT_OK(ToHost(f.k.get(), static_cast<size_t>(f.blocks) * 16 * f.row(), &k_host));
  for (int64_t p : {first, first + 3, first + count - 1}) {
    const int64_t slot = static_cast<int64_t>(f.table[p / 16]) * 16 + p % 16;
    EXPECT_EQ(__bfloat162float(k_host[slot * f.row() + 5]), kv[(p - first) * f.row() + 5]) << p;
  }
  // Scatter to other positions, gather back.
  KDN_ASSERT_OK(ScatterKvCuda<bf16>(d_out->get(), count, f.d_table.get(), 0, f.layer(), nullptr));
  auto d_again = ToDevice(std::vector<bf16>(kv.size()));
  ASSERT_TRUE(d_again.ok());
  KDN_ASSERT_OK(GatherKvCuda<bf16>(f.layer(), f.d_table.get(), 0, count, d_again->get(), nullptr));
  KDN_ASSERT_OK(ToHost(d_again->get(), kv.size(), &got));
  EXPECT_EQ(ToFloats(got), kv);
  // A block copy duplicates K and V of a whole block.
  auto d_pairs = ToDevice(std::vector<int32_t>{f.table[0], f.table[9]});
  ASSERT_TRUE(d_pairs.ok());
  KDN_ASSERT_OK(CopyKvBlocksCuda<bf16>(f.layer(), d_pairs->get(), 1, nullptr));
  KDN_ASSERT_OK(
      GatherKvCuda<bf16>(f.layer(), f.d_table.get(), 9 * 16, 16, d_again->get(), nullptr));
  KDN_ASSERT_OK(ToHost(d_again->get(), 2 * 16 * f.row(), &got));
  for (int64_t t = 0; t < 16; ++t) {
    for (int i = 0; i < f.row(); i += 37) {
      ASSERT_EQ(__bfloat162float(got[t * f.row() + i]), kv[t * f.row() + i]);                   // K
      ASSERT_EQ(__bfloat162float(got[(16 + t) * f.row() + i]), kv[(count + t) * f.row() + i]);  // V
    }
  }
}

// -------------------------------------------------------------- attention

// An attention bias as PASTA's emphasis adds it (ScoreBiasCuda): query head
// h adds per_head[h] to its scaled score of each key in `spans`.
struct RefBias {
  std::vector<std::pair<int64_t, int64_t>> spans;
  std::vector<float> per_head;
};

// Causal grouped-query attention of queries at positions q_pos over keys
// 0..q_pos (q_pos - window + 1 .. q_pos with a window), in double, with
// `bias` added to the scores if given.
// q: [n][heads][dim]; keys, values: [len][kv_heads][dim].
std::vector<float> ReferenceAttention(const std::vector<float>& q,
                                      const std::vector<int64_t>& q_pos,
                                      const std::vector<float>& keys,
                                      const std::vector<float>& values, int heads, int kv_heads,
                                      int dim, int64_t window = 0, const RefBias* bias = nullptr) {
  const int group = heads / kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  std::vector<float> out(q.size());
  for (size_t i = 0; i < q_pos.size(); ++i) {
    for (int h = 0; h < heads; ++h) {
      const int g = h / group;
      const float* qh = &q[(i * heads + h) * dim];
      const int64_t first = window > 0 ? std::max<int64_t>(0, q_pos[i] - window + 1) : 0;
      std::vector<double> s(q_pos[i] + 1, -INFINITY);
      double mx = -INFINITY;
      for (int64_t t = first; t <= q_pos[i]; ++t) {
        const float* kt = &keys[(t * kv_heads + g) * dim];
        double dot = 0;
        for (int d = 0; d < dim; ++d) dot += static_cast<double>(qh[d]) * kt[d];
        s[t] = dot * scale;
        if (bias != nullptr) {
          for (const auto& [b, e] : bias->spans) {
            if (t >= b && t < e) s[t] += bias->per_head[h];
          }
        }
        mx = std::max(mx, s[t]);
      }
      double z = 0;
      for (double& x : s) z += (x = std::exp(x - mx));  // exp(-inf) = 0 before the window
      for (int d = 0; d < dim; ++d) {
        double o = 0;
        for (int64_t t = 0; t <= q_pos[i]; ++t) o += s[t] * values[(t * kv_heads + g) * dim + d];
        out[(i * heads + h) * dim + d] = static_cast<float>(o / z);
      }
    }
  }
  return out;
}

template <typename T>
Tolerance AttentionTolerance() {
  // fp32 accumulation over up to thousands of keys; bf16 output rounding.
  if constexpr (std::is_same_v<T, float>) {
    return {2e-4, 2e-5};
  } else {
    return {1.0 / 64, 2e-3};
  }
}

// A bias's device arrays, one row per entry of `rows` (an empty per_head:
// that row has none), as the engine lays them out (engine::LayOutBias).
struct DeviceRefBias {
  Result<DevicePtr<float>> head_bias = NotFound("");
  Result<DevicePtr<int64_t>> spans = NotFound("");
  Result<DevicePtr<int32_t>> span_first = NotFound("");
  ScoreBiasCuda view;
};
DeviceRefBias ToDeviceBias(const std::vector<RefBias>& rows, int heads) {
  std::vector<float> head_bias(rows.size() * heads, 0.0f);
  std::vector<int64_t> spans;
  std::vector<int32_t> first{0};
  for (size_t b = 0; b < rows.size(); ++b) {
    if (!rows[b].per_head.empty()) {
      std::copy(rows[b].per_head.begin(), rows[b].per_head.end(), head_bias.begin() + b * heads);
      for (const auto& [begin, end] : rows[b].spans) {
        spans.push_back(begin);
        spans.push_back(end);
      }
    }
    first.push_back(static_cast<int32_t>(spans.size() / 2));
  }
  if (spans.empty()) spans.push_back(0);  // never read: every count is 0
  DeviceRefBias d;
  d.head_bias = ToDevice(head_bias);
  d.spans = ToDevice(spans);
  d.span_first = ToDevice(first);
  if (d.head_bias.ok() && d.spans.ok() && d.span_first.ok()) {
    d.view = {d.head_bias->get(), heads, d.spans->get(), d.span_first->get()};
  }
  return d;
}

template <typename T>
void CheckPrefill(int heads, int kv_heads, int dim, int64_t q_start, int64_t n, int64_t window = 0,
                  const RefBias* bias = nullptr) {
  SCOPED_TRACE(::testing::Message()
               << "heads " << heads << "/" << kv_heads << " dim " << dim << " q_start " << q_start
               << " n " << n << " window " << window);
  const int64_t len = q_start + n;
  PagedFixture<T> f(kv_heads, dim, static_cast<int>((len + 15) / 16) + 2, 3);
  const auto kv = Rounded<T>(Uniforms(2 * len * f.row(), 4, -2.0f, 2.0f));
  KDN_ASSERT_OK(f.Write(kv, 0, len));
  const auto q = Rounded<T>(Uniforms(n * heads * dim, 5, -2.0f, 2.0f));
  auto d_q = ToDevice(FromFloats<T>(q));
  auto d_out = ToDevice(std::vector<T>(q.size()));
  ASSERT_TRUE(d_q.ok() && d_out.ok());
  const AttentionShape shape{heads, kv_heads, dim, 1.0f / std::sqrt(static_cast<float>(dim)),
                             window};
  const DeviceRefBias d_bias = ToDeviceBias({bias != nullptr ? *bias : RefBias{}}, heads);
  ASSERT_TRUE(d_bias.head_bias.ok() && d_bias.spans.ok() && d_bias.span_first.ok());
  KDN_ASSERT_OK(PrefillAttentionCuda<T>(d_q->get(), n, q_start, f.const_layer(), f.d_table.get(),
                                        shape, d_out->get(), nullptr,
                                        bias != nullptr ? d_bias.view : ScoreBiasCuda{}));
  std::vector<T> got;
  KDN_ASSERT_OK(ToHost(d_out->get(), q.size(), &got));
  std::vector<int64_t> pos(n);
  std::iota(pos.begin(), pos.end(), q_start);
  const std::vector<float> keys(kv.begin(), kv.begin() + len * f.row());
  const std::vector<float> values(kv.begin() + len * f.row(), kv.end());
  const std::vector<float> want =
      ReferenceAttention(q, pos, keys, values, heads, kv_heads, dim, window, bias);
  EXPECT_TRUE(AllClose(ToFloats(got), want, AttentionTolerance<T>()));
  if (bias != nullptr) {  // and the bias is seen: without it the output differs
    EXPECT_FALSE(AllClose(ToFloats(got),
                          ReferenceAttention(q, pos, keys, values, heads, kv_heads, dim, window),
                          AttentionTolerance<T>()));
  }
}

TEST(PrefillAttentionCuda, MatchesTheReferenceAcrossShapesAndStarts) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  CheckPrefill<float>(4, 2, 16, 0, 37);     // the tiny preset's shape
  CheckPrefill<float>(8, 8, 64, 100, 50);   // no grouping, a cached prefix
  CheckPrefill<bf16>(32, 8, 128, 0, 300);   // Llama-3-8B's heads
  CheckPrefill<bf16>(28, 4, 128, 777, 65);  // Qwen2.5-7B's heads, after a prefix
  CheckPrefill<bf16>(16, 1, 256, 5, 40);    // the widest head, one KV head
}

TEST(PrefillAttentionCuda, SeesOnlyTheSlidingWindow) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  CheckPrefill<float>(4, 2, 16, 0, 300, 64);    // windows inside one prefill
  CheckPrefill<float>(8, 2, 64, 500, 70, 33);   // after a prefix, a window no tile multiple
  CheckPrefill<bf16>(32, 8, 128, 100, 200, 1);  // a window of one: each query sees itself
  CheckPrefill<bf16>(28, 4, 128, 0, 90, 4096);  // a window longer than the sequence
}

template <typename T>
void CheckDecode(int heads, int kv_heads, int dim, std::vector<int64_t> lengths, int max_splits,
                 int64_t window = 0, const std::vector<RefBias>* biases = nullptr) {
  SCOPED_TRACE(::testing::Message() << "heads " << heads << "/" << kv_heads << " dim " << dim
                                    << " splits " << max_splits << " window " << window);
  const int64_t batch = static_cast<int64_t>(lengths.size());
  const int64_t max_len = *std::max_element(lengths.begin(), lengths.end());
  const int64_t stride = (max_len + 15) / 16;
  // One pool of blocks; each sequence takes its own shuffled run of them.
  PagedFixture<T> f(kv_heads, dim, static_cast<int>(batch * stride), 6);
  std::vector<int32_t> tables(batch * stride);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < stride; ++i) tables[b * stride + i] = f.table[b * stride + i];
  }
  std::vector<float> q = Rounded<T>(Uniforms(batch * heads * dim, 8, -2.0f, 2.0f));
  std::vector<float> want;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lengths[b];
    const auto kv = Rounded<T>(Uniforms(2 * len * f.row(), 9 + b, -2.0f, 2.0f));
    auto d_kv = ToDevice(FromFloats<T>(kv));
    auto d_tab = ToDevice(
        std::vector<int32_t>(tables.begin() + b * stride, tables.begin() + (b + 1) * stride));
    ASSERT_TRUE(d_kv.ok() && d_tab.ok());
    KDN_ASSERT_OK(WriteKvCuda<T>(d_kv->get(), d_kv->get() + len * f.row(), f.row(), len,
                                 d_tab->get(), 0, f.layer(), nullptr));
    KDN_CUDA_ASSERT_OK(cudaDeviceSynchronize());  // the copy is done before d_kv goes
    const std::vector<float> qb(q.begin() + b * heads * dim, q.begin() + (b + 1) * heads * dim);
    const RefBias* bias =
        biases != nullptr && !(*biases)[b].per_head.empty() ? &(*biases)[b] : nullptr;
    const auto out = ReferenceAttention(qb, {len - 1},
                                        std::vector<float>(kv.begin(), kv.begin() + len * f.row()),
                                        std::vector<float>(kv.begin() + len * f.row(), kv.end()),
                                        heads, kv_heads, dim, window, bias);
    want.insert(want.end(), out.begin(), out.end());
  }
  std::vector<int32_t> lens32(lengths.begin(), lengths.end());
  auto d_q = ToDevice(FromFloats<T>(q));
  auto d_tables = ToDevice(tables);
  auto d_lens = ToDevice(lens32);
  auto d_out = ToDevice(std::vector<T>(q.size()));
  const AttentionShape shape{heads, kv_heads, dim, 1.0f / std::sqrt(static_cast<float>(dim)),
                             window};
  auto d_ws = ToDevice(std::vector<float>(std::max<size_t>(
      1, DecodeAttentionWorkspaceBytes(batch, shape, max_splits) / sizeof(float))));
  ASSERT_TRUE(d_q.ok() && d_tables.ok() && d_lens.ok() && d_out.ok() && d_ws.ok());
  const DeviceRefBias d_bias =
      ToDeviceBias(biases != nullptr ? *biases : std::vector<RefBias>(batch), heads);
  ASSERT_TRUE(d_bias.head_bias.ok() && d_bias.spans.ok() && d_bias.span_first.ok());
  KDN_ASSERT_OK(DecodeAttentionCuda<T>(d_q->get(), f.const_layer(), d_tables->get(), stride,
                                       d_lens->get(), batch, max_len, shape, max_splits,
                                       d_ws->get(), d_out->get(), nullptr,
                                       biases != nullptr ? d_bias.view : ScoreBiasCuda{}));
  std::vector<T> got;
  KDN_ASSERT_OK(ToHost(d_out->get(), q.size(), &got));
  EXPECT_TRUE(AllClose(ToFloats(got), want, AttentionTolerance<T>()));
}

TEST(DecodeAttentionCuda, MatchesTheReferenceWholeAndSplit) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  CheckDecode<float>(4, 2, 16, {1, 17, 64, 200}, 1);    // tiny's shape, one split
  CheckDecode<float>(4, 2, 16, {1, 17, 64, 3000}, 16);  // ragged, split
  CheckDecode<bf16>(32, 8, 128, {4096}, 64);            // batch 1, long: many splits
  CheckDecode<bf16>(28, 4, 128, {5, 700, 33, 1500}, 8);
}

TEST(DecodeAttentionCuda, SeesOnlyTheSlidingWindowWholeAndSplit) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  CheckDecode<float>(4, 2, 16, {1, 17, 64, 200}, 1, 50);     // one split
  CheckDecode<float>(4, 2, 16, {1, 17, 64, 3000}, 16, 100);  // splits wholly before the window
  CheckDecode<bf16>(32, 8, 128, {4096}, 64, 4095);
}

// PASTA's emphasis (KvSequence::AttentionBias): each head's bias on its
// spans' scores, against the reference with the bias added.
TEST(PrefillAttentionCuda, AddsEachHeadsScoreBiasOnItsSpans) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const RefBias tiny{{{3, 9}, {20, 31}}, {2.0f, -1.5f, 0.0f, 4.0f}};
  CheckPrefill<float>(4, 2, 16, 0, 37, 0, &tiny);
  CheckPrefill<float>(4, 2, 16, 100, 50, 64, &tiny);  // after a prefix, in a window
  RefBias wide{{{0, 1}, {40, 300}, {400, 401}}, std::vector<float>(32, 0.0f)};
  for (int h = 0; h < 32; h += 3) wide.per_head[h] = 1.0f + h / 8.0f;
  CheckPrefill<bf16>(32, 8, 128, 100, 300, 0, &wide);
}

TEST(DecodeAttentionCuda, AddsEachRowsScoreBiasWholeAndSplit) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  // Rows with their own biases and spans, one with none.
  const std::vector<RefBias> rows{{{{0, 1}}, {3.0f, 3.0f, 3.0f, 3.0f}},
                                  {},
                                  {{{5, 40}}, {0.0f, 2.0f, -2.0f, 1.0f}},
                                  {{{10, 20}, {150, 180}}, {1.0f, 1.0f, 0.5f, 2.5f}}};
  CheckDecode<float>(4, 2, 16, {1, 17, 64, 200}, 1, 0, &rows);
  CheckDecode<float>(4, 2, 16, {1, 17, 64, 3000}, 16, 0, &rows);
  const std::vector<RefBias> long_row{{{{100, 900}, {4000, 4096}}, std::vector<float>(32, 1.5f)}};
  CheckDecode<bf16>(32, 8, 128, {4096}, 64, 0, &long_row);
}

// ---------------------------------------------------- argument checking

TEST(LayerKernelsCuda, RefuseBadShapesWithoutTouchingTheDevice) {
  const AttentionShape bad_group{12, 5, 128, 0.1f};
  const AttentionShape bad_dim{8, 8, 300, 0.1f};
  EXPECT_EQ(PrefillAttentionCuda<float>(nullptr, 1, 0, {nullptr, nullptr, 5, 128}, nullptr,
                                        bad_group, nullptr, nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeAttentionCuda<float>(nullptr, {nullptr, nullptr, 8, 300}, nullptr, 0, nullptr, 1,
                                       1, bad_dim, 1, nullptr, nullptr, nullptr)
                .code(),
            StatusCode::kInvalidArgument);
  // Empty work is OK and enqueues nothing, so null pointers are fine there.
  EXPECT_TRUE(SiluMulCuda<float>(nullptr, 0, 8, nullptr, nullptr).ok());
  EXPECT_EQ(SiluMulCuda<float>(nullptr, 1, 8, nullptr, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ArgmaxCuda(nullptr, 1, 0, nullptr, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(
      WriteKvCuda<float>(nullptr, nullptr, 4, 1, nullptr, 0, {nullptr, nullptr, 2, 4}, nullptr)
          .code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(FillUniformCuda<float>(nullptr, -1, 0, 0, 1.0f, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(UniformAt(1, 2, 3, 0.5f), UniformAt(1, 2, 3, 0.5f));
}

}  // namespace
}  // namespace kdn::engine::cuda
