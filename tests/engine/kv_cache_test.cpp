#include "kdn/engine/kv_cache.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <vector>

namespace kdn::engine {
namespace {

TEST(KvCache, ReservesWholeBlocksAndGivesThemBackOnDestruction) {
  CpuKvCache cache(2, 2, 8, 10);
  {
    KvSequence s = cache.NewSequence();
    ASSERT_TRUE(cache.Reserve(s, 17).ok());
    EXPECT_EQ(s.blocks().size(), 2u);
    EXPECT_EQ(cache.free_blocks(), 8);
    ASSERT_TRUE(cache.Reserve(s, 32).ok());  // still two blocks
    EXPECT_EQ(cache.free_blocks(), 8);
  }
  EXPECT_EQ(cache.free_blocks(), 10);
}

TEST(KvCache, ExhaustionIsAStatusAndChangesNothing) {
  CpuKvCache cache(1, 1, 4, 3);
  KvSequence a = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(a, 32).ok());
  KvSequence b = cache.NewSequence();
  Status st = cache.Reserve(b, 17);
  EXPECT_EQ(st.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(b.blocks().empty());
  EXPECT_EQ(cache.free_blocks(), 1);
}

TEST(KvCache, TruncateFreesBlocksPastTheNewEnd) {
  CpuKvCache cache(1, 1, 4, 8);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 64).ok());
  cache.SetLength(s, 64);
  s.Truncate(17);
  EXPECT_EQ(s.length(), 17);
  EXPECT_EQ(s.blocks().size(), 2u);
  EXPECT_EQ(cache.free_blocks(), 6);
}

TEST(KvCache, MovedSequenceOwnsItsBlocksOnce) {
  CpuKvCache cache(1, 1, 4, 4);
  KvSequence a = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(a, 20).ok());
  KvSequence b = std::move(a);
  EXPECT_TRUE(a.blocks().empty());  // NOLINT: checking the moved-from state
  EXPECT_EQ(b.blocks().size(), 2u);
  b = KvSequence();
  EXPECT_EQ(cache.free_blocks(), 4);
}

TEST(KvCache, TokenSlotsOfABlockAreContiguousTokenMajor) {
  CpuKvCache cache(2, 3, 4, 2);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 16).ok());
  EXPECT_EQ(cache.KeyAt(s, 1, 5), cache.Key(1, s.blocks()[0]) + 5 * 3 * 4);
  EXPECT_EQ(cache.block_stride(), 16 * 3 * 4);
}

TEST(KvCache, ReadGivesOneLayersKRowsThenVRowsAcrossBlocks) {
  CpuKvCache cache(2, 1, 2, 4);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 40).ok());
  for (int64_t p = 0; p < 40; ++p) {
    for (int i = 0; i < 2; ++i) {
      cache.KeyAt(s, 1, p)[i] = static_cast<float>(p * 10 + i);
      cache.ValueAt(s, 1, p)[i] = -static_cast<float>(p * 10 + i);
    }
  }
  // Positions 14..18 straddle the first two blocks.
  std::vector<uint8_t> out(cache.LayerBytes(5, DType::kF32));
  ASSERT_TRUE(cache.Read(s, 1, 14, 5, DType::kF32, out).ok());
  std::vector<float> f(out.size() / 4);
  std::memcpy(f.data(), out.data(), out.size());
  for (int64_t t = 0; t < 5; ++t) {
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(f[t * 2 + i], static_cast<float>((14 + t) * 10 + i));
      EXPECT_EQ(f[10 + t * 2 + i], -static_cast<float>((14 + t) * 10 + i));
    }
  }
}

