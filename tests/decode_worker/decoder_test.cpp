#include "kdn/decode_worker/decoder.h"

#include <gtest/gtest.h>

#include <random>

#include "decoder_rig.h"
#include "kdn/kvbridge/head_pruned.h"
#include "kdn/prune/prune.h"

namespace kdn::decode_worker {
namespace {

using namespace testing;  // NOLINT: the rig's helpers, decoder_rig.h

TEST(Decoder, DecodesTheTokensTheEngineGeneratesAloneWhateverJoinsTheBatch) {
  Rig rig;
  std::vector<DecodeRequest> reqs = {
      Request(RandomTokens(5, 256, 1), 12),
      Request(RandomTokens(40, 256, 2), 20),
      Request(RandomTokens(70, 256, 3), 9,
              {.temperature = 0.8f, .top_k = 40, .top_p = 0.9f, .seed = 11}),
  };
  Transcript t;
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < reqs.size(); ++i) {
    // Each joins a batch that is already running.
    const uint64_t id = PrepareAndLoad(rig, reqs[i], t);
    ids.push_back(id);
    EXPECT_EQ(t.held[id], 0);  // the store is empty
    Start(rig, id, PushPrompt(rig, reqs[i], t.held[id]), t);
    DecoderOutput out;
    rig.decoder->Advance(&out);
    t.Add(out);
  }
  RunToEnd(rig, t);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(t.tokens[ids[i]], Alone(*rig.model, reqs[i])) << "request " << i;
    EXPECT_EQ(t.finish[ids[i]], "length");
    EXPECT_TRUE(t.error[ids[i]].ok());
  }
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
  EXPECT_EQ(rig.staging.Stats().chunks, 0u) << "each slice is erased once taken";
}

TEST(Decoder, PrepareReservesTheRequestsBlocksAndRefusesBadRequests) {
  Rig rig;
  const int all = rig.num_blocks();
  DecoderOutput out;
  auto id = rig.decoder->Prepare(Request(RandomTokens(40, 256, 1), 8), &out);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(rig.free_blocks(), all - 3);  // 40 + 8 tokens in blocks of 16
  EXPECT_EQ(rig.decoder->Stats().prepared, 1);

  const auto refused = [&](DecodeRequest r) {
    DecoderOutput o;
    auto got = rig.decoder->Prepare(std::move(r), &o);
    EXPECT_TRUE(o.empty());
    return got.ok() ? StatusCode::kOk : got.status().code();
  };
  EXPECT_EQ(refused(Request({}, 8)), StatusCode::kInvalidArgument);
  EXPECT_EQ(refused(Request(RandomTokens(2048, 256, 2), 8)), StatusCode::kInvalidArgument);
  EXPECT_EQ(refused(Request({1, 2, 258}, 8)), StatusCode::kInvalidArgument);
  EXPECT_EQ(refused(Request({1, 2, -1}, 8)), StatusCode::kInvalidArgument);
  EXPECT_EQ(refused(Request({1, 2, 3}, 0)), StatusCode::kInvalidArgument);
  EXPECT_EQ(refused(Request({1, 2, 3}, 8, {.top_p = 0.0f})), StatusCode::kInvalidArgument);
  EXPECT_EQ(rig.free_blocks(), all - 3);
  EXPECT_EQ(rig.decoder->Stats().prepared, 1);
}

TEST(Decoder, PrepareRefusesAPromptTheFreeBlocksCannotHoldUntilBlocksAreFree) {
  Rig rig(std::make_unique<GatedStore>(), {.kv_blocks = 6});
  Transcript t;
  const uint64_t a = PrepareAndLoad(rig, Request(RandomTokens(64, 256, 1), 8), t);
  EXPECT_EQ(rig.free_blocks(), 1);  // 64 + 8 tokens: 5 blocks
  DecoderOutput out;
  auto b = rig.decoder->Prepare(Request(RandomTokens(40, 256, 2), 8), &out);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(rig.free_blocks(), 1);
  ASSERT_TRUE(rig.decoder->Cancel(a, &out).ok());
  EXPECT_EQ(rig.free_blocks(), 6);
  EXPECT_TRUE(rig.decoder->Prepare(Request(RandomTokens(40, 256, 2), 8), &out).ok());
}

