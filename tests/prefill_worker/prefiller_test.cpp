#include "kdn/prefill_worker/prefiller.h"

#include <gtest/gtest.h>

#include <cstring>

#include "kdn/testing/tiny_model.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/transfer_plan.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/prefix_io.h"
#include "kdn/kvbridge/paged_chunks.h"

namespace kdn::prefill_worker {
namespace {

using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;

constexpr int kChunk = 16;

std::unique_ptr<kvbus::TieredStore> HostStore() {
  std::vector<std::unique_ptr<kvbus::ChunkStore>> tiers;
  tiers.push_back(std::make_unique<kvbus::HostTier>(64u << 20));
  return std::make_unique<kvbus::TieredStore>(std::move(tiers));
}

PrefillerOptions Options() {
  PrefillerOptions o;
  o.chunk_tokens = kChunk;
  o.sender.peer_timeout = std::chrono::milliseconds(500);
  o.sender.heartbeat_interval = std::chrono::milliseconds(100);
  o.push_timeout = std::chrono::milliseconds(5000);
  o.min_tail_tokens = 1;  // chunks of 16: every tail is shorter than the default
  return o;
}

int32_t GreedyFirstToken(engine::CpuEngine& model, const std::vector<int32_t>& prompt) {
  engine::KvSequence seq = model.kv_cache().NewSequence();
  std::vector<float> logits;
  EXPECT_TRUE(model.Prefill(seq, prompt, {}, &logits).ok());
  return engine::Argmax(logits);
}

TEST(Prefiller, SecondRunLoadsTheCachedPrefixAndComputesOnlyTheRest) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  Prefiller p(*model, *store, kvbus::ChunkKey{1, 2}, Options());
  PrefillJob job;
  job.tokens = RandomTokens(100, 258, 3);
  job.sampling.temperature = 0;

  auto first = p.Run(job);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->cached_tokens, 0);
  EXPECT_EQ(first->computed_tokens, 100);
  ASSERT_TRUE(p.StoreNewChunks().ok());
  // 100 / 16 full chunks, and the tail of 4 as pieces of 1, 2 and 1 tokens.
  EXPECT_EQ(store->Stats().chunks, 6u + 3u);

  // A longer prompt sharing the first 100 tokens: the 6 chunks and the tail
  // pieces come from the store; only the 20 new tokens are computed.
  PrefillJob longer = job;
  const auto more = RandomTokens(20, 258, 4);
  longer.tokens.insert(longer.tokens.end(), more.begin(), more.end());
  auto second = p.Run(longer);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->cached_tokens, 100);
  EXPECT_EQ(second->computed_tokens, 20);
  EXPECT_EQ(second->first_token, GreedyFirstToken(*model, longer.tokens));
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

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

TEST(Prefiller, StoresInTheBackgroundWhatItWouldStoreItself) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  PrefillerOptions o = Options();
  o.store_in_background = true;
  Prefiller p(*model, *store, kvbus::ChunkKey{1, 2}, o);
  PrefillJob job;
  job.tokens = RandomTokens(100, 258, 3);
  job.sampling.temperature = 0;
  ASSERT_TRUE(p.Run(job).ok());
  ASSERT_TRUE(p.StoreNewChunks().ok());
  // The prompt is resident at once; the store has it once the thread is done.
  EXPECT_GT(model->kv_cache().resident_stats().entries, 0);
  p.WaitForStores();
  EXPECT_EQ(store->Stats().chunks, 6u + 3u);  // as SecondRunLoadsTheCachedPrefix...
  EXPECT_EQ(p.StoreFailures(), 0u);
  // Again: every chunk is held, none put twice.
  ASSERT_TRUE(p.Run(job).ok());
  ASSERT_TRUE(p.StoreNewChunks().ok());
  p.WaitForStores();
  EXPECT_EQ(store->Stats().chunks, 6u + 3u);
}