// Bytes written at a layer's pool ranges, in order, are what Read gives
// back: the layout a transport lands a layer slice in place in.
TEST(KvCache, LayerRangesAreWhereAReadsBytesLie) {
  std::vector<uint8_t> storage(CpuKvCache::StorageBytes(3, 2, 4, 6));
  CpuKvCache cache(3, 2, 4, 6, storage.data());
  EXPECT_EQ(cache.Memory().base, storage.data());
  EXPECT_EQ(cache.Memory().bytes, storage.size());
  KvSequence hold = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(hold, 16).ok());  // so that s's blocks are not the first ones
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 48).ok());
  // Positions 10..41 of layer 2: part of s's first block, its second, part of its third.
  const int64_t first = 10, count = 32;
  std::vector<KvPoolRange> ranges;
  ASSERT_TRUE(cache.LayerRanges(s, 2, first, count, &ranges).ok());
  std::vector<uint8_t> bytes(cache.LayerBytes(count, DType::kF32));
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 3);
  uint64_t at = 0;
  for (const KvPoolRange& r : ranges) {
    ASSERT_LE(r.offset + r.bytes, storage.size());
    std::memcpy(storage.data() + r.offset, bytes.data() + at, r.bytes);
    at += r.bytes;
  }
  EXPECT_EQ(at, bytes.size());
  std::vector<uint8_t> back(bytes.size());
  ASSERT_TRUE(cache.Read(s, 2, first, count, DType::kF32, back).ok());
  EXPECT_EQ(back, bytes);
  // Nothing else of the pool changed: only s's rows of layer 2.
  std::vector<uint8_t> other(cache.LayerBytes(16, DType::kF32));
  ASSERT_TRUE(cache.Read(hold, 2, 0, 16, DType::kF32, other).ok());
  EXPECT_EQ(other, std::vector<uint8_t>(other.size(), 0));

  // Blocks in order run together: one range each for K and V.
  KvSequence t = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(t, 32).ok());
  ASSERT_TRUE(cache.LayerRanges(t, 0, 0, 32, &ranges).ok());
  if (t.blocks()[1] == t.blocks()[0] + 1) {
    EXPECT_EQ(ranges.size(), 2u);
  }

  // Refusals: past what the sequence reserved, a layer out of range, a
  // shared block, a pool that is not one region.
  EXPECT_EQ(cache.LayerRanges(s, 0, 40, 9, &ranges).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.LayerRanges(s, 3, 0, 1, &ranges).code(), StatusCode::kInvalidArgument);
  cache.SetLength(s, 48);
  cache.Publish(s, {4, 4}, 20);
  EXPECT_EQ(cache.LayerRanges(s, 0, 16, 4, &ranges).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(cache.LayerRanges(s, 0, 32, 4, &ranges).ok());
}

TEST(KvCache, WriteThenReadRoundTripsInBf16) {
  CpuKvCache cache(1, 2, 4, 4);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 30).ok());
  std::vector<float> rows(2 * 13 * 8);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = 0.25f * static_cast<float>(i) - 7.0f;
  std::vector<uint8_t> in(cache.LayerBytes(13, DType::kBF16));
  FromFloat(DType::kBF16, rows.data(), rows.size(), in.data());
  ASSERT_TRUE(cache.Write(s, 0, 9, 13, DType::kBF16, in).ok());
  EXPECT_EQ(s.length(), 0);                            // Write leaves the length to the caller
  EXPECT_EQ(cache.KeyAt(s, 0, 9)[0], rows[0]);         // exact in bf16
  EXPECT_EQ(cache.ValueAt(s, 0, 21)[7], rows.back());  // the last V row, in the second block
  std::vector<uint8_t> back(in.size());
  ASSERT_TRUE(cache.Read(s, 0, 9, 13, DType::kBF16, back).ok());
  EXPECT_EQ(back, in);
}

