// The Prefiller over the engine's pool as the first tier (docs/engine.md,
// "Resident KV"): a repeated prompt attaches its KV from the pool, a lower
// tier extends it, and KV the pool let go comes back from the tiers.
#include <gtest/gtest.h>

#include <cstring>

#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/prefix_io.h"
#include "kdn/kvbus/transfer_plan.h"
#include "kdn/prefill_worker/prefiller.h"
#include "kdn/testing/tiny_model.h"
#include "prefiller_rig.h"

namespace kdn::prefill_worker {
namespace {

using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;
using testing::GreedyFirstToken;
using testing::HostStore;
using testing::kChunk;
using testing::Options;

// The KV a full prefill of `prompt` leaves, every layer, as floats.
std::vector<float> FullPrefillKv(const std::vector<int32_t>& prompt) {
  auto ref = MakeModel("tiny");
  engine::KvSequence seq = ref->kv_cache().NewSequence();
  std::vector<float> logits;
  EXPECT_TRUE(ref->Prefill(seq, prompt, {}, &logits).ok());
  std::vector<uint8_t> kv(ref->kv_cache().LayerBytes(seq.length(), engine::DType::kF32) *
                          ref->config().num_layers);
  EXPECT_TRUE(
      ref->kv_cache()
          .ReadLayers(seq, 0, ref->config().num_layers, 0, seq.length(), engine::DType::kF32, kv)
          .ok());
  std::vector<float> f(kv.size() / sizeof(float));
  std::memcpy(f.data(), kv.data(), kv.size());
  return f;
}

TEST(PrefillerResident, ARepeatedPromptAttachesItsKvFromThePoolAndMovesNoBytes) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  kvbus::HostTier sink(64u << 20);
  auto receiver = kvbus::Listen("tcp://127.0.0.1:0", sink);
  ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();
  Prefiller p(*model, *store, kvbus::ChunkKey{1, 2}, Options());
  PrefillJob job;
  job.tokens = RandomTokens(100, 258, 21);
  job.sampling.temperature = 0;
  auto first = p.Run(job);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_TRUE(p.StoreNewChunks().ok());
  const engine::ResidentStats after_first = model->kv_cache().resident_stats();
  EXPECT_GT(after_first.entries, 0);
  EXPECT_EQ(model->kv_cache().free_blocks(), model->kv_cache().num_blocks());

  // Again, pushed to a decode worker: every cached token is resident, no
  // byte comes from the host tier, and the decode worker gets the KV a full
  // prefill gives, bit for bit.
  job.decode_endpoint = (*receiver)->endpoint();
  job.transfer_id = "again";
  auto again = p.Run(job);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->cached_tokens, 99);
  EXPECT_EQ(again->resident_tokens, 99);
  EXPECT_EQ(again->kv_bytes_loaded, 0u);
  EXPECT_EQ(again->computed_tokens, 1);
  EXPECT_EQ(again->first_token, GreedyFirstToken(*model, job.tokens));
  const auto keys = kvbus::PrefixKeys({kvbus::ChunkKey{1, 2}, "", kChunk}, job.tokens);
  const auto regions = kvbus::TransferRegions(std::ssize(keys), 100, kChunk, 0, job.transfer_id);
  engine::CpuKvCache& cache = model->kv_cache();
  engine::KvSequence rebuilt = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(rebuilt, 100).ok());
  for (const kvbus::KvRegion& r : regions) {
    for (int l = 0; l < model->config().num_layers; ++l) {
      auto slice = sink.Get(kvbus::LayerSliceKey(r.parent, l));
      ASSERT_TRUE(slice.ok()) << "region at " << r.first << " layer " << l;
      ASSERT_TRUE(kvbridge::LayerSliceToPagedKv(**slice, l, cache, rebuilt, r.first).ok());
    }
  }
  cache.SetLength(rebuilt, 100);
  std::vector<uint8_t> kv(cache.LayerBytes(100, engine::DType::kF32) * model->config().num_layers);
  ASSERT_TRUE(
      cache.ReadLayers(rebuilt, 0, model->config().num_layers, 0, 100, engine::DType::kF32, kv)
          .ok());
  // The 99 attached tokens are the first run's KV, which one full prefill
  // of the prompt gave: bit for bit. The last token, computed alone over
  // them, within float rounding of the full prefill's.
  const std::vector<float> want = FullPrefillKv(job.tokens);
  ASSERT_EQ(kv.size(), want.size() * sizeof(float));
  std::vector<float> got(want.size());
  std::memcpy(got.data(), kv.data(), kv.size());
  const size_t stride = static_cast<size_t>(cache.token_stride());
  for (int l = 0; l < model->config().num_layers; ++l) {
    for (int kv_half = 0; kv_half < 2; ++kv_half) {
      const size_t row0 = (static_cast<size_t>(l) * 2 + kv_half) * 100 * stride;
      EXPECT_EQ(std::memcmp(&got[row0], &want[row0], 99 * stride * sizeof(float)), 0)
          << "layer " << l;
      EXPECT_LT(kdn::testing::RelError(&got[row0 + 99 * stride], &want[row0 + 99 * stride], stride),
                1e-5);
    }
  }
  rebuilt.Reset();
  ASSERT_TRUE(p.StoreNewChunks().ok());

  // With residency off the same hit is loaded from the host tier.
  PrefillerOptions off = Options();
  off.resident = false;
  Prefiller q(*model, *store, kvbus::ChunkKey{1, 2}, off);
  job.decode_endpoint.clear();
  auto loaded = q.Run(job);
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->cached_tokens, 99);
  EXPECT_EQ(loaded->resident_tokens, 0);
  EXPECT_EQ(loaded->kv_bytes_loaded,
            99u * cache.token_stride() * 2 * sizeof(float) * model->config().num_layers);
  EXPECT_EQ(loaded->first_token, again->first_token);
  ASSERT_TRUE(q.StoreNewChunks().ok());
}

