// CudaEngine's side of the Engine interface that blend and the workers use:
// RowPass (with KV deviation), RotateCachedKeys, the device KV cache's
// Read/Write by layer, and its refusal of a device that cannot hold it.
// Checked on the GPU against the GPU's own Prefill and against the CPU
// engine on the same weights. Skipped without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "cuda_test_util.h"
#include "kdn/engine/cpu_engine.h"
#include "kdn/engine/cuda/cuda_engine.h"
#include "kdn/engine/presets.h"

namespace kdn::engine::cuda {
namespace {

using namespace ::kdn::engine::cuda::cudatest;  // NOLINT: the tests' own helpers

// A preset on the GPU (weights from seed 4, rounded to bf16), a pool of 4,096
// tokens; null (with a failure) if it cannot be made.
std::unique_ptr<CudaEngine> OnGpu(const std::string& preset, int64_t max_prefill_tokens,
                                  int max_batch) {
  auto p = FindPreset(preset);
  EXPECT_TRUE(p.ok());
  CudaEngineOptions o;
  o.kv_tokens = 4096;
  o.max_prefill_tokens = max_prefill_tokens;
  o.max_batch = max_batch;
  auto m = CudaEngine::Create(p->config, GenerateWeights(p->config, 4, DType::kBF16), o);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? std::move(m).value() : nullptr;
}

std::unique_ptr<CudaEngine> Tiny() { return OnGpu("tiny", 512, 4); }

TEST(CudaRowPass, EveryPositionAtEveryLayerIsAFullPrefill) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto g = Tiny();
  ASSERT_TRUE(g);
  const auto tokens = Tokens(70, 11);
  // Over a cache holding another prompt's KV: each layer overwrites it.
  KvSequence seq = g->kv_cache().NewSequence();
  std::vector<float> want, got;
  KDN_ASSERT_OK(g->Prefill(seq, Tokens(70, 12), {}, &want));
  std::vector<int64_t> all(70);
  std::iota(all.begin(), all.end(), 0);
  auto pass = g->BeginRowPass(seq, tokens, all);
  ASSERT_TRUE(pass.ok()) << pass.status().ToString();
  for (int l = 0; l < g->config().num_layers; ++l) KDN_ASSERT_OK((*pass)->RunLayer());
  KDN_ASSERT_OK((*pass)->Logits(&got));
  KvSequence ref = g->kv_cache().NewSequence();
  KDN_ASSERT_OK(g->Prefill(ref, tokens, {}, &want));
  EXPECT_TRUE(AllClose(got, want, {2e-2, 2e-2}));
  for (int l = 0; l < g->config().num_layers; ++l) {
    std::vector<float> a, b;
    KDN_ASSERT_OK(ReadKv(*g, seq, l, 0, 70, &a));
    KDN_ASSERT_OK(ReadKv(*g, ref, l, 0, 70, &b));
    EXPECT_TRUE(AllClose(a, b, {1.0 / 64, 1e-2})) << "layer " << l;
  }
}

// Past pruned KV (KvSequence::SetNextPosition) a token is rotated for its
// position, not its slot: prefill, decode and a row pass at given positions
// all follow the rule the CPU engine tests (position_shift_test.cpp).
TEST(CudaPositionShift, PrefillDecodeAndRowPassRotateEachTokenForItsPosition) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto g = Tiny();
  ASSERT_TRUE(g);
  const auto tokens = Tokens(40, 21);
  const int64_t shift = 45;
  KvSequence plain = g->kv_cache().NewSequence(), shifted = g->kv_cache().NewSequence();
  KDN_ASSERT_OK(shifted.SetNextPosition(shift));
  std::vector<float> a, b;
  KDN_ASSERT_OK(g->Prefill(plain, tokens, {}, &a));
  KDN_ASSERT_OK(g->Prefill(shifted, tokens, {}, &b));
  EXPECT_TRUE(AllClose(b, a, {2e-2, 2e-2}));  // RoPE is relative
  KDN_ASSERT_OK(g->RotateCachedKeys(plain, 0, 40, shift));
  std::vector<float> ka, kb;
  KDN_ASSERT_OK(ReadKv(*g, plain, 0, 0, 40, &ka));
  KDN_ASSERT_OK(ReadKv(*g, shifted, 0, 0, 40, &kb));
  EXPECT_TRUE(AllClose(kb, ka, {1.0 / 64, 1e-2}));
  KDN_ASSERT_OK(g->RotateCachedKeys(plain, 0, 40, -shift));
  KvSequence* p = &plain;
  KvSequence* s = &shifted;
  const int32_t next = tokens[3];
  KDN_ASSERT_OK(g->DecodeStep(std::span(&p, 1), std::span(&next, 1), &a));
  KDN_ASSERT_OK(g->DecodeStep(std::span(&s, 1), std::span(&next, 1), &b));
  EXPECT_TRUE(AllClose(b, a, {2e-2, 2e-2}));
  EXPECT_EQ(shifted.next_position(), 41 + shift);
  // Every slot recomputed at its position is the shifted prefill.
  KvSequence rows_seq = g->kv_cache().NewSequence();
  KDN_ASSERT_OK(g->kv_cache().Reserve(rows_seq, 40));
  g->kv_cache().SetLength(rows_seq, 40);
  KDN_ASSERT_OK(rows_seq.SetNextPosition(40 + shift));
  std::vector<int64_t> all(40), at(40);
  for (int i = 0; i < 40; ++i) all[i] = i, at[i] = shift + i;
  auto pass = g->BeginRowPass(rows_seq, tokens, all, at);
  ASSERT_TRUE(pass.ok()) << pass.status().ToString();
  for (int l = 0; l < g->config().num_layers; ++l) KDN_ASSERT_OK((*pass)->RunLayer());
  std::vector<float> got, want;
  KDN_ASSERT_OK((*pass)->Logits(&got));
  KvSequence ref = g->kv_cache().NewSequence();
  KDN_ASSERT_OK(ref.SetNextPosition(shift));
  KDN_ASSERT_OK(g->Prefill(ref, tokens, {}, &want));
  EXPECT_TRUE(AllClose(got, want, {2e-2, 2e-2}));
  // Pruned KV's holes (heads that kept different numbers of tokens) are the
  // CPU engine's alone: refused, not attended over.
  KvSequence q = g->kv_cache().NewSequence();
  KDN_ASSERT_OK(g->Prefill(q, tokens, {}, &a));
  std::vector<int32_t> counts(size_t(g->config().num_layers) * g->config().num_kv_heads, 40);
  counts[0] = 30;
  KDN_ASSERT_OK(q.SetHeadTokens(40, counts));
  EXPECT_EQ(g->Prefill(q, std::span(tokens).first(4), {}, &a).code(), StatusCode::kUnimplemented);
  KvSequence* batch[] = {&q};
  const int32_t one[] = {tokens[0]};
  EXPECT_EQ(g->DecodeStep(batch, one, &a).code(), StatusCode::kUnimplemented);
  EXPECT_EQ(g->BeginRowPass(q, tokens, all).status().code(), StatusCode::kUnimplemented);
}