TEST(KvCache, LayersInOneCallAreTheLayersOneByOne) {
  CpuKvCache cache(3, 2, 4, 4);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 40).ok());
  const size_t layer = cache.LayerBytes(21, DType::kBF16);
  std::vector<float> rows(3 * layer / 2);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = 0.5f * static_cast<float>(i % 301) - 60.0f;
  std::vector<uint8_t> in(3 * layer);
  FromFloat(DType::kBF16, rows.data(), rows.size(), in.data());
  // Layers 1 and 2 in one call, from position 7 (across blocks).
  ASSERT_TRUE(cache
                  .WriteLayers(s, 1, 2, 7, 21, DType::kBF16,
                               std::span<const uint8_t>(in).subspan(layer, 2 * layer))
                  .ok());
  for (int l = 1; l < 3; ++l) {
    std::vector<uint8_t> one(layer);
    ASSERT_TRUE(cache.Read(s, l, 7, 21, DType::kBF16, one).ok());
    EXPECT_TRUE(std::equal(one.begin(), one.end(), in.begin() + l * layer)) << "layer " << l;
  }
  ASSERT_TRUE(
      cache.Write(s, 0, 7, 21, DType::kBF16, std::span<const uint8_t>(in).first(layer)).ok());
  std::vector<uint8_t> all(3 * layer);
  ASSERT_TRUE(cache.ReadLayers(s, 0, 3, 7, 21, DType::kBF16, all).ok());
  EXPECT_EQ(all, in);
  // A range past the last layer, or a buffer for another count of layers.
  EXPECT_EQ(cache.ReadLayers(s, 2, 2, 7, 21, DType::kBF16, all).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.ReadLayers(s, 0, 2, 7, 21, DType::kBF16, all).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.ReadLayers(s, 0, 0, 7, 21, DType::kBF16, {}).code(),
            StatusCode::kInvalidArgument);
}

TEST(KvCache, ReadAndWriteRefuseWhatTheSequenceDoesNotHold) {
  CpuKvCache cache(2, 1, 2, 4), other(2, 1, 2, 4);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 20).ok());  // two blocks: 32 positions
  std::vector<uint8_t> buf(cache.LayerBytes(4, DType::kF32));
  EXPECT_EQ(cache.Read(s, 0, 28, 4, DType::kF32, buf).code(), StatusCode::kOk);
  EXPECT_EQ(cache.Read(s, 0, 29, 4, DType::kF32, buf).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Read(s, 0, -1, 4, DType::kF32, buf).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Read(s, 2, 0, 4, DType::kF32, buf).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Read(s, 0, 0, 3, DType::kF32, buf).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(cache.Write(s, 0, 0, 4, DType::kBF16, buf).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(other.Write(s, 0, 0, 4, DType::kF32, buf).code(), StatusCode::kInvalidArgument);
}

// Resident KV: shared blocks, copy on write, eviction.

// Fills positions [0, n) of layer 0 and 1 with values naming the position.
void Fill(CpuKvCache& cache, KvSequence& s, int64_t from, int64_t n, float tag) {
  for (int64_t p = from; p < n; ++p) {
    for (int l = 0; l < cache.num_layers(); ++l) {
      cache.KeyAt(s, l, p)[0] = tag + static_cast<float>(p);
      cache.ValueAt(s, l, p)[0] = -tag - static_cast<float>(p);
    }
  }
  cache.SetLength(s, n);
}

TEST(KvCacheResident, AttachSharesTheBlocksAndMovesNoKv) {
  CpuKvCache cache(2, 1, 4, 8);
  KvSequence a = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(a, 40).ok());
  Fill(cache, a, 0, 40, 1000);
  cache.Publish(a, {1, 1}, 32);
  cache.Publish(a, {1, 2}, 40);
  EXPECT_TRUE(cache.IsResident({1, 2}));
  EXPECT_EQ(cache.ResidentEnd({1, 1}), 32);
  EXPECT_EQ(cache.ResidentEnd({9, 9}), -1);
  const std::vector<int32_t> blocks = a.blocks();
  a.Reset();
  // Only the index holds the three blocks: cached, and still available.
  EXPECT_EQ(cache.unused_blocks(), 5);
  EXPECT_EQ(cache.free_blocks(), 8);
  EXPECT_EQ(cache.resident_stats().cached_blocks, 3);
  EXPECT_EQ(cache.resident_stats().evictable_blocks, 3);

  KvSequence b = cache.NewSequence();
  const KvKey chain[] = {{1, 1}, {1, 2}};
  ASSERT_TRUE(cache.Attach(b, chain).ok());
  EXPECT_EQ(b.length(), 40);
  EXPECT_EQ(b.blocks(), blocks);
  EXPECT_EQ(cache.unused_blocks(), 5);  // nothing copied, nothing taken
  EXPECT_EQ(cache.resident_stats().evictable_blocks, 0);
  EXPECT_EQ(cache.KeyAt(b, 1, 39)[0], 1039.0f);
  // Not on a sequence that holds blocks; not for a key that is not there.
  EXPECT_EQ(cache.Attach(b, chain).code(), StatusCode::kFailedPrecondition);
  KvSequence c = cache.NewSequence();
  const KvKey missing[] = {{7, 7}};
  EXPECT_EQ(cache.Attach(c, missing).code(), StatusCode::kNotFound);
}