TEST(PrefillerResident, ALowerTierThatReachesFurtherExtendsTheResidentPrefix) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  Prefiller p(*model, *store, kvbus::ChunkKey{1, 2}, Options());
  PrefillerOptions off = Options();
  off.resident = false;
  Prefiller other(*model, *store, kvbus::ChunkKey{1, 2}, off);  // another worker's KV
  PrefillJob a;
  a.tokens = RandomTokens(100, 258, 31);
  a.sampling.temperature = 0;
  ASSERT_TRUE(p.Run(a).ok());
  ASSERT_TRUE(p.StoreNewChunks().ok());  // resident here: 100 tokens (pieces 1, 2, 1 past 96)
  // The store learns 7 more tokens of the same text (a conversation another
  // worker stored: pieces 1, 8, 2 past 96).
  PrefillJob b = a;
  const auto answer = RandomTokens(7, 258, 32);
  b.tokens.insert(b.tokens.end(), answer.begin(), answer.end());
  b.tokens.push_back(5);
  ASSERT_TRUE(other.Run(b).ok());
  ASSERT_TRUE(other.StoreNewChunks().ok());
  // The next turn: 100 tokens attached, the 8-token piece that crosses their
  // end written from its 5th token on, then the rest from the store.
  PrefillJob c = b;
  const auto more = RandomTokens(10, 258, 33);
  c.tokens.insert(c.tokens.end(), more.begin(), more.end());
  auto out = p.Run(c);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->resident_tokens, 100);
  EXPECT_EQ(out->cached_tokens, 108);
  const uint64_t token_bytes =
      model->kv_cache().token_stride() * 2 * sizeof(float) * model->config().num_layers;
  EXPECT_EQ(out->kv_bytes_loaded, (108u - 100u) * token_bytes);
  EXPECT_EQ(out->first_token, GreedyFirstToken(*model, c.tokens));
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

TEST(PrefillerResident, AWholeChunkIsNotFetchedForATokenPastTheResidentPrefix) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  PrefillerOptions o = Options();
  o.min_tail_tokens = 4;
  Prefiller p(*model, *store, kvbus::ChunkKey{1, 2}, o);
  PrefillerOptions off = o;
  off.resident = false;
  Prefiller other(*model, *store, kvbus::ChunkKey{1, 2}, off);
  PrefillJob a;
  a.tokens = RandomTokens(31, 258, 51);  // resident: chunk 0 and a tail of 15
  a.sampling.temperature = 0;
  ASSERT_TRUE(p.Run(a).ok());
  ASSERT_TRUE(p.StoreNewChunks().ok());
  PrefillJob b = a;  // stored elsewhere: chunks 0 and 1, and a tail of 1
  b.tokens.push_back(9);
  b.tokens.push_back(10);
  ASSERT_TRUE(other.Run(b).ok());
  ASSERT_TRUE(other.StoreNewChunks().ok());
  PrefillJob c = b;
  const auto more = RandomTokens(10, 258, 52);
  c.tokens.insert(c.tokens.end(), more.begin(), more.end());
  auto out = p.Run(c);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  // Chunk 1 would bring 1 token past the 31 resident: computed instead.
  EXPECT_EQ(out->resident_tokens, 31);
  EXPECT_EQ(out->cached_tokens, 31);
  EXPECT_EQ(out->kv_bytes_loaded, 0u);
  EXPECT_EQ(out->first_token, GreedyFirstToken(*model, c.tokens));
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

TEST(PrefillerResident, UnderPoolPressureEvictedKvComesBackFromTheLowerTiers) {
  engine::EngineOptions eo;
  eo.kv_blocks = 24;  // 384 tokens: room for about three prompts of 100
  auto model = MakeModel("tiny", 7, eo);
  auto store = HostStore();
  Prefiller p(*model, *store, kvbus::ChunkKey{1, 2}, Options());
  std::vector<PrefillJob> jobs(8);
  for (size_t i = 0; i < jobs.size(); ++i) {
    jobs[i].tokens = RandomTokens(100, 258, 40 + static_cast<uint32_t>(i));
    jobs[i].sampling.temperature = 0;
  }
  for (int round = 0; round < 2; ++round) {
    for (const PrefillJob& job : jobs) {
      auto out = p.Run(job);
      ASSERT_TRUE(out.ok()) << out.status().ToString();
      EXPECT_EQ(out->first_token, GreedyFirstToken(*model, job.tokens));
      if (round == 1) {
        // Evicted from the pool long ago: the host tier gives it back.
        EXPECT_EQ(out->cached_tokens, 99);
        EXPECT_EQ(out->resident_tokens +
                      out->kv_bytes_loaded / (model->kv_cache().token_stride() * 2 * sizeof(float) *
                                              model->config().num_layers),
                  99u);
      }
      ASSERT_TRUE(p.StoreNewChunks().ok());
    }
  }
  const engine::ResidentStats st = model->kv_cache().resident_stats();
  EXPECT_GT(st.evictions, 0u);
  // Every block is free or cached and held by no request.
  EXPECT_EQ(model->kv_cache().free_blocks(), model->kv_cache().num_blocks());
  EXPECT_EQ(st.evictable_blocks, st.cached_blocks);
}

}  // namespace
}  // namespace kdn::prefill_worker