// Over a cache that holds the prompt's own KV, recomputing any rows changes
// nothing: each row must see exactly the keys up to its position (a row that
// saw a later key, or missed an earlier one, would move the logits). Rows
// scattered in runs of every length, across blocks, split into several
// requests. On tiny (head_dim 16: kdn's reference kernels, run by run) and
// on small (head_dim 64: FlashInfer, one plan for every row).
class CudaRowPassOn : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaRowPassOn, ScatteredRowsSeeExactlyTheKeysUpToTheirPosition) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto made = OnGpu(GetParam(), 1024, 8);
  ASSERT_TRUE(made);
  CudaEngine* g = made.get();
  EXPECT_EQ(g->uses_flash_attention(), g->config().head_dim >= 64);
  const int n = 700;
  const auto tokens = Tokens(n, 31);
  KvSequence seq = g->kv_cache().NewSequence();
  std::vector<float> want, got;
  KDN_ASSERT_OK(g->Prefill(seq, tokens, {}, &want));
  std::mt19937 rng(7);
  std::vector<int64_t> rows;
  for (int64_t p = 0; p < n - 1; ++p) {
    if (rng() % 5 == 0) rows.push_back(p);
  }
  rows.push_back(n - 1);  // the logits' row
  auto pass = g->BeginRowPass(seq, tokens, rows);
  ASSERT_TRUE(pass.ok()) << pass.status().ToString();
  for (int l = 0; l < g->config().num_layers; ++l) KDN_ASSERT_OK((*pass)->RunLayer());
  KDN_ASSERT_OK((*pass)->Logits(&got));
  EXPECT_TRUE(LogitsClose(got, want));
  // The recomputed rows' KV is what the prefill wrote: element by element at
  // layer 1, whose KV comes from one layer's attention over the rows' own
  // keys (a key seen or missed would show there; bf16 sums in another order
  // move single elements by about 1e-2), and to 5% in norm at every layer
  // (those differences grow layer by layer on random weights).
  std::vector<float> after;
  KvSequence ref = g->kv_cache().NewSequence();
  KDN_ASSERT_OK(g->Prefill(ref, tokens, {}, &after));
  for (int l = 0; l < g->config().num_layers; ++l) {
    double err = 0, norm = 0;
    for (int64_t r : rows) {
      std::vector<float> a, b;
      KDN_ASSERT_OK(ReadKv(*g, seq, l, r, 1, &a));
      KDN_ASSERT_OK(ReadKv(*g, ref, l, r, 1, &b));
      if (l == 1) {
        EXPECT_TRUE(AllClose(a, b, {1.0 / 32, 2e-2})) << "row " << r << " layer 1";
      }
      for (size_t i = 0; i < a.size(); ++i) {
        err += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        norm += double(b[i]) * b[i];
      }
    }
    EXPECT_LT(std::sqrt(err / norm), 5e-2) << "layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, CudaRowPassOn, ::testing::Values("tiny", "small"),
                         [](const auto& info) { return info.param; });

