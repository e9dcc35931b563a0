// Resident KV (docs/engine.md, "Resident KV") on the CUDA engine: the code
// the CPU suite proves (engine::KvCache's shared blocks and index, the
// prefill worker's attach) with the device's block copy under it.
#include <gtest/gtest.h>

#include <vector>

#include "cuda_test_util.h"
#include "kdn/engine/cuda/cuda_engine.h"
#include "kdn/engine/presets.h"
#include "kdn/kvbridge/resident.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/tiered_store.h"
#include "kdn/prefill_worker/prefiller.h"

namespace kdn::engine::cuda {
namespace {

using namespace ::kdn::engine::cuda::cudatest;  // NOLINT: the tests' own helpers

Result<std::unique_ptr<CudaEngine>> TinyModel() {
  KDN_ASSIGN_OR_RETURN(Preset p, FindPreset("tiny"));
  CudaEngineOptions o;
  o.kv_tokens = 4096;
  o.max_prefill_tokens = 512;
  o.max_batch = 4;
  return CudaEngine::Create(p.config, GenerateWeights(p.config, 4, DType::kBF16), o);
}

// Every layer's KV of positions [0, n) of `seq`, as floats.
std::vector<float> AllKv(Engine& g, const KvSequence& seq, int64_t n) {
  std::vector<float> all;
  for (int l = 0; l < g.config().num_layers; ++l) {
    std::vector<float> one;
    EXPECT_TRUE(ReadKv(g, seq, l, 0, n, &one).ok());
    all.insert(all.end(), one.begin(), one.end());
  }
  return all;
}

TEST(CudaResident, AResidentHitEqualsAFullPrefillAndTheSharedBlockIsCopiedOnTheDevice) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto m = TinyModel();
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  CudaEngine& g = **m;
  KvCache& cache = g.kv_cache();
  const int unused_at_start = cache.unused_blocks();  // the engine keeps a scratch block
  const auto prompt = Tokens(150, 21);
  // The reference: the whole prompt in one prefill.
  KvSequence full = cache.NewSequence();
  std::vector<float> want;
  KDN_ASSERT_OK(g.Prefill(full, prompt, {}, &want));
  const std::vector<float> full_kv = AllKv(g, full, 150);

  // 149 tokens published (9 blocks and 5 tokens of a tenth), then attached
  // by another sequence, which computes the last token over them.
  KvSequence first = cache.NewSequence();
  std::vector<float> unused;
  KDN_ASSERT_OK(g.Prefill(first, std::span(prompt).first(149), {}, &unused));
  cache.Publish(first, {7, 7}, 149);
  first.Reset();
  const int unused_before = cache.unused_blocks();
  KvSequence again = cache.NewSequence();
  const KvKey chain[] = {{7, 7}};
  KDN_ASSERT_OK(cache.Attach(again, chain));
  EXPECT_EQ(again.length(), 149);
  EXPECT_EQ(cache.unused_blocks(), unused_before);  // no KV moved
  std::vector<float> got;
  KDN_ASSERT_OK(g.Prefill(again, std::span(prompt).subspan(149), {}, &got));
  EXPECT_EQ(cache.resident_stats().copied_blocks, 1u);
  EXPECT_TRUE(LogitsClose(got, want));
  EXPECT_TRUE(AllClose(AllKv(g, again, 150), full_kv, {1.0 / 64, 1e-2}));

  // The resident entry is unchanged by the write into the copy.
  KvSequence third = cache.NewSequence();
  KDN_ASSERT_OK(cache.Attach(third, chain));
  const std::vector<float> resident = AllKv(g, third, 149);
  const std::vector<float> prefix = AllKv(g, again, 149);
  EXPECT_EQ(resident, prefix);
  third.Reset();
  again.Reset();
  full.Reset();
  cache.DropResident();
  EXPECT_EQ(cache.unused_blocks(), unused_at_start);
}

TEST(CudaResident, ThePrefillWorkersRepeatedPromptMovesNoKvFromTheHostTier) {
  KDN_SKIP_WITHOUT_CUDA_DEVICE();
  auto m = TinyModel();
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  CudaEngine& g = **m;
  const int free_at_start = g.kv_cache().free_blocks();  // the engine keeps a scratch block
  std::vector<std::unique_ptr<kvbus::ChunkStore>> tiers;
  tiers.push_back(std::make_unique<kvbus::HostTier>(64u << 20));
  kvbus::TieredStore store(std::move(tiers));
  prefill_worker::PrefillerOptions po;
  po.chunk_tokens = 32;
  prefill_worker::Prefiller p(g, store, kvbus::ChunkKey{1, 2}, po);
  prefill_worker::PrefillJob job;
  job.tokens = Tokens(300, 22);
  job.sampling.temperature = 0;
  auto first = p.Run(job);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  KDN_ASSERT_OK(p.StoreNewChunks());
  auto again = p.Run(job);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->resident_tokens, again->cached_tokens);
  EXPECT_GE(again->cached_tokens, 288);
  EXPECT_EQ(again->kv_bytes_loaded, 0u);
  KDN_ASSERT_OK(p.StoreNewChunks());
  EXPECT_EQ(g.kv_cache().free_blocks(), free_at_start);
}

}  // namespace
}  // namespace kdn::engine::cuda