TEST(Decoder, CancelEndsPreparedLoadingAndRunningRequestsAndFreesTheirBlocks) {
  Rig rig;
  const int all = rig.num_blocks();
  Transcript t;
  const uint64_t prepared = PrepareAndLoad(rig, Request(RandomTokens(20, 256, 1), 8), t);
  const DecodeRequest rr = Request(RandomTokens(20, 256, 2), 50);
  const uint64_t running = PrepareAndStart(rig, rr, t);
  // A third whose load is held inside the store.
  rig.gated().CloseGets();
  DecoderOutput out;
  auto loading = rig.decoder->Prepare(Request(RandomTokens(40, 256, 3), 8), &out);
  ASSERT_TRUE(loading.ok());
  EXPECT_TRUE(out.prepared.empty());
  EXPECT_LT(rig.free_blocks(), all);

  for (uint64_t id : {prepared, running, *loading}) {
    out = {};
    ASSERT_TRUE(rig.decoder->Cancel(id, &out).ok());
    t.Add(out);
    EXPECT_EQ(t.finish[id], "cancelled");
    EXPECT_EQ(rig.decoder->Cancel(id, &out).code(), StatusCode::kNotFound);
    EXPECT_EQ(rig.decoder->Start(id, 1, false, &out).code(), StatusCode::kNotFound);
  }
  EXPECT_EQ(rig.free_blocks(), all);  // the load is still out
  rig.gated().OpenAll();
  rig.io.Drain();
  out = {};
  rig.decoder->Advance(&out);
  EXPECT_TRUE(out.empty()) << "a cancelled request's load is dropped";
  EXPECT_EQ(rig.free_blocks(), all);
  EXPECT_EQ(rig.decoder->Stats().prepared + rig.decoder->Stats().running, 0);
}

TEST(Decoder, AFinishedConversationsChunksReachTheStoreAndServeTheNextTurn) {
  // The store's path: nothing kept resident in the pool.
  DecoderOptions o;
  o.resident = false;
  Rig rig(std::make_unique<GatedStore>(), {}, o);
  auto& store = rig.gated().inner();
  // Turn 1: 40 prompt tokens and 30 generated: KV for 69 tokens, 4 full
  // chunks and a tail of 5 (pieces of 1 and 4 tokens).
  const DecodeRequest turn1 = Request(RandomTokens(40, 256, 1), 30);
  Transcript t;
  const uint64_t a = RunWhole(rig, turn1, t);
  ASSERT_EQ(t.tokens[a].size(), 30u);
  std::vector<int32_t> conversation = turn1.tokens;
  conversation.insert(conversation.end(), t.tokens[a].begin(), t.tokens[a].end());
  const kvbus::KeyContext ctx{kFingerprint, "", kChunk};
  const std::vector<int32_t> with_kv(conversation.begin(), conversation.begin() + 69);
  const auto keys = kvbus::PrefixKeys(ctx, with_kv);
  ASSERT_EQ(keys.size(), 4u);  // the 4 chunks cover 64 of the 69 with KV
  const auto tail = kvbus::TailSpans(ctx, with_kv, keys);
  ASSERT_EQ(tail.size(), 2u);
  std::vector<kvbus::ChunkKey> stored_keys = keys;
  for (const kvbus::KeyedSpan& s : tail) stored_keys.push_back(s.key);
  EXPECT_EQ(store.PutOrder(), stored_keys);
  EXPECT_EQ(rig.decoder->Stats().chunks_stored, 6u);
  EXPECT_EQ(rig.decoder->Stats().store_bytes_pending, 0u);

  // The stored KV is what a prefill of those tokens computes.
  {
    engine::KvSequence seq = rig.model->kv_cache().NewSequence();
    std::vector<float> logits;
    ASSERT_TRUE(rig.model->Prefill(seq, with_kv, {}, &logits).ok());
    std::vector<kvbus::KeyedSpan> spans;
    for (size_t i = 0; i < keys.size(); ++i) {
      spans.push_back({keys[i], static_cast<int64_t>(i) * kChunk, kChunk});
    }
    spans.insert(spans.end(), tail.begin(), tail.end());
    for (size_t i = 0; i < spans.size(); ++i) {
      auto stored = store.Get(spans[i].key);
      ASSERT_TRUE(stored.ok());
      auto expect =
          kvbridge::ChunkFromPagedKv(rig.model->kv_cache(), seq, spans[i].first, spans[i].count,
                                     spans[i].key, kFingerprint, kdn::DType::kF32);
      ASSERT_TRUE(expect.ok());
      const auto got = (*stored)->payload();
      const auto want = (*expect)->payload();
      ASSERT_EQ(got.size(), want.size());
      EXPECT_LT(kdn::testing::RelError(reinterpret_cast<const float*>(got.data()),
                                       reinterpret_cast<const float*>(want.data()),
                                       got.size() / sizeof(float)),
                1e-4)
          << "chunk " << i;
    }
  }

  // Turn 2 continues the conversation: its first 69 tokens come from the
  // store (4 chunks and the 2 tail pieces), down to the last token with KV.
  std::vector<int32_t> prompt2 = conversation;
  const auto more = RandomTokens(10, 256, 9);
  prompt2.insert(prompt2.end(), more.begin(), more.end());
  const DecodeRequest turn2 = Request(prompt2, 12);
  const uint64_t b = PrepareAndLoad(rig, turn2, t);
  EXPECT_EQ(t.held[b], 69);
  EXPECT_EQ(rig.decoder->Stats().chunks_loaded, 6u);
  Start(rig, b, PushPrompt(rig, turn2, t.held[b]), t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[b], Alone(*rig.model, turn2));
  rig.io.Drain();
  // 80 + 11 tokens with KV: 5 full chunks, of which only the last is new
  // (the 4 loaded were not handed over again), and a tail of 11 (pieces of
  // 1, 8 and 2 tokens).
  EXPECT_EQ(store.PutOrder().size(), 6u + 4u);
  EXPECT_EQ(rig.decoder->Stats().chunks_stored, 10u);
  EXPECT_EQ(rig.decoder->Stats().chunks_already_held, 0u);
}