// The tiny preset's generated weights (bf16-rounded, from `seed`) on the
// GPU and in the CPU engine, for tests that hold one against the other.
struct TinyTwins {
  std::unique_ptr<CudaEngine> gpu;
  std::unique_ptr<CpuEngine> cpu;
};
TinyTwins TinyOnBoth(uint64_t seed, const std::string& preset = "tiny") {
  TinyTwins t;
  auto p = FindPreset(preset);
  EXPECT_TRUE(p.ok());
  if (!p.ok()) return t;
  ModelWeights w = GenerateWeights(p->config, seed, DType::kBF16);
  CudaEngineOptions go;
  go.kv_tokens = 4096;
  go.max_prefill_tokens = 512;
  go.max_batch = 4;
  auto gpu = CudaEngine::Create(p->config, w, go);
  EXPECT_TRUE(gpu.ok()) << gpu.status().ToString();
  EngineOptions co;
  co.threads = 2;
  auto cpu = CpuEngine::Create(p->config, std::move(w), co);
  EXPECT_TRUE(cpu.ok()) << cpu.status().ToString();
  if (gpu.ok()) t.gpu = std::move(gpu).value();
  if (cpu.ok()) t.cpu = std::move(cpu).value();
  return t;
}

// A prefill's query hook (KV pruning's scores: Expected Attention's
// statistics, KVzip's repeat rows) sees each layer's queries before RoPE,
// with their positions (past pruned KV too), as the CPU engine shows its
// own; the GPU's are bf16, so within bf16's error of the CPU's f32.
TEST(CudaQueryHook, ShowsEachLayersQueriesBeforeRopeAsTheCpuEngineDoes) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const TinyTwins twins = TinyOnBoth(6);
  ASSERT_TRUE(twins.gpu && twins.cpu);
  const auto tokens = Tokens(40, 31);
  const int64_t shift = 7;
  struct Seen {
    std::vector<std::vector<float>> q;  // per layer
    std::vector<std::vector<int32_t>> positions;
  } seen[2];
  Engine* engines[2] = {twins.cpu.get(), twins.gpu.get()};
  for (int e = 0; e < 2; ++e) {
    Seen& s = seen[e];
    const model::ModelConfig& c = engines[e]->config();
    s.q.resize(c.num_layers);
    s.positions.resize(c.num_layers);
    KvSequence seq = engines[e]->kv_cache().NewSequence();
    KDN_ASSERT_OK(seq.SetNextPosition(shift));
    std::vector<float> logits;
    PrefillOptions o;
    o.on_queries = [&](int layer, const float* q, int64_t rows, const int32_t* positions) {
      s.q[layer].insert(s.q[layer].end(), q, q + rows * c.q_dim());
      s.positions[layer].insert(s.positions[layer].end(), positions, positions + rows);
    };
    KDN_ASSERT_OK(engines[e]->Prefill(seq, tokens, o, &logits));
  }
  std::vector<int32_t> want_positions(40);
  std::iota(want_positions.begin(), want_positions.end(), static_cast<int32_t>(shift));
  for (int l = 0; l < twins.cpu->config().num_layers; ++l) {
    EXPECT_EQ(seen[1].positions[l], want_positions) << "layer " << l;
    ASSERT_EQ(seen[1].q[l].size(), seen[0].q[l].size()) << "layer " << l;
    // Within 3% of the layer's largest query element (LogitsClose's rule).
    EXPECT_TRUE(LogitsClose(seen[1].q[l], seen[0].q[l])) << "layer " << l;
  }
  // Expected Attention's statistics from either engine's hook agree too.
  QueryStats stats[2] = {{.skip = 4}, {.skip = 4}};
  for (int e = 0; e < 2; ++e) {
    KvSequence seq = engines[e]->kv_cache().NewSequence();
    std::vector<float> logits;
    KDN_ASSERT_OK(engines[e]->Prefill(
        seq, tokens, {.on_queries = stats[e].Hook(engines[e]->config())}, &logits));
  }
  EXPECT_EQ(stats[1].count, 36);
  EXPECT_EQ(stats[1].count, stats[0].count);
  const std::vector<float> sum0(stats[0].sum.begin(), stats[0].sum.end()),
      sum1(stats[1].sum.begin(), stats[1].sum.end());
  EXPECT_TRUE(LogitsClose(sum1, sum0));
}