// Prefetch, as a worker's KV I/O thread runs it, then Run with what it
// read: the outcome a Run that reads the tiers itself has, whatever the pool
// did in between.
TEST(Prefiller, ARunServedByAPrefetchGivesWhatItsOwnReadsGive) {
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  PrefillJob job;
  job.tokens = RandomTokens(100, 258, 3);
  job.sampling.temperature = 0;
  // The prompt and 20 more tokens, new each time (the last one's own chunks
  // are stored after each run).
  const auto longer = [&](uint32_t seed) {
    PrefillJob l = job;
    const auto more = RandomTokens(20, 258, seed);
    l.tokens.insert(l.tokens.end(), more.begin(), more.end());
    return l;
  };
  {  // Another worker stored the prompt's chunks.
    auto other = MakeModel("tiny");
    Prefiller writer(*other, *store, fp, Options());
    ASSERT_TRUE(writer.Run(job).ok());
    ASSERT_TRUE(writer.StoreNewChunks().ok());
  }
  auto model = MakeModel("tiny");
  Prefiller p(*model, *store, fp, Options());

  // Read from the host tier: its 100 tokens placed, 20 computed.
  const PrefillJob first = longer(4);
  const PrefetchedKv cold = p.Prefetch(first);
  EXPECT_EQ(cold.resident, 0);
  auto out = p.Run(first, &cold);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->cached_tokens, 100);
  EXPECT_EQ(out->resident_tokens, 0);
  EXPECT_GT(out->kv_bytes_loaded, 0u);
  EXPECT_EQ(out->computed_tokens, 20);
  EXPECT_EQ(out->first_token, GreedyFirstToken(*model, first.tokens));
  ASSERT_TRUE(p.StoreNewChunks().ok());

  // Read before the pool held the prompt, run after: the pool's blocks are
  // attached, and the chunks read for those tokens are not placed.
  model->kv_cache().DropResident();
  const PrefillJob second = longer(5);
  const PrefetchedKv stale = p.Prefetch(second);
  EXPECT_EQ(stale.resident, 0);
  ASSERT_TRUE(p.Run(job).ok());
  ASSERT_TRUE(p.StoreNewChunks().ok());  // the 100 tokens resident again
  out = p.Run(second, &stale);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->cached_tokens, 100);
  EXPECT_EQ(out->resident_tokens, 100);
  EXPECT_EQ(out->kv_bytes_loaded, 0u);
  EXPECT_EQ(out->computed_tokens, 20);
  EXPECT_EQ(out->first_token, GreedyFirstToken(*model, second.tokens));
  ASSERT_TRUE(p.StoreNewChunks().ok());

  // Read before the pool held part of the prompt, run after: that part is
  // attached, the chunks read past it placed.
  model->kv_cache().DropResident();
  const PrefillJob fourth = longer(7);
  const PrefetchedKv part = p.Prefetch(fourth);
  PrefillJob half = job;
  half.tokens.resize(50);
  ASSERT_TRUE(p.Run(half).ok());
  ASSERT_TRUE(p.StoreNewChunks().ok());
  out = p.Run(fourth, &part);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->cached_tokens, 100);
  EXPECT_GE(out->resident_tokens, 48);
  EXPECT_GT(out->kv_bytes_loaded, 0u);
  EXPECT_EQ(out->computed_tokens, 20);
  EXPECT_EQ(out->first_token, GreedyFirstToken(*model, fourth.tokens));
  ASSERT_TRUE(p.StoreNewChunks().ok());

  // Read while the pool held the prompt, run after it was evicted: nothing
  // is read now, so the prompt is computed whole.
  const PrefillJob third = longer(6);
  const PrefetchedKv resident = p.Prefetch(third);
  EXPECT_GE(resident.resident, 96);  // its full chunks at least
  model->kv_cache().DropResident();
  out = p.Run(third, &resident);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->cached_tokens, 0);
  EXPECT_EQ(out->computed_tokens, 120);
  EXPECT_EQ(out->first_token, GreedyFirstToken(*model, third.tokens));
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

TEST(Prefiller, APromptOfWholeChunksStillComputesItsLastChunk) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  Prefiller p(*model, *store, kvbus::ChunkKey{1, 2}, Options());
  PrefillJob job;
  job.tokens = RandomTokens(64, 258, 5);
  job.sampling.temperature = 0;
  ASSERT_TRUE(p.Run(job).ok());
  ASSERT_TRUE(p.StoreNewChunks().ok());
  auto again = p.Run(job);
  ASSERT_TRUE(again.ok());
  // The last token's logits are needed, so its chunk is recomputed.
  EXPECT_EQ(again->cached_tokens, 48);
  EXPECT_EQ(again->computed_tokens, 16);
  EXPECT_EQ(again->first_token, GreedyFirstToken(*model, job.tokens));
}