TEST(Decoder, AFinishedConversationStaysResidentAndItsNextTurnAttachesIt) {
  Rig rig;
  auto& store = rig.gated().inner();
  const DecodeRequest turn1 = Request(RandomTokens(40, 256, 1), 30);
  Transcript t;
  const uint64_t a = RunWhole(rig, turn1, t);
  EXPECT_EQ(store.PutOrder().size(), 6u);  // still stored to the KDN
  // Its blocks are back, and cached: counted free, held only by the index.
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
  const engine::ResidentStats cached = rig.decoder->Stats().resident;
  EXPECT_EQ(cached.cached_blocks, 5);  // 69 tokens with KV
  EXPECT_EQ(cached.evictable_blocks, 5);

  // Turn 2: the 69 tokens with KV are attached, none loaded, none copied
  // but the shared last block; the answer is the engine's alone.
  std::vector<int32_t> prompt2 = turn1.tokens;
  prompt2.insert(prompt2.end(), t.tokens[a].begin(), t.tokens[a].end());
  const auto more = RandomTokens(10, 256, 9);
  prompt2.insert(prompt2.end(), more.begin(), more.end());
  const DecodeRequest turn2 = Request(prompt2, 12);
  const uint64_t b = PrepareAndLoad(rig, turn2, t);
  EXPECT_EQ(t.held[b], 69);
  DecoderStats s = rig.decoder->Stats();
  EXPECT_EQ(s.resident_hit_tokens, 69u);
  EXPECT_EQ(s.chunks_loaded, 0u);
  EXPECT_EQ(s.kv_bytes_loaded, 0u);
  EXPECT_EQ(s.resident.copied_blocks, 1u);  // 69 = 4 blocks and 5 tokens of a shared fifth
  Start(rig, b, PushPrompt(rig, turn2, t.held[b]), t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[b], Alone(*rig.model, turn2));

  // The same prompt once more: the pool holds all of it (turn 2 left its
  // conversation resident), so Prepare is done at once, with no load.
  const DecodeRequest again = Request(prompt2, 4);
  DecoderOutput out;
  auto c = rig.decoder->Prepare(again, &out);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(out.prepared.size(), 1u);
  EXPECT_EQ(out.prepared[0].held_tokens, static_cast<int64_t>(prompt2.size()));
  EXPECT_EQ(out.prepared[0].resident_tokens, static_cast<int64_t>(prompt2.size()));
  t.Add(out);
  Start(rig, *c, PushPrompt(rig, again, t.held[*c]), t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[*c], Alone(*rig.model, again));
  rig.io.Drain();
  // No reference leaked: every block free or cached and unreferenced.
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
  s = rig.decoder->Stats();
  EXPECT_EQ(s.resident.evictable_blocks, s.resident.cached_blocks);
}