// A prefill that stops after its first layers (PrefillOptions::layers, the
// repeat pass of kvzip's profiled scoring): those layers' queries and KV as
// a whole prefill's, no logits.
TEST(CudaPrefillLayers, AScoringPassComputesTheFirstLayersAsAWholePrefillDoes) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto gpu = Tiny();
  ASSERT_TRUE(gpu);
  const auto tokens = Tokens(40, 33);
  KvSequence whole = gpu->kv_cache().NewSequence(), first = gpu->kv_cache().NewSequence();
  std::vector<float> logits;
  KDN_ASSERT_OK(gpu->Prefill(whole, tokens, {}, &logits));
  std::vector<int> seen;
  PrefillOptions o;
  o.layers = 1;
  o.on_queries = [&](int layer, const float*, int64_t, const int32_t*) { seen.push_back(layer); };
  KDN_ASSERT_OK(gpu->Prefill(first, tokens, o, &logits));
  EXPECT_TRUE(logits.empty());
  EXPECT_EQ(seen, std::vector<int>{0});
  EXPECT_EQ(first.length(), 40);
  auto layer0 = [&](const KvSequence& seq) {
    std::vector<float> kv(2 * 40 * gpu->kv_cache().token_stride());
    EXPECT_TRUE(gpu->kv_cache()
                    .Read(seq, 0, 0, 40, DType::kF32,
                          {reinterpret_cast<uint8_t*>(kv.data()), kv.size() * sizeof(float)})
                    .ok());
    return kv;
  };
  EXPECT_EQ(layer0(first), layer0(whole));
}