TEST(Prefiller, PushesLayerSlicesThatRebuildThePromptKvAtTheReceiver) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  kvbus::HostTier sink(64u << 20);
  auto receiver = kvbus::Listen("tcp://127.0.0.1:0", sink);
  ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();

  PrefillJob job;
  job.tokens = RandomTokens(75, 258, 6);  // 4 full chunks and a tail of 11
  job.sampling.temperature = 0;
  job.decode_endpoint = (*receiver)->endpoint();
  job.decode_held_tokens = 16;  // the receiver needs no KV for tokens [0, 16)
  job.transfer_id = "request-1";
  auto out = p.Run(job);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  const int layers = model->config().num_layers;
  const uint64_t token_bytes = model->kv_cache().token_stride() * 2 * sizeof(float);
  EXPECT_EQ(out->kv_bytes_sent, (75u - 16u) * token_bytes * layers);
  EXPECT_EQ(out->slices_skipped, 1u * layers);  // the held chunk

  // The reference KV: the same prompt prefilled in one go on the same weights.
  auto ref_model = MakeModel("tiny");
  engine::KvSequence ref = ref_model->kv_cache().NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(ref_model->Prefill(ref, job.tokens, {}, &logits).ok());

  const auto keys = kvbus::PrefixKeys({fp, "", kChunk}, job.tokens);
  const auto regions = kvbus::TransferRegions(std::ssize(keys), 75, kChunk, 16, job.transfer_id);
  ASSERT_EQ(regions.size(), 4u);  // chunks 1..3 and the tail
  engine::CpuKvCache& cache = model->kv_cache();
  engine::KvSequence rebuilt = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(rebuilt, 75).ok());
  for (int l = 0; l < layers; ++l) {
    EXPECT_FALSE(sink.Contains(  // held: never sent
        kvbus::LayerSliceKey(kvbus::TransferRegionKey(job.transfer_id, 0), l)));
    for (const kvbus::KvRegion& r : regions) {
      auto slice = sink.Get(kvbus::LayerSliceKey(r.parent, l));
      ASSERT_TRUE(slice.ok()) << "layer " << l << " of region at " << r.first;
      ASSERT_TRUE(kvbridge::LayerSliceToPagedKv(**slice, l, cache, rebuilt, r.first).ok());
    }
  }
  const int64_t stride = cache.token_stride();
  for (int l = 0; l < layers; ++l) {
    for (int64_t t = 16; t < 75; ++t) {
      EXPECT_LT(kdn::testing::RelError(cache.KeyAt(rebuilt, l, t),
                                       ref_model->kv_cache().KeyAt(ref, l, t), stride),
                1e-5);
      EXPECT_LT(kdn::testing::RelError(cache.ValueAt(rebuilt, l, t),
                                       ref_model->kv_cache().ValueAt(ref, l, t), stride),
                1e-5);
    }
  }

  // The same prompt again: every slice is already there, so none is sent.
  ASSERT_TRUE(p.StoreNewChunks().ok());
  auto again = p.Run(job);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->kv_bytes_sent, 0u);
  EXPECT_EQ(again->slices_skipped, 5u * layers);
}

