#include "kdn/prefill_worker/prefiller.h"

#include <gtest/gtest.h>

#include <cstring>

#include "kdn/testing/tiny_model.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/transfer_plan.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/prefix_io.h"
#include "kdn/kvbridge/paged_chunks.h"

#include "prefiller_rig.h"

namespace kdn::prefill_worker {
namespace {

using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;
using testing::GreedyFirstToken;
using testing::HostStore;
using testing::kChunk;
using testing::Options;

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