// An attention bias (KvSequence::SetAttentionBias, PASTA's emphasis) in a
// prefill, a decode step beside an unbiased sequence, and a row pass, as the
// CPU engine applies it: the GPU takes its reference kernels for a call with
// a bias (FlashAttention has none), and the bias moves the logits. On tiny
// (the reference kernels always) and small (FlashInfer's otherwise).
class CudaAttentionBiasOn : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaAttentionBiasOn, PrefillDecodeAndRowPassBiasAsTheCpuEngineDoes) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const TinyTwins twins = TinyOnBoth(7, GetParam());
  ASSERT_TRUE(twins.gpu && twins.cpu);
  const auto tokens = Tokens(60, 41), other = Tokens(30, 42);
  const model::ModelConfig& c = twins.cpu->config();
  const KvSequence::AttentionBias bias{
      {{4, 12}, {30, 44}},
      c.num_heads,
      std::vector<float>(static_cast<size_t>(c.num_layers) * c.num_heads, 6.0f)};
  std::vector<int64_t> all(60);
  std::iota(all.begin(), all.end(), 0);
  std::vector<float> prefill[2], decode[2], rows[2];
  Engine* engines[2] = {twins.cpu.get(), twins.gpu.get()};
  for (int e = 0; e < 2; ++e) {
    KvCache& cache = engines[e]->kv_cache();
    KvSequence seq = cache.NewSequence(), plain = cache.NewSequence();
    KDN_ASSERT_OK(seq.SetAttentionBias(bias));
    KDN_ASSERT_OK(engines[e]->Prefill(seq, tokens, {}, &prefill[e]));
    std::vector<float> unused;
    KDN_ASSERT_OK(engines[e]->Prefill(plain, other, {}, &unused));
    KvSequence* batch[] = {&plain, &seq};
    const int32_t next[] = {other[0], tokens[0]};
    KDN_ASSERT_OK(engines[e]->DecodeStep(batch, next, &decode[e]));
    KvSequence pass_seq = cache.NewSequence();
    KDN_ASSERT_OK(pass_seq.SetAttentionBias(bias));
    KDN_ASSERT_OK(engines[e]->Prefill(pass_seq, tokens, {}, &unused));
    auto pass = engines[e]->BeginRowPass(pass_seq, tokens, all);
    ASSERT_TRUE(pass.ok()) << pass.status().ToString();
    while ((*pass)->next_layer() < c.num_layers) KDN_ASSERT_OK((*pass)->RunLayer());
    KDN_ASSERT_OK((*pass)->Logits(&rows[e]));
  }
  EXPECT_TRUE(LogitsClose(prefill[1], prefill[0]));
  EXPECT_TRUE(LogitsClose(decode[1], decode[0]));  // both rows: biased and not
  EXPECT_TRUE(LogitsClose(rows[1], rows[0]));
  KvSequence unbiased = twins.gpu->kv_cache().NewSequence();
  std::vector<float> without;
  KDN_ASSERT_OK(twins.gpu->Prefill(unbiased, tokens, {}, &without));
  EXPECT_FALSE(LogitsClose(without, prefill[1])) << "the bias changes nothing here";
}

INSTANTIATE_TEST_SUITE_P(Presets, CudaAttentionBiasOn, ::testing::Values("tiny", "small"),
                         [](const auto& info) { return info.param; });

TEST(CudaRowPass, ScatteredRowsAndDeviationMatchTheCpuEngine) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  const TinyTwins twins = TinyOnBoth(5);
  ASSERT_TRUE(twins.gpu && twins.cpu);
  // Both caches hold one prompt's KV; the pass recomputes the rows of
  // another at the check layer, keeps a scattered subset, and finishes.
  const auto held = Tokens(120, 21), tokens = Tokens(120, 22);
  std::vector<int64_t> all(120);
  std::iota(all.begin(), all.end(), 0);
  const std::vector<int64_t> keep = {0, 1, 2, 40, 41, 77, 100, 101, 102, 103, 119};
  std::vector<std::vector<float>> deviation(2), logits(2);
  Engine* engines[2] = {twins.cpu.get(), twins.gpu.get()};
  std::vector<KvSequence> seqs;
  for (int e = 0; e < 2; ++e) {
    seqs.push_back(engines[e]->kv_cache().NewSequence());
    std::vector<float> l;
    KDN_ASSERT_OK(engines[e]->Prefill(seqs[e], held, {}, &l));
    auto pass = engines[e]->BeginRowPass(seqs[e], tokens, all);
    ASSERT_TRUE(pass.ok()) << pass.status().ToString();
    KDN_ASSERT_OK((*pass)->RunLayer(&deviation[e]));
    KDN_ASSERT_OK((*pass)->Keep(keep));
    EXPECT_EQ((*pass)->positions(), keep);
    while ((*pass)->next_layer() < engines[e]->config().num_layers) {
      KDN_ASSERT_OK((*pass)->RunLayer());
    }
    KDN_ASSERT_OK((*pass)->Logits(&logits[e]));
  }
  ASSERT_EQ(deviation[1].size(), 120u);
  EXPECT_TRUE(AllClose(deviation[1], deviation[0], {5e-2, 5e-2}));
  EXPECT_TRUE(LogitsClose(logits[1], logits[0]));
}