// With the pool in memory of the host backend (as a worker allocates it),
// slices are sourced from the request's own blocks: shm copies them from
// there into the receiver's landing segment, and what arrives is, byte for
// byte, what the chunk-building path sends.
TEST(Prefiller, SlicesSourcedFromThePoolArriveAsTheBuiltOnesDo) {
  std::unique_ptr<kvbus::DeviceMemory> pool;
  engine::EngineOptions eo;
  eo.kv_pool_memory = [&](uint64_t bytes) -> Result<uint8_t*> {
    KDN_ASSIGN_OR_RETURN(pool, kvbus::HostDeviceOps().Allocate(bytes));
    return pool->data();
  };
  auto model = MakeModel("tiny", 7, eo);
  ASSERT_NE(pool, nullptr);
  auto built_model = MakeModel("tiny", 7);
  PrefillJob job;
  job.tokens = RandomTokens(75, 258, 6);
  job.sampling.temperature = 0;
  job.transfer_id = "request-1";
  const kvbus::ChunkKey fp{1, 2};
  std::vector<std::unique_ptr<kvbus::HostTier>> sinks;
  std::vector<kvbus::ReceiverStats> stats;
  std::vector<uint32_t> sourced;
  for (engine::CpuEngine* m : {model.get(), built_model.get()}) {
    auto store = HostStore();
    PrefillerOptions o = Options();
    if (m == model.get()) o.kv_pool = pool.get();
    Prefiller p(*m, *store, fp, o);
    sinks.push_back(std::make_unique<kvbus::HostTier>(64u << 20));
    kvbus::ReceiverOptions ro;
    ro.shm_landing_bytes = 16u << 20;
    auto receiver = kvbus::Listen("tcp://127.0.0.1:0", *sinks.back(), ro);
    ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();
    job.decode_endpoint = (*receiver)->endpoint();
    auto out = p.Run(job);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    stats.push_back((*receiver)->Stats());
    sourced.push_back(out->slices_sourced);
  }
  const auto keys = kvbus::PrefixKeys({fp, "", kChunk}, job.tokens);
  const auto regions = kvbus::TransferRegions(std::ssize(keys), 75, kChunk, 0, job.transfer_id);
  for (int l = 0; l < model->config().num_layers; ++l) {
    for (const kvbus::KvRegion& r : regions) {
      const kvbus::ChunkKey k = kvbus::LayerSliceKey(r.parent, l);
      auto sourced = sinks[0]->Get(k);
      auto built = sinks[1]->Get(k);
      ASSERT_TRUE(sourced.ok() && built.ok()) << "layer " << l << " of region at " << r.first;
      EXPECT_TRUE(std::equal((*sourced)->bytes().begin(), (*sourced)->bytes().end(),
                             (*built)->bytes().begin(), (*built)->bytes().end()));
    }
  }
  const auto slices = regions.size() * model->config().num_layers;
  EXPECT_EQ(sourced[0], slices) << "every slice read where it lies";
  EXPECT_EQ(sourced[1], 0u);
  EXPECT_EQ(stats[0].shm_chunks, slices);
}

// BOS, three documents and a question, as a blend job.
PrefillJob BlendJobOf(const std::vector<std::vector<int32_t>>& docs,
                      const std::vector<int32_t>& question, double ratio) {
  PrefillJob job;
  job.tokens = {256};
  BlendJob b;
  b.head_tokens = 1;
  for (const auto& d : docs) {
    job.tokens.insert(job.tokens.end(), d.begin(), d.end());
    b.segment_tokens.push_back(static_cast<int>(d.size()));
  }
  job.tokens.insert(job.tokens.end(), question.begin(), question.end());
  b.recompute_ratio = ratio;
  job.blend = b;
  job.sampling.temperature = 0;
  return job;
}

TEST(Prefiller, BlendStoresDocumentsAloneUnderSegmentKeysThenReusesThemInAnyOrder) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  const std::vector<std::vector<int32_t>> docs = {
      RandomTokens(40, 256, 11), RandomTokens(33, 256, 12), RandomTokens(50, 256, 13)};
  const auto question = RandomTokens(9, 256, 14);

  // First sight: no document is held, so everything is computed in full.
  auto first = p.Run(BlendJobOf(docs, question, 0.15));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->cached_tokens, 0);
  EXPECT_EQ(first->blended_tokens, 0);
  EXPECT_EQ(first->computed_tokens, 1 + 123 + 9);
  PrefillJob plain;
  plain.tokens = BlendJobOf(docs, question, 0).tokens;
  EXPECT_EQ(first->first_token, GreedyFirstToken(*model, plain.tokens));
  ASSERT_TRUE(p.StoreNewChunks().ok());
  // Each document is stored on its own; nothing under prefix keys.
  const kvbus::KeyContext ctx{fp, "", kChunk};
  for (const auto& d : docs) {
    auto chunk = store->Get(kvbus::SegmentKey(ctx, d));
    ASSERT_TRUE(chunk.ok());
    EXPECT_EQ((*chunk)->info().tokens, d.size());
    EXPECT_EQ((*chunk)->info().position, 0);
  }
  EXPECT_EQ(store->Stats().chunks, 3u);

  // The documents in another order: all blended, 15% of them recomputed.
  const std::vector<std::vector<int32_t>> shuffled = {docs[2], docs[0], docs[1]};
  auto second = p.Run(BlendJobOf(shuffled, question, 0.15));
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->cached_tokens, 123);
  EXPECT_EQ(second->blended_tokens, 123);
  EXPECT_EQ(second->recomputed_tokens, 19);  // ceil(0.15 * 123)
  EXPECT_EQ(second->computed_tokens, 10);
  ASSERT_TRUE(p.StoreNewChunks().ok());
  EXPECT_EQ(store->Stats().chunks, 3u);  // the blended prompt is not stored

  // Ratio 1 recomputes everything: the first token of a full prefill.
  auto full = p.Run(BlendJobOf(shuffled, question, 1.0));
  ASSERT_TRUE(full.ok());
  PrefillJob shuffled_plain;
  shuffled_plain.tokens = BlendJobOf(shuffled, question, 0).tokens;
  EXPECT_EQ(full->recomputed_tokens, 123);
  EXPECT_EQ(full->first_token, GreedyFirstToken(*model, shuffled_plain.tokens));
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