TEST(KvCacheResident, ASequenceCopiesASharedPartlyFilledBlockBeforeItGrows) {
  CpuKvCache cache(2, 1, 4, 8);
  KvSequence a = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(a, 20).ok());
  Fill(cache, a, 0, 20, 0);
  cache.Publish(a, {2, 1}, 20);
  a.Reset();
  KvSequence b = cache.NewSequence();
  const KvKey chain[] = {{2, 1}};
  ASSERT_TRUE(cache.Attach(b, chain).ok());
  const int32_t shared_last = b.blocks()[1];
  // The shared block takes no write.
  std::vector<uint8_t> row(cache.LayerBytes(1, DType::kF32));
  EXPECT_EQ(cache.Write(b, 0, 20, 1, DType::kF32, row).code(), StatusCode::kFailedPrecondition);
  // Growing copies it (one block) and takes one more for positions 32..35.
  ASSERT_TRUE(cache.Reserve(b, 36).ok());
  EXPECT_NE(b.blocks()[1], shared_last);
  EXPECT_EQ(b.blocks().size(), 3u);
  EXPECT_EQ(cache.resident_stats().copied_blocks, 1u);
  EXPECT_EQ(cache.KeyAt(b, 1, 19)[0], 19.0f);  // the copy holds the shared KV
  Fill(cache, b, 20, 36, 500);
  // The resident entry never changed.
  KvSequence c = cache.NewSequence();
  ASSERT_TRUE(cache.Attach(c, chain).ok());
  EXPECT_EQ(c.blocks()[1], shared_last);
  EXPECT_EQ(cache.KeyAt(c, 0, 19)[0], 19.0f);
  EXPECT_EQ(cache.KeyAt(c, 0, 20)[0], 0.0f);  // never written there
  EXPECT_EQ(cache.KeyAt(b, 0, 20)[0], 520.0f);
  // A sequence that grows from a whole block shares nothing it writes.
  KvSequence d = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(d, 16).ok());
  Fill(cache, d, 0, 16, 0);
  cache.Publish(d, {3, 1}, 16);
  ASSERT_TRUE(cache.Reserve(d, 17).ok());
  EXPECT_EQ(cache.resident_stats().copied_blocks, 1u);
}