TEST(CudaKvCache, RotationThereAndBackAndWriteReadRoundTrip) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto g = Tiny();
  ASSERT_TRUE(g);
  KvSequence seq = g->kv_cache().NewSequence();
  std::vector<float> l, before, after;
  KDN_ASSERT_OK(g->Prefill(seq, Tokens(50, 3), {}, &l));
  KDN_ASSERT_OK(ReadKv(*g, seq, 1, 0, 50, &before));
  KDN_ASSERT_OK(g->RotateCachedKeys(seq, 5, 40, 300));
  KDN_ASSERT_OK(ReadKv(*g, seq, 1, 0, 50, &after));
  EXPECT_FALSE(AllClose(after, before, {1e-3, 1e-3}));
  KDN_ASSERT_OK(g->RotateCachedKeys(seq, 5, 40, -300));
  KDN_ASSERT_OK(ReadKv(*g, seq, 1, 0, 50, &after));
  EXPECT_TRUE(AllClose(after, before, {2e-2, 2e-2}));
  // bf16 in, bf16 out, bit for bit, at positions straddling blocks.
  KvCache& kv = g->kv_cache();
  std::vector<uint16_t> rows(kv.LayerBytes(21, DType::kBF16) / 2);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<uint16_t>(0x3c00 + i % 977);
  const std::span<const uint8_t> in(reinterpret_cast<const uint8_t*>(rows.data()), rows.size() * 2);
  const int last = kv.num_layers() - 1;
  KDN_ASSERT_OK(kv.Write(seq, last, 11, 21, DType::kBF16, in));
  std::vector<uint16_t> back(rows.size());
  KDN_ASSERT_OK(kv.Read(seq, last, 11, 21, DType::kBF16,
                        {reinterpret_cast<uint8_t*>(back.data()), back.size() * 2}));
  EXPECT_EQ(back, rows);
}

// The CUDA pool is one device region (a decode worker exports it for the
// cuda_ipc plane): bytes put at a layer's LayerRanges are what Read gives
// back, in bf16, as on the CPU (tests/engine/kv_cache_test.cpp).
TEST(CudaKvCache, LayerRangesAreWhereAReadsBytesLie) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto g = Tiny();
  ASSERT_TRUE(g);
  KvCache& kv = g->kv_cache();
  const KvPoolMemory mem = kv.Memory();
  ASSERT_NE(mem.base, nullptr);
  EXPECT_EQ(mem.dtype, DType::kBF16);
  EXPECT_GE(mem.device, 0);
  KvSequence hold = kv.NewSequence(), seq = kv.NewSequence();
  KDN_ASSERT_OK(kv.Reserve(hold, 16));
  KDN_ASSERT_OK(kv.Reserve(seq, 48));
  const int layer = kv.num_layers() - 1;
  std::vector<KvPoolRange> ranges;
  KDN_ASSERT_OK(kv.LayerRanges(seq, layer, 10, 32, &ranges));
  std::vector<uint8_t> bytes(kv.LayerBytes(32, DType::kBF16));
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  uint64_t at = 0;
  for (const KvPoolRange& r : ranges) {
    ASSERT_LE(r.offset + r.bytes, mem.bytes);
    ASSERT_EQ(cudaMemcpy(mem.base + r.offset, bytes.data() + at, r.bytes, cudaMemcpyHostToDevice),
              cudaSuccess);
    at += r.bytes;
  }
  EXPECT_EQ(at, bytes.size());
  std::vector<uint8_t> back(bytes.size());
  KDN_ASSERT_OK(kv.Read(seq, layer, 10, 32, DType::kBF16, back));
  EXPECT_EQ(back, bytes);
}

TEST(CudaEngine, RefusesADeviceItCannotFitWithAClearError) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto p = FindPreset("tiny");
  ASSERT_TRUE(p.ok());
  CudaEngineOptions o;
  o.kv_tokens = int64_t{1} << 40;  // far beyond any GPU
  auto m = CudaEngine::Materialize(p->config, 1, o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(m.status().message().find("free"), std::string::npos) << m.status().ToString();
  o.kv_tokens = 1024;
  o.device = DeviceCount();  // one past the last
  m = CudaEngine::Materialize(p->config, 1, o);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("no device"), std::string::npos) << m.status().ToString();
}

}  // namespace
}  // namespace kdn::engine::cuda
