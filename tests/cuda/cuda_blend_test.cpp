// CacheBlend and OpenEngine on the GPU: blend::BlendPrefill through the
// Engine interface on a CudaEngine (ratio 1 is a full prefill; the loader
// thread placing and rotating layer l+1 on the cache's stream while layer l
// computes gives what placing everything first gives), and OpenEngine's
// sizing of a GPU's KV pool from a memory share. Skipped without a GPU.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "cuda_test_util.h"
#include "kdn/blend/blend.h"
#include "kdn/engine/cuda/cuda_engine.h"
#include "kdn/engine/open_engine.h"
#include "kdn/engine/presets.h"
#include "kdn/engine/sampler.h"
#include "kdn/kvbridge/paged_chunks.h"

namespace kdn::engine::cuda {
namespace {

using namespace ::kdn::engine::cuda::cudatest;  // NOLINT: the tests' own helpers

std::unique_ptr<Engine> TinyOnGpu(uint64_t seed) {
  auto p = FindPreset("tiny");
  EXPECT_TRUE(p.ok());
  auto e = OpenEngine(p->config, GenerateWeights(p->config, seed, DType::kBF16),
                      {.device = {Device::Kind::kCuda, 0},
                       .kv_tokens = 8192,
                       .max_prefill_tokens = 1024,
                       .max_batch = 4});
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(e).value() : nullptr;
}

// Three documents, each computed alone on `e` and kept as a chunk of the
// engine's own dtype, and a question.
struct Prompt {
  std::vector<blend::Segment> segments;
  std::vector<int32_t> suffix;
  std::vector<int32_t> all;  // bos, documents, question
};

Prompt MakePrompt(Engine& e) {
  Prompt p;
  p.segments.push_back({{1}, nullptr});
  p.all.push_back(1);
  const kvbus::ChunkKey fingerprint{0, 7};
  for (int d = 0; d < 3; ++d) {
    const std::vector<int32_t> doc = Tokens(90 + 17 * d, 40 + d);
    KvSequence seq = e.kv_cache().NewSequence();
    std::vector<float> logits;
    EXPECT_TRUE(e.Prefill(seq, doc, {}, &logits).ok());
    auto chunk = kvbridge::ChunkFromPagedKv(e.kv_cache(), seq, 0, seq.length(),
                                            kvbus::ChunkKey{1, static_cast<uint64_t>(d)},
                                            fingerprint, e.kv_dtype());
    EXPECT_TRUE(chunk.ok()) << chunk.status().ToString();
    p.segments.push_back({doc, chunk.ok() ? *chunk : nullptr});
    p.all.insert(p.all.end(), doc.begin(), doc.end());
  }
  p.suffix = Tokens(24, 50);
  p.all.insert(p.all.end(), p.suffix.begin(), p.suffix.end());
  return p;
}

TEST(CudaBlend, RatioOneIsAFullPrefill) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto e = TinyOnGpu(6);
  ASSERT_TRUE(e);
  const Prompt p = MakePrompt(*e);
  KvSequence full = e->kv_cache().NewSequence();
  std::vector<float> want;
  KDN_ASSERT_OK(e->Prefill(full, p.all, {}, &want));
  KvSequence seq = e->kv_cache().NewSequence();
  auto r = blend::BlendPrefill(*e, seq, p.segments, p.suffix,
                               {.spec = {.recompute_ratio = 1.0, .check_layer = 0}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(seq.length(), static_cast<int64_t>(p.all.size()));
  EXPECT_TRUE(AllClose(r->logits, want, {2e-2, 2e-2}));
  EXPECT_EQ(Argmax(r->logits), Argmax(want));
  // Every layer's KV is the full prefill's (to bf16 rounding).
  for (int l = 0; l < e->config().num_layers; ++l) {
    std::vector<float> a, b;
    KDN_ASSERT_OK(ReadKv(*e, seq, l, 0, seq.length(), &a));
    KDN_ASSERT_OK(ReadKv(*e, full, l, 0, full.length(), &b));
    EXPECT_TRUE(AllClose(a, b, {1.0 / 64, 1e-2})) << "layer " << l;
  }
}

// Boundary selection goes through the same row pass from layer 0 with no
// check: K covering every document is a full prefill on the device too, and
// a small K recomputes K tokens per document.
TEST(CudaBlend, BoundarySelectionRecomputesEachDocumentsFirstTokens) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto e = TinyOnGpu(9);
  ASSERT_TRUE(e);
  const Prompt p = MakePrompt(*e);
  KvSequence full = e->kv_cache().NewSequence();
  std::vector<float> want;
  KDN_ASSERT_OK(e->Prefill(full, p.all, {}, &want));
  auto blend = [&](const char* selection) {
    KvSequence seq = e->kv_cache().NewSequence();
    auto r = blend::BlendPrefill(*e, seq, p.segments, p.suffix,
                                 {.spec = {.selection = *blend::ParseBlendSelection(selection)}});
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return *r;
  };
  const blend::BlendResult all = blend("boundary:124");  // the longest document
  EXPECT_EQ(all.recomputed_tokens, 90 + 107 + 124);
  EXPECT_TRUE(AllClose(all.logits, want, {2e-2, 2e-2}));
  EXPECT_EQ(Argmax(all.logits), Argmax(want));
  EXPECT_EQ(blend("boundary:4").recomputed_tokens, 3 * 4);
}

TEST(CudaBlend, OverlappedLoadingEqualsLoadingFirst) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto e = TinyOnGpu(7);
  ASSERT_TRUE(e);
  const Prompt p = MakePrompt(*e);
  for (double ratio : {0.0, 0.15}) {
    std::vector<std::vector<float>> logits;
    for (bool overlap : {false, true}) {
      KvSequence seq = e->kv_cache().NewSequence();
      auto r = blend::BlendPrefill(*e, seq, p.segments, p.suffix,
                                   {.spec = {.recompute_ratio = ratio}, .overlap_load = overlap});
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_EQ(r->cached_tokens, 90 + 107 + 124);
      logits.push_back(r->logits);
    }
    // The same kernels on the same KV: bit for bit.
    EXPECT_EQ(logits[0], logits[1]) << "ratio " << ratio;
  }
}

// Progressive filtering goes through the same row pass: each check narrows
// the rows on the device, and overlapped loading still changes nothing.
TEST(CudaBlend, ProgressiveFilteringNarrowsAtEachCheck) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto e = TinyOnGpu(8);
  ASSERT_TRUE(e);
  const Prompt p = MakePrompt(*e);
  std::vector<std::vector<float>> logits;
  for (bool overlap : {false, true}) {
    KvSequence seq = e->kv_cache().NewSequence();
    auto r = blend::BlendPrefill(
        *e, seq, p.segments, p.suffix,
        {.spec = {.recompute_ratio = 0.15, .check_layers = {0, 1}, .check_ratios = {0.3, 0.15}},
         .overlap_load = overlap});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->kept_at_check, (std::vector<int>{97, 49}));  // of 321 cached tokens
    logits.push_back(r->logits);
  }
  EXPECT_EQ(logits[0], logits[1]);
}

