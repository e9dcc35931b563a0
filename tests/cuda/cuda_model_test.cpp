// The whole model on the GPU (CudaEngine, bf16) against the CPU backend
// (CpuEngine, fp32) on the same bf16-rounded generated weights: logits close in
// bf16 terms and the same greedy tokens; and the engine contract's
// equivalences on the GPU itself (a prefill split in two equals one, a
// batched decode step equals each sequence alone). Skipped without a GPU.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "kdn/engine/cuda/cuda_engine.h"
#include "kdn/engine/cpu_engine.h"
#include "kdn/engine/presets.h"
#include "kdn/engine/sampler.h"

namespace kdn::engine::cuda {
namespace {

using namespace ::kdn::engine::cuda::cudatest;  // NOLINT: the tests' own helpers

struct Pair {
  std::unique_ptr<CpuEngine> cpu;
  std::unique_ptr<CudaEngine> gpu;
};

Pair MakePair(const std::string& preset) {
  auto p = FindPreset(preset);
  EXPECT_TRUE(p.ok());
  Pair out;
  ModelWeights w = GenerateWeights(p->config, 3, DType::kBF16);
  CudaEngineOptions go;
  go.kv_tokens = 8192;
  go.max_prefill_tokens = 2048;
  go.max_batch = 8;
  auto gpu = CudaEngine::Create(p->config, w, go);
  EXPECT_TRUE(gpu.ok()) << gpu.status().ToString();
  if (gpu.ok()) out.gpu = std::move(gpu).value();
  EngineOptions co;
  co.threads = 2;
  auto cpu = CpuEngine::Create(p->config, std::move(w), co);
  EXPECT_TRUE(cpu.ok()) << cpu.status().ToString();
  if (cpu.ok()) out.cpu = std::move(cpu).value();
  return out;
}

// Greedy tokens agree, except after a step where the CPU's top two were
// within bf16 noise of each other (then the continuations may part).
void CheckGreedy(const std::string& preset) {
  SCOPED_TRACE(preset);
  Pair m = MakePair(preset);
  ASSERT_TRUE(m.cpu && m.gpu);
  const auto prompt = Tokens(200, 5);
  KvSequence cs = m.cpu->kv_cache().NewSequence();
  KvSequence gs = m.gpu->kv_cache().NewSequence();
  std::vector<float> cl, gl;
  ASSERT_TRUE(m.cpu->Prefill(cs, prompt, {}, &cl).ok());
  KDN_ASSERT_OK(m.gpu->Prefill(gs, prompt, {}, &gl));
  EXPECT_TRUE(LogitsClose(gl, cl));
  for (int step = 0; step < 24; ++step) {
    const int32_t ct = Argmax(cl), gt = Argmax(gl);
    if (ct != gt) {
      const double margin = std::fabs(double(cl[ct]) - cl[gt]);
      double scale = 0;
      for (float v : cl) scale = std::max(scale, std::fabs(double(v)));
      EXPECT_LT(margin, 0.01 * scale) << "step " << step << ": GPU chose " << gt << ", CPU " << ct;
      break;
    }
    KvSequence* cp = &cs;
    KvSequence* gp = &gs;
    ASSERT_TRUE(m.cpu->DecodeStep({&cp, 1}, {&ct, 1}, &cl).ok());
    KDN_ASSERT_OK(m.gpu->DecodeStep({&gp, 1}, {&ct, 1}, &gl));
    EXPECT_TRUE(LogitsClose(gl, cl)) << "step " << step;
  }
  gs.Reset();
}

TEST(CudaEngine, MatchesTheCpuBackendOnTinyPresets) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  CheckGreedy("tiny");
  CheckGreedy("tiny-qwen2");
  CheckGreedy("tiny-mistral");
}

TEST(CudaEngine, MatchesTheCpuBackendOnSmall) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  CheckGreedy("small");
}

// The tiny preset on the GPU with a pool and buffers of these sizes.
Result<std::unique_ptr<CudaEngine>> TinyCudaModel(int64_t kv_tokens, int64_t max_prefill,
                                                  int max_batch) {
  KDN_ASSIGN_OR_RETURN(Preset p, FindPreset("tiny"));
  CudaEngineOptions o;
  o.kv_tokens = kv_tokens;
  o.max_prefill_tokens = max_prefill;
  o.max_batch = max_batch;
  return CudaEngine::Create(p.config, GenerateWeights(p.config, 4, DType::kBF16), o);
}

TEST(CudaEngine, PrefillInTwoCallsAndBatchedDecodeEqualTheirSingleForms) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto m = TinyCudaModel(4096, 512, 4);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  CudaEngine& g = **m;
  const auto prompt = Tokens(150, 6);
  KvSequence whole = g.kv_cache().NewSequence(), split = g.kv_cache().NewSequence();
  std::vector<float> a, b;
  KDN_ASSERT_OK(g.Prefill(whole, prompt, {}, &a));
  KDN_ASSERT_OK(g.Prefill(split, std::span(prompt).first(97), {}, &b));
  KDN_ASSERT_OK(g.Prefill(split, std::span(prompt).subspan(97), {}, &b));
  EXPECT_TRUE(LogitsClose(b, a));
  EXPECT_EQ(Argmax(a), Argmax(b));
  // The KV written by both paths agrees.
  std::vector<float> ka, kb;
  KDN_ASSERT_OK(ReadKv(g, whole, 1, 0, 150, &ka));
  KDN_ASSERT_OK(ReadKv(g, split, 1, 0, 150, &kb));
  EXPECT_TRUE(AllClose(kb, ka, {1.0 / 64, 1e-2}));

  // Three sequences of different lengths, stepped together and alone.
  std::vector<KvSequence> together = NewSequences(g, 3), alone = NewSequences(g, 3);
  std::vector<std::vector<float>> first(3);
  for (int i = 0; i < 3; ++i) {
    const auto t = Tokens(20 + 40 * i, 10 + i);
    KDN_ASSERT_OK(g.Prefill(together[i], t, {}, &first[i]));
    KDN_ASSERT_OK(g.Prefill(alone[i], t, {}, &first[i]));
  }
  std::vector<KvSequence*> ptrs = {&together[0], &together[1], &together[2]};
  const std::vector<int32_t> next = {7, 8, 9};
  std::vector<float> batched;
  KDN_ASSERT_OK(g.DecodeStep(ptrs, next, &batched));
  const int V = g.config().vocab_size;
  for (int i = 0; i < 3; ++i) {
    KvSequence* s = &alone[i];
    std::vector<float> one;
    KDN_ASSERT_OK(g.DecodeStep({&s, 1}, {&next[i], 1}, &one));
    const std::vector<float> row(batched.begin() + i * V, batched.begin() + (i + 1) * V);
    EXPECT_TRUE(AllClose(row, one, {1e-3, 1e-3})) << "sequence " << i;
  }
}

TEST(CudaEngine, RefusesBadTokensAndOverlongPrompts) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto m = TinyCudaModel(1024, 64, 2);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  KvSequence s = (*m)->kv_cache().NewSequence();
  std::vector<float> l;
  EXPECT_EQ((*m)->Prefill(s, std::vector<int32_t>{1, 9999}, {}, &l).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*m)->Prefill(s, Tokens(65, 1), {}, &l).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.length(), 0);
}

}  // namespace
}  // namespace kdn::engine::cuda