TEST(Decoder, ACancelledOrFailedRequestGivesBackItsResidentReferences) {
  Rig rig;
  const DecodeRequest turn1 = Request(RandomTokens(40, 256, 1), 30);
  Transcript t;
  const uint64_t a = RunWhole(rig, turn1, t);
  std::vector<int32_t> prompt2 = turn1.tokens;
  prompt2.insert(prompt2.end(), t.tokens[a].begin(), t.tokens[a].end());
  prompt2.push_back(7);
  // Prepared on the resident conversation, then cancelled before Start.
  const uint64_t b = PrepareAndLoad(rig, Request(prompt2, 8), t);
  EXPECT_EQ(t.held[b], 69);
  EXPECT_LT(rig.decoder->Stats().resident.evictable_blocks,
            rig.decoder->Stats().resident.cached_blocks);  // b holds some
  DecoderOutput out;
  ASSERT_TRUE(rig.decoder->Cancel(b, &out).ok());
  DecoderStats s = rig.decoder->Stats();
  EXPECT_EQ(s.resident.evictable_blocks, s.resident.cached_blocks);
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
  // Prepared again and started without its slices: it fails at Start.
  const uint64_t c = PrepareAndLoad(rig, Request(prompt2, 8), t);
  out = {};
  ASSERT_TRUE(rig.decoder->Start(c, 5, false, &out).ok());
  t.Add(out);
  EXPECT_FALSE(t.error[c].ok());
  s = rig.decoder->Stats();
  EXPECT_EQ(s.resident.evictable_blocks, s.resident.cached_blocks);
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
}

TEST(Decoder, AStartThatComesBeforeTheLoadWaitsForIt) {
  // The store's path: nothing kept resident in the pool.
  DecoderOptions o;
  o.resident = false;
  Rig rig(std::make_unique<GatedStore>(), {}, o);
  const DecodeRequest turn1 = Request(RandomTokens(40, 256, 1), 8);
  Transcript t;
  {
    // Fill the store through a first request whose prompt is this one.
    PrepareAndStart(rig, turn1, t);
    RunToEnd(rig, t);
    rig.io.Drain();
  }
  const DecodeRequest again = Request(turn1.tokens, 10);
  // The first request stored 47 tokens: 2 chunks and a tail of 15 (pieces
  // of 1, 8, 4 and 2). Of that tail, this 40-token prompt reaches the
  // anchor only: the next piece (8 tokens) runs past its end.
  const int32_t first = PushPrompt(rig, again, 33);
  rig.gated().CloseGets();
  ScrubFreeBlocks(rig);
  DecoderOutput out;
  auto id = rig.decoder->Prepare(again, &out);
  ASSERT_TRUE(id.ok());
  EXPECT_TRUE(out.empty());
  ASSERT_TRUE(rig.decoder->Start(*id, first, false, &out).ok());
  EXPECT_EQ(rig.decoder->Start(*id, first, false, &out).code(), StatusCode::kInvalidArgument);
  rig.decoder->Advance(&out);
  EXPECT_TRUE(out.empty()) << "nothing happens until the load is in";
  rig.gated().OpenAll();
  rig.io.Drain();
  rig.decoder->Advance(&out);
  t.Add(out);
  EXPECT_EQ(t.held[*id], 33);
  ASSERT_FALSE(t.tokens[*id].empty());
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[*id], Alone(*rig.model, again));
}

TEST(Decoder, DecodingGoesOnWhileTheStoreIsStuck) {
  Rig rig;
  rig.gated().ClosePuts();
  Transcript t;
  const DecodeRequest a = Request(RandomTokens(40, 256, 1), 6);
  const uint64_t ia = PrepareAndStart(rig, a, t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.finish[ia], "length");
  // A's chunks wait inside the store I/O thread; B, with nothing to load
  // (blended), runs from start to finish meanwhile.
  EXPECT_GT(rig.decoder->Stats().store_bytes_pending, 0u);
  DecodeRequest b = Request(RandomTokens(10, 256, 2), 5);
  b.blended = true;
  const uint64_t ib = PrepareAndStart(rig, b, t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[ib], Alone(*rig.model, b));
  EXPECT_EQ(rig.gated().inner().size(), 0u);
  rig.gated().OpenAll();
  rig.io.Drain();
  EXPECT_EQ(rig.gated().inner().size(), 5u);  // A: 45 tokens with KV, 2 chunks and 3 pieces
  EXPECT_EQ(rig.decoder->Stats().store_bytes_pending, 0u);
}