TEST(KvCacheResident, EvictionDropsTheLeastRecentlyUsedDeepestEntriesFirst) {
  CpuKvCache cache(1, 1, 4, 6);
  // Conversation x: 3 blocks under chain x1 (16), x2 (32), x3 (48).
  KvSequence x = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(x, 48).ok());
  Fill(cache, x, 0, 48, 0);
  for (uint64_t i = 3; i >= 1; --i) cache.Publish(x, {10, i}, static_cast<int64_t>(16 * i));
  x.Reset();
  // Conversation y: 2 blocks, used after x.
  KvSequence y = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(y, 32).ok());
  Fill(cache, y, 0, 32, 100);
  cache.Publish(y, {20, 2}, 32);
  cache.Publish(y, {20, 1}, 16);
  y.Reset();
  EXPECT_EQ(cache.unused_blocks(), 1);
  EXPECT_EQ(cache.free_blocks(), 6);
  // Three blocks needed, one unused: x's deepest entry goes first (x3
  // frees one block), then x2; x1 and y stay.
  KvSequence z = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(z, 48).ok());
  EXPECT_FALSE(cache.IsResident({10, 3}));
  EXPECT_FALSE(cache.IsResident({10, 2}));
  EXPECT_TRUE(cache.IsResident({10, 1}));
  EXPECT_TRUE(cache.IsResident({20, 2}));
  EXPECT_EQ(cache.resident_stats().evictions, 2u);
  // A block a sequence holds is never taken: with y attached, asking for
  // every block fails and y's KV is intact.
  KvSequence y2 = cache.NewSequence();
  const KvKey ychain[] = {{20, 1}, {20, 2}};
  ASSERT_TRUE(cache.Attach(y2, ychain).ok());
  KvSequence w = cache.NewSequence();
  const uint64_t evictions = cache.resident_stats().evictions;
  EXPECT_EQ(cache.Reserve(w, 6 * 16).code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(w.blocks().empty());
  EXPECT_EQ(cache.resident_stats().evictions, evictions);  // nothing dropped for a refusal
  EXPECT_TRUE(cache.IsResident({10, 1}));
  EXPECT_EQ(cache.KeyAt(y2, 0, 31)[0], 131.0f);
  // Everything given back: no reference leaks.
  z.Reset();
  y2.Reset();
  cache.DropResident();
  EXPECT_EQ(cache.unused_blocks(), 6);
  const ResidentStats st = cache.resident_stats();
  EXPECT_EQ(st.entries, 0);
  EXPECT_EQ(st.cached_blocks, 0);
  EXPECT_EQ(st.evictable_blocks, 0);
}

TEST(KvCacheResident, PublishingAKeyAgainOnlyTouchesIt) {
  CpuKvCache cache(1, 1, 4, 4);
  KvSequence a = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(a, 16).ok());
  Fill(cache, a, 0, 16, 0);
  cache.Publish(a, {5, 5}, 16);
  KvSequence b = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(b, 16).ok());
  Fill(cache, b, 0, 16, 50);
  cache.Publish(b, {5, 5}, 16);  // the first stays
  a.Reset();
  b.Reset();
  EXPECT_EQ(cache.resident_stats().cached_blocks, 1);
  EXPECT_EQ(cache.unused_blocks(), 3);
}

// Keeps (pins): held entries are neither evicted nor counted free.

// Publishes `key` over `blocks` new blocks' worth of tokens, then lets the
// sequence go, so that only the index (and a keep) holds them.
void PublishAlone(CpuKvCache& cache, KvKey key, int blocks) {
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, blocks * kKvBlockTokens).ok());
  Fill(cache, s, 0, blocks * kKvBlockTokens, 0);
  cache.Publish(s, key, blocks * kKvBlockTokens);
}

using std::chrono::milliseconds;
const KvCache::TimePoint kT0 = KvCache::TimePoint() + std::chrono::hours(1);