TEST(Prefiller, ABlendOrInjectServedByAPrefetchGivesWhatItsOwnReadsGive) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  const std::vector<std::vector<int32_t>> docs = {RandomTokens(40, 256, 11),
                                                  RandomTokens(33, 256, 12)};
  const auto question = RandomTokens(9, 256, 14);
  PrefillJob inject;
  inject.tokens = docs[0];
  inject.ns = "";
  PrefetchedKv read = p.Prefetch(inject, /*inject=*/true);
  EXPECT_FALSE(read.inject_held);
  auto injected = p.Inject(docs[0], "", nullptr, &read);
  ASSERT_TRUE(injected.ok()) << injected.status().ToString();
  EXPECT_FALSE(injected->already_held);
  read = p.Prefetch(inject, /*inject=*/true);
  EXPECT_TRUE(read.inject_held);
  injected = p.Inject(docs[0], "", nullptr, &read);
  ASSERT_TRUE(injected.ok());
  EXPECT_TRUE(injected->already_held);

  // One document held, one not: read ahead, the blend fuses the one and
  // computes the other, as when it asks the store itself.
  const PrefillJob blend = BlendJobOf(docs, question, 0.15);
  read = p.Prefetch(blend);
  EXPECT_EQ(read.segments.size(), 1u);
  auto ahead = p.Run(blend, &read);
  ASSERT_TRUE(ahead.ok()) << ahead.status().ToString();
  p.WaitForStores();
  ASSERT_TRUE(p.StoreNewChunks().ok());  // stores the second document
  auto own = p.Run(blend);               // now both are held
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(ahead->blended_tokens, 40);
  EXPECT_EQ(own->blended_tokens, 73);
  ASSERT_TRUE(p.StoreNewChunks().ok());
  // A read taken before this worker stored the second document still finds
  // it, in the host tier.
  auto late = p.Run(blend, &read);
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->blended_tokens, 73);
  EXPECT_EQ(late->first_token, own->first_token);
  ASSERT_TRUE(p.StoreNewChunks().ok());
  read = p.Prefetch(blend);
  EXPECT_EQ(read.segments.size(), 2u);
  auto again = p.Run(blend, &read);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->blended_tokens, own->blended_tokens);
  EXPECT_EQ(again->first_token, own->first_token);
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

// A blend job's fused KV as its decode worker's receiver got it: one slice
// of `kv_tokens` tokens per layer, named for the job's transfer from
// position 0, and the bytes the outcome says it sent.
void ExpectFusedKvArrived(engine::CpuEngine& model, kvbus::HostTier& sink, const PrefillJob& job,
                          const PrefillOutcome& out, uint32_t kv_tokens) {
  const int layers = model.config().num_layers;
  const uint64_t token_bytes = model.kv_cache().token_stride() * 2 * sizeof(float);
  EXPECT_EQ(out.kv_bytes_sent, kv_tokens * token_bytes * layers);
  const kvbus::ChunkKey xfer = kvbus::TransferRegionKey(job.transfer_id, 0);
  for (int l = 0; l < layers; ++l) {
    auto slice = sink.Get(kvbus::LayerSliceKey(xfer, l));
    ASSERT_TRUE(slice.ok()) << "layer " << l;
    EXPECT_EQ((*slice)->info().tokens, kv_tokens);
  }
}