TEST(CudaOpenEngine, MemoryShareSizesTheKvPool) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto p = FindPreset("tiny");
  ASSERT_TRUE(p.ok());
  const OpenOptions small{.device = {Device::Kind::kCuda, 0},
                          .gpu_mem_fraction = 0.05,
                          .max_prefill_tokens = 1024,
                          .max_batch = 4};
  auto tokens = KvTokensForMemoryShare(p->config, small);
  ASSERT_TRUE(tokens.ok()) << tokens.status().ToString();
  auto e = OpenEngine(p->config, GenerateWeights(p->config, 1, DType::kBF16), small);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ((*e)->device(), "cuda:0");
  EXPECT_EQ((*e)->kv_cache().num_blocks() * int64_t{kKvBlockTokens}, *tokens + kKvBlockTokens);
  // A share twice as large holds about twice the KV beyond the fixed part.
  auto twice = KvTokensForMemoryShare(p->config, {.device = small.device,
                                                  .gpu_mem_fraction = 0.1,
                                                  .max_prefill_tokens = 1024,
                                                  .max_batch = 4});
  ASSERT_TRUE(twice.ok());
  EXPECT_GT(*twice, *tokens * 3 / 2);
}

TEST(CudaOpenEngine, RefusesAShareTooSmallOrADeviceNotThere) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto p = FindPreset("llama3-8b");
  ASSERT_TRUE(p.ok());
  // 16 GB of bf16 weights do not fit in a thousandth of any GPU.
  auto r = MaterializeEngine(p->config, 1,
                             {.device = {Device::Kind::kCuda, 0}, .gpu_mem_fraction = 0.001});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("give it a larger share"), std::string::npos)
      << r.status().message();
  auto missing = MaterializeEngine(p->config, 1, {.device = {Device::Kind::kCuda, 99}});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("no device 99"), std::string::npos)
      << missing.status().message();
}

}  // namespace
}  // namespace kdn::engine::cuda