TEST(KvCacheKeep, AKeepBeforeTheKvHoldsItFromItsPublishingUntilTheDeadline) {
  CpuKvCache cache(2, 1, 4, 8);
  const KvKey key{3, 1};
  EXPECT_EQ(cache.Keep({&key, 1}, milliseconds(60000), kT0), 1u);
  PublishAlone(cache, key, 2);
  ResidentStats st = cache.resident_stats();
  EXPECT_EQ(st.kept_entries, 1);
  EXPECT_EQ(st.kept_blocks, 2);
  EXPECT_EQ(st.evictable_blocks, 0);
  EXPECT_EQ(cache.free_blocks(), 6);  // not counted free
  // The pool's every other block is taken, and the held entry stays.
  KvSequence big = cache.NewSequence();
  EXPECT_EQ(cache.Reserve(big, 7 * kKvBlockTokens).code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(cache.Reserve(big, 6 * kKvBlockTokens).ok());
  EXPECT_TRUE(cache.IsResident(key));
  big.Reset();
  cache.ApplyKeeps(kT0 + milliseconds(59999));
  EXPECT_EQ(cache.resident_stats().kept_blocks, 2);
  cache.ApplyKeeps(kT0 + milliseconds(60000));  // the deadline: let go
  st = cache.resident_stats();
  EXPECT_EQ(st.kept_entries, 0);
  EXPECT_EQ(st.kept_blocks, 0);
  EXPECT_EQ(st.evictable_blocks, 2);
  EXPECT_EQ(cache.free_blocks(), 8);
  ASSERT_TRUE(cache.Reserve(big, 8 * kKvBlockTokens).ok());  // evicts it now
  EXPECT_FALSE(cache.IsResident(key));
}

TEST(KvCacheKeep, AKeepOfResidentKvTakesEffectAtApplyKeepsAndAZeroLeaseLetsGo) {
  CpuKvCache cache(2, 1, 4, 8);
  const KvKey key{3, 2};
  PublishAlone(cache, key, 3);
  EXPECT_EQ(cache.Keep({&key, 1}, milliseconds(1000), kT0), 1u);
  EXPECT_EQ(cache.free_blocks(), 8);  // the engine's thread has not applied it
  cache.ApplyKeeps(kT0);
  EXPECT_EQ(cache.free_blocks(), 5);
  // Kept again with a shorter lease: the later deadline stays.
  EXPECT_EQ(cache.Keep({&key, 1}, milliseconds(10), kT0), 1u);
  cache.ApplyKeeps(kT0 + milliseconds(500));
  EXPECT_EQ(cache.resident_stats().kept_blocks, 3);
  EXPECT_EQ(cache.Keep({&key, 1}, milliseconds(0), kT0), 0u);
  cache.ApplyKeeps(kT0 + milliseconds(500));
  EXPECT_EQ(cache.resident_stats().kept_blocks, 0);
  EXPECT_EQ(cache.free_blocks(), 8);
  // Let go, the key is not held again when published anew.
  cache.DropResident();
  PublishAlone(cache, key, 1);
  EXPECT_EQ(cache.resident_stats().kept_entries, 0);
}

TEST(KvCacheKeep, EvictionPassesOverHeldEntriesEvenWhenLeastRecentlyUsed) {
  CpuKvCache cache(2, 1, 4, 8);
  const KvKey kept{5, 1}, other{5, 2};
  EXPECT_EQ(cache.Keep({&kept, 1}, milliseconds(60000), kT0), 1u);
  PublishAlone(cache, kept, 2);   // least recently used
  PublishAlone(cache, other, 2);  // more recent
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 6 * kKvBlockTokens).ok());
  EXPECT_TRUE(cache.IsResident(kept));
  EXPECT_FALSE(cache.IsResident(other));
  EXPECT_EQ(cache.resident_stats().evictions, 1u);
}