TEST(Prefiller, BlendPushesTheFusedKvUnderTheTransferKeyOnly) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  kvbus::HostTier sink(64u << 20);
  auto receiver = kvbus::Listen("tcp://127.0.0.1:0", sink);
  ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();
  const std::vector<std::vector<int32_t>> docs = {RandomTokens(40, 256, 21),
                                                  RandomTokens(30, 256, 22)};
  for (const auto& d : docs) ASSERT_FALSE(p.Inject(d, "")->already_held);
  PrefillJob job = BlendJobOf(docs, RandomTokens(7, 256, 23), 0.15);
  job.decode_endpoint = (*receiver)->endpoint();
  job.transfer_id = "blend-1";
  auto out = p.Run(job);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->blended_tokens, 70);
  ExpectFusedKvArrived(*model, sink, job, *out, 78);
  const auto prefix = kvbus::PrefixKeys({fp, "", kChunk}, job.tokens);
  for (int l = 0; l < model->config().num_layers; ++l) {
    for (const auto& k : prefix) EXPECT_FALSE(sink.Contains(kvbus::LayerSliceKey(k, l)));
  }
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

TEST(Prefiller, InjectStoresADocumentOnceAndRefusesBadOnes) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  const auto doc = RandomTokens(60, 256, 31);
  auto first = p.Inject(doc, "tenant");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_FALSE(first->already_held);
  EXPECT_EQ(first->stored_tokens, 60);
  auto again = p.Inject(doc, "tenant");
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->already_held);
  EXPECT_EQ(again->stored_tokens, 0);
  EXPECT_TRUE(store->Contains(kvbus::SegmentKey({fp, "tenant", kChunk}, doc)));
  EXPECT_FALSE(store->Contains(kvbus::SegmentKey({fp, "", kChunk}, doc)));
  EXPECT_EQ(p.Inject(std::vector<int32_t>{}, "").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.Inject(std::vector<int32_t>{1, 2, 999}, "").status().code(),
            StatusCode::kInvalidArgument);
  // A blend job whose documents leave no question is refused.
  PrefillJob job = BlendJobOf({doc}, {}, 0.15);
  EXPECT_EQ(p.Run(job).status().code(), StatusCode::kInvalidArgument);
}

TEST(Prefiller, InjectWithPruneStoresAPrunedChunkThatABlendPushesWithoutItsDroppedTokens) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  kvbus::HostTier sink(64u << 20);
  auto receiver = kvbus::Listen("tcp://127.0.0.1:0", sink);
  ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();
  const std::vector<std::vector<int32_t>> docs = {RandomTokens(40, 256, 41),
                                                  RandomTokens(30, 256, 42)};
  const prune::PruneSpec half{.method = "expected_attention", .keep = 0.5};
  auto pruned = p.Inject(docs[0], "", &half);
  ASSERT_TRUE(pruned.ok()) << pruned.status().ToString();
  EXPECT_FALSE(pruned->already_held);
  EXPECT_EQ(pruned->stored_tokens, 20);  // floor(40 * 0.5), its 4 sinks among them
  auto whole = p.Inject(docs[1], "");
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(whole->stored_tokens, 30);
  auto chunk = store->Get(kvbus::SegmentKey({fp, "", kChunk}, docs[0]));
  ASSERT_TRUE(chunk.ok());
  const kvbus::ChunkInfo& info = (*chunk)->info();
  EXPECT_TRUE(info.pruned());
  EXPECT_EQ(info.tokens, 20u);
  EXPECT_EQ(info.logical(), 40u);
  for (uint32_t j = 0; j < 4; ++j) EXPECT_EQ(info.kept[j], j) << "the sinks are kept";
  // A blend reads it as a document, a prefix lookup never.
  EXPECT_TRUE(kvbus::SegmentChunkFits(**chunk, fp, 40, kdn::DType::kF32));
  EXPECT_FALSE(kvbus::ChunkFits(**chunk, fp, 20, kdn::DType::kF32));
  // Injected again with or without pruning: held, nothing computed.
  EXPECT_TRUE(p.Inject(docs[0], "")->already_held);

  PrefillJob job = BlendJobOf(docs, RandomTokens(7, 256, 43), 0.15);
  job.decode_endpoint = (*receiver)->endpoint();
  job.transfer_id = "pruned-blend";
  auto out = p.Run(job);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->blended_tokens, 70);
  EXPECT_EQ(out->pruned_tokens, 20);
  EXPECT_EQ(out->kv_tokens, 78 - 20);
  ExpectFusedKvArrived(*model, sink, job, *out, 58);
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