TEST(Decoder, RunningRequestsDecodeWhileALoadIsOut) {
  Rig rig;
  Transcript t;
  const DecodeRequest a = Request(RandomTokens(20, 256, 1), 12);
  const uint64_t ia = PrepareAndStart(rig, a, t);
  rig.gated().CloseGets();
  DecoderOutput out;
  auto loading = rig.decoder->Prepare(Request(RandomTokens(40, 256, 2), 8), &out);
  ASSERT_TRUE(loading.ok());
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[ia], Alone(*rig.model, a));
  EXPECT_EQ(t.held.count(*loading), 0u);
  rig.gated().OpenAll();
  rig.io.Drain();
  ASSERT_TRUE(rig.decoder->Busy());
  rig.decoder->Advance(&out);
  t.Add(out);
  EXPECT_EQ(t.held[*loading], 0);
}

TEST(Decoder, AStoreThatIsDownCostsOnlyReuse) {
  Rig rig(std::make_unique<DownStore>());
  Transcript t;
  const DecodeRequest r = Request(RandomTokens(50, 256, 1), 10);
  const uint64_t id = PrepareAndLoad(rig, r, t);
  EXPECT_EQ(t.held[id], 0);
  Start(rig, id, PushPrompt(rig, r, 0), t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[id], Alone(*rig.model, r));
  rig.io.Drain();
  const DecoderStats s = rig.decoder->Stats();
  EXPECT_EQ(s.chunks_stored, 0u);
  EXPECT_EQ(s.chunks_store_failed, 6u);  // 59 tokens with KV: 3 chunks and 3 tail pieces
  EXPECT_EQ(s.store_bytes_pending, 0u);
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
}

TEST(Decoder, AConversationIsNotStoredWhileTooMuchWaitsForTheStore) {
  Rig rig(std::make_unique<GatedStore>(), {}, {.max_pending_store_bytes = 0});
  Transcript t;
  const DecodeRequest r = Request(RandomTokens(40, 256, 1), 4);
  const uint64_t id = PrepareAndStart(rig, r, t);
  RunToEnd(rig, t);
  rig.io.Drain();
  EXPECT_EQ(rig.decoder->Stats().chunks_store_dropped, 5u);  // 43 tokens: 2 chunks, 3 pieces
  EXPECT_EQ(rig.gated().inner().size(), 0u);
  EXPECT_EQ(t.finish[id], "length");
}

TEST(Decoder, ABlendedRequestLoadsAndStoresNothingByPrefixKey) {
  Rig rig;
  Transcript t;
  const DecodeRequest plain = Request(RandomTokens(40, 256, 1), 4);
  PrepareAndStart(rig, plain, t);
  RunToEnd(rig, t);
  rig.io.Drain();
  const size_t held = rig.gated().inner().size();
  ASSERT_EQ(held, 5u);  // 43 tokens with KV: 2 chunks and 3 tail pieces

  DecodeRequest blended = Request(plain.tokens, 20);
  blended.blended = true;
  DecoderOutput out;
  auto id = rig.decoder->Prepare(blended, &out);
  ASSERT_TRUE(id.ok());
  t.Add(out);
  EXPECT_EQ(t.held[*id], 0) << "answered at once: nothing to load";
  Start(rig, *id, PushPrompt(rig, blended, 0), t);
  RunToEnd(rig, t);
  rig.io.Drain();
  EXPECT_EQ(t.tokens[*id], Alone(*rig.model, blended));
  EXPECT_EQ(rig.gated().inner().size(), held);
  EXPECT_EQ(rig.decoder->Stats().chunks_loaded, 0u);
  EXPECT_EQ(rig.staging.Stats().chunks, 0u) << "the blended KV's slices are erased";
}