TEST(KvCacheKeep, HeldBlocksStayWithinHalfThePoolAndAWaitingKeepIsHeldOnceThereIsRoom) {
  CpuKvCache cache(2, 1, 4, 8);
  ASSERT_EQ(cache.keep_limit_blocks(), 4);
  // b comes before a in key order, so that one ApplyKeeps must go past a's
  // release to hold b.
  const KvKey a{6, 2}, b{6, 1};
  PublishAlone(cache, a, 3);
  PublishAlone(cache, b, 3);
  EXPECT_EQ(cache.Keep({&a, 1}, milliseconds(60000), kT0), 1u);
  cache.ApplyKeeps(kT0);
  EXPECT_EQ(cache.Keep({&b, 1}, milliseconds(60000), kT0), 1u);
  cache.ApplyKeeps(kT0);
  ResidentStats st = cache.resident_stats();
  EXPECT_EQ(st.kept_entries, 1);  // 6 blocks would pass the bound of 4
  EXPECT_EQ(st.kept_blocks, 3);
  EXPECT_EQ(cache.free_blocks(), 5);
  // Letting the first go makes room for the second, in the same call.
  EXPECT_EQ(cache.Keep({&a, 1}, milliseconds(0), kT0), 0u);
  cache.ApplyKeeps(kT0);
  st = cache.resident_stats();
  EXPECT_EQ(st.kept_entries, 1);
  EXPECT_EQ(st.kept_blocks, 3);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 5 * kKvBlockTokens).ok());
  EXPECT_FALSE(cache.IsResident(a));
  EXPECT_TRUE(cache.IsResident(b));
}

TEST(KvCacheKeep, AChainsEntriesShareTheirBlocksInTheCount) {
  CpuKvCache cache(2, 1, 4, 8);
  KvSequence s = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(s, 40).ok());
  Fill(cache, s, 0, 40, 0);
  const KvKey chain[] = {{7, 1}, {7, 2}};
  EXPECT_EQ(cache.Keep(chain, milliseconds(60000), kT0), 2u);
  cache.Publish(s, chain[1], 40);
  cache.Publish(s, chain[0], 32);
  s.Reset();
  const ResidentStats st = cache.resident_stats();
  EXPECT_EQ(st.kept_entries, 2);
  EXPECT_EQ(st.kept_blocks, 3);
  EXPECT_EQ(cache.free_blocks(), 5);
  // An attach of a held entry copies its shared last block before writing.
  KvSequence t = cache.NewSequence();
  ASSERT_TRUE(cache.Attach(t, chain).ok());
  ASSERT_TRUE(cache.Reserve(t, 41).ok());
  EXPECT_EQ(cache.resident_stats().copied_blocks, 1u);
  EXPECT_EQ(cache.resident_stats().kept_blocks, 3);
  EXPECT_EQ(cache.free_blocks(), 4);  // the copy is t's; the kept three are not free
}

TEST(KvCacheKeep, ALeaseBeyondTheClockKeepsUntilLetGo) {
  CpuKvCache cache(2, 1, 4, 8);
  const KvKey key{9, 9};
  EXPECT_EQ(cache.Keep({&key, 1}, milliseconds::max(), kT0), 1u);
  PublishAlone(cache, key, 1);
  cache.ApplyKeeps(kT0 + std::chrono::hours(24 * 365 * 100));
  EXPECT_EQ(cache.resident_stats().kept_blocks, 1);
  EXPECT_EQ(cache.Keep({&key, 1}, milliseconds(0), kT0), 0u);
  cache.ApplyKeeps(kT0);
  EXPECT_EQ(cache.resident_stats().kept_blocks, 0);
}

TEST(KvCacheKeep, KeysPastTheBoundAreRefusedWhole) {
  CpuKvCache cache(1, 1, 4, 2);
  std::vector<KvKey> keys(KvCache::kMaxKeptKeys);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = {8, i};
  EXPECT_EQ(cache.Keep(keys, milliseconds(1000), kT0), keys.size());
  const KvKey one_more{9, 0};
  EXPECT_EQ(cache.Keep({&one_more, 1}, milliseconds(1000), kT0), 0u);
  EXPECT_EQ(cache.Keep({&keys[0], 1}, milliseconds(5000), kT0), 1u);  // not a new key
  const KvKey twice[] = {one_more, one_more};
  EXPECT_EQ(cache.Keep(twice, milliseconds(1000), kT0), 0u);  // one new key: still past it
  cache.ApplyKeeps(kT0 + milliseconds(1000));                 // all but one lapse
  EXPECT_EQ(cache.Keep({&one_more, 1}, milliseconds(1000), kT0), 1u);
}

}  // namespace
}  // namespace kdn::engine