TEST(Prefiller, InjectRefusesABadPruneSpec) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  Prefiller p(*model, *store, kvbus::ChunkKey{1, 2}, Options());
  const auto doc = RandomTokens(30, 256, 51);
  for (const prune::PruneSpec& bad :
       {prune::PruneSpec{.method = "snapkv", .keep = 0.5},
        prune::PruneSpec{.method = "knorm", .keep = 0},
        prune::PruneSpec{.method = "knorm", .keep = 1.5},
        prune::PruneSpec{.method = "knorm", .keep = 0.5, .sinks = -1},
        prune::PruneSpec{.method = "kvzip", .keep = 0.5},  // without its prompts
        prune::PruneSpec{.method = "knorm", .keep = 0.5, .sinks = 30}}) {
    EXPECT_EQ(p.Inject(doc, "", &bad).status().code(), StatusCode::kInvalidArgument)
        << bad.method << " " << bad.keep << " " << bad.sinks;
  }
  // KVzip's repeat pass must fit the context (tiny's 2,048) beside the text.
  const prune::PruneSpec kvzip{.method = "kvzip",
                               .keep = 0.5,
                               .kvzip_first = {1, 2, 3},
                               .kvzip_next = {4, 5},
                               .kvzip_suffix = {6}};
  EXPECT_EQ(p.Inject(RandomTokens(1100, 256, 52), "", &kvzip).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Stats().chunks, 0u);
  // The key-norm method needs no query hooks: it prunes the same way.
  const prune::PruneSpec knorm{.method = "knorm", .keep = 0.25};
  auto ok = p.Inject(doc, "", &knorm);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->stored_tokens, 7);  // floor(30 * 0.25)
}

TEST(Prefiller, ADecodeWorkerThatNeverAnswersIsUnavailable) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  Prefiller p(*model, *store, kvbus::ChunkKey{1, 2}, Options());
  PrefillJob job;
  job.tokens = RandomTokens(40, 258, 7);
  job.decode_endpoint = "tcp://127.0.0.1:1";  // nobody listens there
  job.transfer_id = "r";
  auto out = p.Run(job);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::kUnavailable) << out.status().ToString();
  // Nothing is stored for a failed request, and the worker goes on.
  EXPECT_TRUE(p.StoreNewChunks().ok());
  job.decode_endpoint.clear();
  EXPECT_TRUE(p.Run(job).ok());
}

TEST(Prefiller, RefusesAnEmptyPromptAndOneBeyondTheContext) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  Prefiller p(*model, *store, kvbus::ChunkKey{1, 2}, Options());
  PrefillJob job;
  EXPECT_EQ(p.Run(job).status().code(), StatusCode::kInvalidArgument);
  job.tokens = RandomTokens(static_cast<int>(model->config().max_context) + 1, 258, 8);
  EXPECT_EQ(p.Run(job).status().code(), StatusCode::kInvalidArgument);
}

TEST(TransferRegions, FullChunksPastTheHeldOnesThenTheTailEachNamedForTheRequest) {
  auto r = kvbus::TransferRegions(3, 50, 16, 16, "t");
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].first, 16);
  EXPECT_EQ(r[0].count, 16);
  EXPECT_EQ(r[1].first, 32);
  EXPECT_EQ(r[2].first, 48);
  EXPECT_EQ(r[2].count, 2);
  // Each named by the transfer key of the request's id and its first
  // position, u64 little-endian.
  for (const kvbus::KvRegion& region : r) {
    std::string id = "t";
    for (int i = 0; i < 8; ++i)
      id += static_cast<char>(static_cast<uint64_t>(region.first) >> (8 * i));
    EXPECT_EQ(region.parent,
              kvbus::TransferKey({reinterpret_cast<const uint8_t*>(id.data()), id.size()}));
    EXPECT_EQ(region.parent, kvbus::TransferRegionKey("t", region.first));
  }
  // Whole chunks: no tail. All held, or more: nothing.
  EXPECT_EQ(kvbus::TransferRegions(3, 48, 16, 0, "t").size(), 3u);
  EXPECT_TRUE(kvbus::TransferRegions(3, 48, 16, 48, "t").empty());
  EXPECT_TRUE(kvbus::TransferRegions(3, 48, 16, 700, "t").empty());
  // One prompt pushed to two requests: no name in common, full chunks
  // included, so that neither can take the other's slices.
  const auto a = kvbus::TransferRegions(3, 50, 16, 0, "a");
  const auto b = kvbus::TransferRegions(3, 50, 16, 0, "b");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NE(a[i].parent, b[i].parent) << i;
  // No full chunks (a blended prompt's fused KV): one region.
  r = kvbus::TransferRegions(0, 50, 16, 0, "t");
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].count, 50);
}