// A blended request's emphasis (docs/serving.md, "Emphasis"): every decode
// step attends with its bias, as one sequence carrying it from the prefill
// on does; a request that is not blended, or an emphasis for other heads,
// is refused at Prepare.
TEST(Decoder, ABlendedRequestsEmphasisBiasesEveryStep) {
  Rig rig;
  Transcript t;
  const model::ModelConfig& c = rig.model->config();
  DecodeRequest r = Request(RandomTokens(40, 256, 1), 12);
  r.blended = true;
  r.emphasis = engine::KvSequence::AttentionBias{
      {{4, 12}, {20, 24}},
      c.num_heads,
      std::vector<float>(static_cast<size_t>(c.num_layers) * c.num_heads, 4.0f)};
  const uint64_t id = PrepareAndStart(rig, r, t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.finish[id], "length");
  EXPECT_EQ(t.tokens[id], Alone(*rig.model, r));
  DecodeRequest plain = r;
  plain.emphasis.reset();
  EXPECT_NE(Alone(*rig.model, r), Alone(*rig.model, plain)) << "the bias changes nothing here";

  DecoderOutput out;
  DecodeRequest unblended = r;
  unblended.blended = false;
  auto refused = rig.decoder->Prepare(unblended, &out);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("blended"), std::string::npos);
  DecodeRequest other_heads = r;
  other_heads.emphasis->heads = c.num_heads + 1;
  refused = rig.decoder->Prepare(other_heads, &out);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("query heads"), std::string::npos);
  DecodeRequest empty_span = r;
  empty_span.emphasis->spans = {{0, 0}};  // what a malformed one becomes
  refused = rig.decoder->Prepare(empty_span, &out);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
}

// The prefill worker's side of a blend over one pruned document that is
// the whole prompt: its KV pruned to half its tokens at `g`, pushed as
// layer slices of its slots, one region from position 0 (under kGlobal,
// garbage in the holes' slots: a slice holds them as they are). What
// that KV gives in one process (greedy from the first token on), and what
// the Start carries.
struct PushedPruned {
  int32_t first = 0;
  std::vector<int32_t> want;
  int64_t slots = 0;
  std::string holes;
};
PushedPruned PushPruned(Rig& rig, const DecodeRequest& r, prune::Granularity g) {
  PushedPruned out;
  engine::CpuKvCache& cache = rig.model->kv_cache();
  engine::KvSequence whole = cache.NewSequence();
  std::vector<float> logits;
  EXPECT_TRUE(rig.model->Prefill(whole, r.tokens, {}, &logits).ok());
  auto scores = prune::KeyNormScores(cache, whole, static_cast<int64_t>(r.tokens.size()));
  EXPECT_TRUE(scores.ok());
  auto kept = prune::SelectKept(*scores, 0.5, 4, g);
  EXPECT_TRUE(kept.ok());
  engine::KvSequence pruned = cache.NewSequence();
  EXPECT_TRUE(prune::CompactKv(cache, whole, *kept, &pruned).ok());
  whole.Reset();
  out.slots = pruned.length();
  const int hd = rig.model->config().head_dim;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> big(-30.0f, 30.0f);
  for (int l = 0; l < cache.num_layers(); ++l) {
    for (int h = 0; h < cache.num_kv_heads(); ++h) {
      const auto holes = pruned.Holes(l, h);
      for (int64_t s = 0; s < static_cast<int64_t>(holes.size()); ++s) {
        for (int i = 0; holes[s] != 0 && i < hd; ++i) {
          cache.KeyAt(pruned, l, s)[h * hd + i] = big(rng);
          cache.ValueAt(pruned, l, s)[h * hd + i] = big(rng);
        }
      }
    }
  }
  const kvbus::ChunkKey xfer = kvbus::TransferRegionKey(r.transfer_id, 0);
  for (int l = 0; l < cache.num_layers(); ++l) {
    auto slice = kvbridge::LayerSliceFromPagedKv(cache, pruned, 0, out.slots, l,
                                                 kvbus::LayerSliceKey(xfer, l), kFingerprint,
                                                 kdn::DType::kF32);
    EXPECT_TRUE(slice.ok()) << slice.status().ToString();
    if (slice.ok()) {
      EXPECT_TRUE(rig.staging.Put(*std::move(slice)).ok());
    }
  }
  out.holes = kvbridge::PackHoles(cache, pruned, out.slots);
  out.first = engine::Sampler(r.spec.sampling).Sample(logits);
  std::vector<float> pick(logits.size(), 0.0f);
  pick[out.first] = 1;
  auto want = engine::GreedyTokens(*rig.model, pruned, pick, r.spec.max_tokens);
  EXPECT_TRUE(want.ok()) << want.status().ToString();
  if (want.ok()) out.want = *want;
  return out;
}

