// SliceLanding (kdn/decode_worker/slice_landing.h) and the Decoder with it:
// pushed layer slices land in the request's own KV blocks, and Start copies
// nothing (docs/kvbus.md, "Landing in place").

#include "kdn/decode_worker/slice_landing.h"

#include <gtest/gtest.h>

#include <cstring>

#include "decoder_rig.h"

namespace kdn::decode_worker {
namespace {

using namespace testing;  // NOLINT: the rig's helpers, decoder_rig.h

kvbus::ChunkInfo SliceInfo(uint64_t key, uint32_t tokens, int64_t position) {
  return {.key = kvbus::ChunkKey{9, key},
          .model_fingerprint = kFingerprint,
          .layers = 1,
          .kv_heads = 2,
          .head_dim = 4,
          .tokens = tokens,
          .dtype = kdn::DType::kF32,
          .position = position};
}

ExpectedSlice Slice(uint64_t key, uint64_t offset) {
  const kvbus::ChunkInfo info = SliceInfo(key, 16, 32);
  return {info, {{offset, info.payload_bytes() / 2}, {offset + 4096, info.payload_bytes() / 2}}};
}

TEST(SliceLanding, EachRequestExpectingAKeyGetsAClaimOfItsOwnInOrder) {
  SliceLanding site;
  site.Expect(1, {Slice(5, 0)});
  site.Expect(2, {Slice(5, 8192)});
  const uint64_t payload = SliceInfo(5, 16, 32).payload_bytes();
  EXPECT_FALSE(site.Claim(kvbus::ChunkKey{9, 6}, payload)) << "a key nobody expects";
  EXPECT_FALSE(site.Claim(kvbus::ChunkKey{9, 5}, payload + 4)) << "another size";
  auto a = site.Claim(kvbus::ChunkKey{9, 5}, payload);
  auto b = site.Claim(kvbus::ChunkKey{9, 5}, payload);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->extents[0].offset, 0u);
  EXPECT_EQ(b->extents[0].offset, 8192u);
  EXPECT_FALSE(site.Claim(kvbus::ChunkKey{9, 5}, payload)) << "both claimed";
  EXPECT_TRUE(site.Landed(a->ticket, SliceInfo(5, 16, 32)).ok());
  // Another position than request 2 expects: refused, and its blocks unsafe.
  EXPECT_EQ(site.Landed(b->ticket, SliceInfo(5, 16, 48)).code(), StatusCode::kCorruption);
  EXPECT_EQ(site.Stats().landed, 1u);
  EXPECT_EQ(site.Stats().refused, 1u);
  const SliceLanding::Settled one = site.Forget(1);
  EXPECT_EQ(one.landed.count(kvbus::ChunkKey{9, 5}), 1u);
  EXPECT_FALSE(one.unsafe);
  EXPECT_TRUE(site.Forget(2).unsafe);
  EXPECT_EQ(site.Stats().expected_now, 0u);
  // A claim settled after its request left is refused.
  site.Expect(3, {Slice(7, 0)});
  auto c = site.Claim(kvbus::ChunkKey{9, 7}, payload);
  ASSERT_TRUE(c);
  EXPECT_TRUE(site.Forget(3).unsafe) << "claimed, not landed";
  EXPECT_EQ(site.Landed(c->ticket, SliceInfo(7, 16, 32)).code(), StatusCode::kFailedPrecondition);
}

// Plays the prefill worker and the kvbus receiver: lands every slice the
// Decoder expects straight in its pool through `site`. Returns the first
// token.
int32_t PushInPlace(Rig& rig, SliceLanding& site, const DecodeRequest& r, int64_t held_tokens) {
  uint8_t* pool = rig.model->kv_cache().Memory().base;
  return PushSlices(rig, r, held_tokens, [&](std::shared_ptr<const kvbus::Chunk> slice) {
    auto claim = site.Claim(slice->key(), slice->payload().size());
    EXPECT_TRUE(claim) << "slice at " << slice->info().position << " of " << slice->info().tokens
                       << " tokens not expected";
    if (!claim) return;
    const uint8_t* from = slice->payload().data();
    for (const kvbus::Extent& x : claim->extents) {
      std::memcpy(pool + x.offset, from, x.bytes);
      from += x.bytes;
    }
    EXPECT_TRUE(site.Landed(claim->ticket, slice->info()).ok());
  });
}

struct LandingRig {
  SliceLanding site;
  std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now();
  Rig rig;
  LandingRig() : rig(std::make_unique<GatedStore>(), {}, Options()) {}
  DecoderOptions Options() {
    DecoderOptions o;
    o.landing = &site;
    o.landing_quarantine = std::chrono::seconds(30);
    o.clock = [this] { return now; };
    return o;
  }
};

TEST(DecoderLanding, PushedSlicesLandInTheBlocksAndStartCopiesNothing) {
  LandingRig lr;
  Rig& rig = lr.rig;
  Transcript t;
  const std::vector<DecodeRequest> reqs = {Request(RandomTokens(40, 256, 21), 10),
                                           Request(RandomTokens(7, 256, 22), 6)};
  for (const DecodeRequest& r : reqs) {
    const uint64_t id = PrepareAndLoad(rig, r, t);
    EXPECT_GT(lr.site.Stats().expected_now, 0u) << "registered when the load is in";
    Start(rig, id, PushInPlace(rig, lr.site, r, t.held[id]), t);
  }
  RunToEnd(rig, t);
  uint64_t id = 1;
  for (const DecodeRequest& r : reqs) EXPECT_EQ(t.tokens[id++], Alone(*rig.model, r));
  const DecoderStats s = rig.decoder->Stats();
  // 40 tokens: two full chunks and a tail of 8; 7 tokens: a tail. Two layers.
  EXPECT_EQ(s.slices_landed, (3u + 1u) * 2u);
  EXPECT_EQ(s.start_copy_bytes, 0u);
  EXPECT_EQ(rig.staging.Stats().chunks, 0u);
  EXPECT_EQ(lr.site.Stats().expected_now, 0u);
}

// Two requests with one prefix prepared at once, their pushes coming in the
// other order (the prefill worker took the second first): each slice lands
// in the blocks of the request it was pushed for, and each starts on its own
// slices. (Named by content, the second request's push was claimed by the
// first registration, and the second request found its prefix missing.)
TEST(DecoderLanding, RequestsWithOnePrefixStartOnTheirOwnSlicesWhateverTheOrderOfTheirPushes) {
  LandingRig lr;
  Rig& rig = lr.rig;
  Transcript t;
  std::vector<int32_t> prefix = RandomTokens(2 * kChunk, 256, 24);
  std::vector<DecodeRequest> reqs;
  for (int i = 0; i < 2; ++i) {
    std::vector<int32_t> prompt = prefix;
    for (int32_t x : RandomTokens(5, 256, 25 + i)) prompt.push_back(x);
    reqs.push_back(Request(std::move(prompt), 6));
  }
  const uint64_t first = PrepareAndLoad(rig, reqs[0], t);
  const uint64_t second = PrepareAndLoad(rig, reqs[1], t);
  ASSERT_EQ(t.held[second], 0) << "nothing of the prefix is held: both are pushed it";
  Start(rig, second, PushInPlace(rig, lr.site, reqs[1], t.held[second]), t);
  Start(rig, first, PushInPlace(rig, lr.site, reqs[0], t.held[first]), t);
  RunToEnd(rig, t);
  EXPECT_TRUE(t.error[first].ok()) << t.error[first].ToString();
  EXPECT_TRUE(t.error[second].ok()) << t.error[second].ToString();
  EXPECT_EQ(t.tokens[first], Alone(*rig.model, reqs[0]));
  EXPECT_EQ(t.tokens[second], Alone(*rig.model, reqs[1]));
  EXPECT_EQ(rig.decoder->Stats().start_copy_bytes, 0u);
  EXPECT_EQ(lr.site.Stats().expected_now, 0u);
}

TEST(DecoderLanding, ASliceThatDidNotLandInPlaceIsCopiedFromStaging) {
  LandingRig lr;
  Rig& rig = lr.rig;
  Transcript t;
  const DecodeRequest r = Request(RandomTokens(20, 256, 23), 5);
  const uint64_t id = PrepareAndLoad(rig, r, t);
  // The receiver put these in the sink (staging) instead: say, the site
  // was not asked.
  const int32_t first = PushPrompt(rig, r, t.held[id]);
  Start(rig, id, first, t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[id], Alone(*rig.model, r));
  EXPECT_GT(rig.decoder->Stats().start_copy_bytes, 0u);
}

TEST(DecoderLanding, BlocksAPushMayStillWriteAreHeldBackForALease) {
  LandingRig lr;
  Rig& rig = lr.rig;
  Transcript t;
  const DecodeRequest r = Request(RandomTokens(40, 256, 24), 5);
  const uint64_t id = PrepareAndLoad(rig, r, t);
  const int all = rig.num_blocks();
  // A sender was granted one slice, then the router cancelled the request.
  const kvbus::ChunkKey key = kvbus::LayerSliceKey(kvbus::TransferRegionKey(r.transfer_id, 0), 0);
  auto claim = lr.site.Claim(key, uint64_t{16} * rig.model->kv_cache().token_stride() * 2 * 4);
  ASSERT_TRUE(claim);
  DecoderOutput out;
  ASSERT_TRUE(rig.decoder->Cancel(id, &out).ok());
  EXPECT_LT(rig.free_blocks(), all) << "held back";
  EXPECT_GT(rig.decoder->Stats().quarantined_blocks, 0);
  lr.now += std::chrono::seconds(31);
  out = {};
  rig.decoder->Advance(&out);
  EXPECT_EQ(rig.free_blocks(), all);
  EXPECT_EQ(rig.decoder->Stats().quarantined_blocks, 0);
  // A request cancelled before any claim gives its blocks back at once.
  const uint64_t id2 = PrepareAndLoad(rig, r, t);
  ASSERT_TRUE(rig.decoder->Cancel(id2, &out).ok());
  EXPECT_EQ(rig.free_blocks(), all);
}

}  // namespace
}  // namespace kdn::decode_worker