TEST(TransferRegions, HeldTailPiecesLeaveAGapToTheNextChunkBoundary) {
  // Held up to 21 (a chunk and 5 tokens of tail pieces): the gap [21, 32),
  // then chunk 2, then the tail.
  auto r = kvbus::TransferRegions(3, 50, 16, 21, "t");
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].first, 21);
  EXPECT_EQ(r[0].count, 11);
  EXPECT_EQ(r[0].parent, kvbus::TransferRegionKey("t", 21));
  EXPECT_EQ(r[1].first, 32);
  EXPECT_EQ(r[1].count, 16);
  EXPECT_EQ(r[2].first, 48);
  EXPECT_NE(r[0].parent, r[2].parent);
  // Held inside the prompt's own tail: the rest of it.
  r = kvbus::TransferRegions(3, 50, 16, 49, "t");
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].first, 49);
  EXPECT_EQ(r[0].count, 1);
  // A gap in the last full chunk of a prompt with no tail.
  r = kvbus::TransferRegions(3, 48, 16, 40, "t");
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].first, 40);
  EXPECT_EQ(r[0].count, 8);
}

TEST(LayerSlice, KeysDifferPerLayerAndParent) {
  const kvbus::ChunkKey a{1, 2}, b{1, 3};
  EXPECT_NE(kvbus::LayerSliceKey(a, 0), kvbus::LayerSliceKey(a, 1));
  EXPECT_NE(kvbus::LayerSliceKey(a, 0), kvbus::LayerSliceKey(b, 0));
  EXPECT_NE(kvbus::LayerSliceKey(a, 0), a);
}

TEST(LayerSlice, AWholeChunkIsNotASlice) {
  auto model = MakeModel("tiny");
  engine::CpuKvCache& cache = model->kv_cache();
  engine::KvSequence seq = cache.NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, RandomTokens(16, 258, 9), {}, &logits).ok());
  auto chunk = kvbridge::ChunkFromPagedKv(cache, seq, 0, 16, {0, 1}, {0, 2}, kdn::DType::kF32);
  ASSERT_TRUE(chunk.ok());
  EXPECT_EQ(kvbridge::LayerSliceToPagedKv(**chunk, 0, cache, seq, 0).code(),
            StatusCode::kInvalidArgument);
  auto slice =
      kvbridge::LayerSliceFromPagedKv(cache, seq, 0, 16, 1, {0, 3}, {0, 2}, kdn::DType::kF32);
  ASSERT_TRUE(slice.ok());
  EXPECT_EQ((*slice)->info().layers, 1u);
  EXPECT_EQ(kvbridge::LayerSliceToPagedKv(**slice, 2, cache, seq, 0).code(),
            StatusCode::kInvalidArgument);  // tiny has 2 layers
}

TEST(HostTier, EraseDropsAnUnpinnedChunkAndKeepsAPinnedOne) {
  kvbus::HostTier tier(1u << 20);
  auto make = [](uint64_t lo) {
    kvbus::ChunkInfo info{{0, lo}, {0, 9}, 1, 1, 4, 2, kdn::DType::kF32, 0};
    return kvbus::Chunk::Make(info, std::vector<uint8_t>(info.payload_bytes(), 1)).value();
  };
  ASSERT_TRUE(tier.Put(make(1)).ok());
  ASSERT_TRUE(tier.Put(make(2)).ok());
  ASSERT_TRUE(tier.Pin({0, 2}, std::chrono::seconds(10)).ok());
  EXPECT_TRUE(tier.Erase({0, 1}));
  EXPECT_FALSE(tier.Contains({0, 1}));
  EXPECT_FALSE(tier.Erase({0, 2}));
  EXPECT_TRUE(tier.Contains({0, 2}));
  EXPECT_FALSE(tier.Erase({0, 3}));
  EXPECT_EQ(tier.Stats().bytes, make(2)->size());
}

}  // namespace
}  // namespace kdn::prefill_worker