TEST(Decoder, ABlendOverPrunedDocumentsGoesOnAtThePromptsLengthFromFewerSlots) {
  Rig rig;
  Transcript t;
  DecodeRequest r = Request(RandomTokens(40, 256, 3), 6);
  r.blended = true;
  const PushedPruned pushed = PushPruned(rig, r, prune::Granularity::kToken);
  ASSERT_EQ(pushed.slots, 20);
  ASSERT_TRUE(pushed.holes.empty());
  const int32_t first = pushed.first;
  const std::vector<int32_t>* want = &pushed.want;

  DecoderOutput out;
  auto id = rig.decoder->Prepare(r, &out);
  ASSERT_TRUE(id.ok());
  t.Add(out);
  DecoderOutput refused;
  EXPECT_EQ(rig.decoder->Start(*id, first, false, &refused, 41).code(),
            StatusCode::kInvalidArgument)
      << "more slots than prompt tokens";
  EXPECT_TRUE(refused.empty());
  DecoderOutput started;
  ASSERT_TRUE(rig.decoder->Start(*id, first, false, &started, 20).ok());
  t.Add(started);
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[*id], *want);
  EXPECT_TRUE(t.error[*id].ok()) << t.error[*id].ToString();
  EXPECT_EQ(t.finish[*id], "length");

  // kv_tokens belongs to blended requests only.
  DecodeRequest plain = Request(RandomTokens(30, 256, 4), 4);
  const uint64_t plain_id = PrepareAndLoad(rig, plain, t);
  EXPECT_EQ(rig.decoder->Start(plain_id, 1, false, &refused, 10).code(),
            StatusCode::kInvalidArgument);
}

// A blend over a document pruned per head: the slices hold the holes'
// slots as they are (garbage here), and the Start's holes hide them.
TEST(Decoder, ABlendOverADocumentPrunedPerHeadTakesItsHolesWithItsStart) {
  Rig rig;
  Transcript t;
  DecodeRequest r = Request(RandomTokens(40, 256, 13), 6);
  r.blended = true;
  const PushedPruned pushed = PushPruned(rig, r, prune::Granularity::kGlobal);
  ASSERT_FALSE(pushed.holes.empty());
  const int32_t first = pushed.first;
  const int64_t slots = pushed.slots;
  const std::string& holes = pushed.holes;
  const std::vector<int32_t>* want = &pushed.want;

  DecoderOutput out;
  auto id = rig.decoder->Prepare(r, &out);
  ASSERT_TRUE(id.ok());
  t.Add(out);
  DecoderOutput refused;
  EXPECT_EQ(rig.decoder->Start(*id, first, false, &refused, slots, holes.substr(1)).code(),
            StatusCode::kInvalidArgument)
      << "holes for fewer slots";
  DecoderOutput started;
  ASSERT_TRUE(rig.decoder->Start(*id, first, false, &started, slots, holes).ok());
  t.Add(started);
  RunToEnd(rig, t);
  EXPECT_TRUE(t.error[*id].ok()) << t.error[*id].ToString();
  EXPECT_EQ(t.tokens[*id], *want);

  // Holes belong to blended requests only.
  DecodeRequest plain = Request(RandomTokens(30, 256, 14), 4);
  const uint64_t plain_id = PrepareAndLoad(rig, plain, t);
  EXPECT_EQ(rig.decoder->Start(plain_id, 1, false, &refused, 0, holes).code(),
            StatusCode::kInvalidArgument);
}

TEST(Decoder, StartFailsCleanlyWhenTheSlicesNeverArrived) {
  Rig rig;
  Transcript t;
  const uint64_t id = PrepareAndLoad(rig, Request(RandomTokens(20, 256, 1), 4), t);
  Start(rig, id, 65, t);
  EXPECT_EQ(t.finished_events[id], 1);
  EXPECT_EQ(t.error[id].code(), StatusCode::kUnavailable) << t.error[id].ToString();
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
  EXPECT_FALSE(rig.decoder->Busy());
}

TEST(Decoder, AStartThatFailsPartwayLeavesNoneOfItsSlicesStaged) {
  Rig rig;
  Transcript t;
  const DecodeRequest r = Request(RandomTokens(kChunk + 4, 256, 5), 4);
  const uint64_t id = PrepareAndLoad(rig, r, t);
  // Every slice but the first arrives: a chunk and a tail, two layers.
  int pushed = 0;
  const int32_t first = PushSlices(rig, r, 0, [&](std::shared_ptr<const kvbus::Chunk> slice) {
    if (++pushed > 1) {
      EXPECT_TRUE(rig.staging.Put(std::move(slice)).ok());
    }
  });
  ASSERT_EQ(rig.staging.Stats().chunks, 3u);
  Start(rig, id, first, t);
  EXPECT_EQ(t.error[id].code(), StatusCode::kUnavailable) << t.error[id].ToString();
  EXPECT_EQ(rig.staging.Stats().chunks, 0u) << "named for it alone: nobody else takes them";
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
}

TEST(Decoder, AFirstTokenTheRouterSentIsNotSentAgain) {
  Rig rig;
  Transcript t;
  const DecodeRequest r = Request(RandomTokens(20, 256, 3), 5);
  const uint64_t id = PrepareAndLoad(rig, r, t);
  const int32_t first = PushPrompt(rig, r, 0);
  DecoderOutput out;
  ASSERT_TRUE(rig.decoder->Start(id, first, /*first_token_sent=*/true, &out).ok());
  t.Add(out);
  RunToEnd(rig, t);
  std::vector<int32_t> expect = Alone(*rig.model, r);
  ASSERT_FALSE(expect.empty());
  expect.erase(expect.begin());
  EXPECT_EQ(t.tokens[id], expect) << "the second token on, and only those";
  EXPECT_EQ(t.finish[id], "length");
}

TEST(Decoder, CancelBeforeStartErasesTheRequestsOwnSlices) {
  Rig rig;
  Transcript t;
  // One full chunk and a tail of 4 tokens, each named for this request.
  const DecodeRequest r = Request(RandomTokens(kChunk + 4, 256, 4), 4);
  const uint64_t id = PrepareAndLoad(rig, r, t);
  (void)PushPrompt(rig, r, 0);
  const int layers = rig.model->kv_cache().num_layers();
  ASSERT_EQ(rig.staging.Stats().chunks, 2u * layers);
  DecoderOutput out;
  ASSERT_TRUE(rig.decoder->Cancel(id, &out).ok());
  t.Add(out);
  EXPECT_EQ(t.finish[id], "cancelled");
  EXPECT_EQ(rig.staging.Stats().chunks, 0u) << "all its slices are erased";
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
}

// Options with a 60 s prepare timeout on a clock the test moves (`*now`).
DecoderOptions ClockedOptions(std::chrono::steady_clock::time_point* now) {
  *now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  DecoderOptions o;
  o.prepare_timeout = std::chrono::seconds(60);
  o.clock = [now] { return *now; };
  return o;
}

TEST(Decoder, APreparedRequestNeverStartedIsDroppedAfterTheTimeout) {
  std::chrono::steady_clock::time_point now;
  Rig rig(std::make_unique<GatedStore>(), {}, ClockedOptions(&now));
  Transcript t;
  const uint64_t id = PrepareAndLoad(rig, Request(RandomTokens(20, 256, 1), 4), t);
  now += std::chrono::seconds(60);
  DecoderOutput out;
  rig.decoder->Advance(&out);
  EXPECT_TRUE(out.empty()) << "not yet past the timeout";
  now += std::chrono::milliseconds(1);
  rig.decoder->Advance(&out);
  t.Add(out);
  EXPECT_EQ(t.error[id].code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
  EXPECT_EQ(rig.decoder->Start(id, 65, false, &out).code(), StatusCode::kNotFound);
}

TEST(Decoder, ARenewedReservationOutlastsTheTimeoutAndStartsAsAnyOther) {
  std::chrono::steady_clock::time_point now;
  Rig rig(std::make_unique<GatedStore>(), {}, ClockedOptions(&now));
  Transcript t;
  const DecodeRequest r = Request(RandomTokens(20, 256, 1), 4);
  const uint64_t id = PrepareAndLoad(rig, r, t);
  // Its prefill waits three timeouts in a queue; the router's pings renew
  // it meanwhile.
  for (int i = 0; i < 6; ++i) {
    now += std::chrono::seconds(30);
    ASSERT_TRUE(rig.decoder->Renew(id));
    DecoderOutput out;
    rig.decoder->Advance(&out);
    ASSERT_TRUE(out.empty()) << "renewed at " << (i + 1) * 30 << " s";
  }
  Start(rig, id, PushPrompt(rig, r, t.held[id]), t);
  EXPECT_FALSE(t.error.count(id)) << t.error[id].ToString();
  DecoderOutput out;
  // Unrenewed, the same wait drops it; a renewal then finds nothing.
  const uint64_t late = PrepareAndLoad(rig, Request(RandomTokens(20, 256, 2), 4), t);
  now += std::chrono::seconds(61);
  rig.decoder->Advance(&out);
  t.Add(out);
  EXPECT_EQ(t.error[late].code(), StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(rig.decoder->Renew(late));
}

}  // namespace
}  // namespace kdn::decode_worker
