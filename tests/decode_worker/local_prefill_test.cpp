// The decode worker's local prefill (docs/serving.md, "Two paths"): the
// prompt tokens a decode worker lacks computed on it, in bounded pieces
// between the running requests' steps, its first token sent before anything
// else is done for it.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "decoder_rig.h"
#include "kdn/decode_worker/decoder.h"

namespace kdn::decode_worker {
namespace {

using namespace testing;  // NOLINT: the rig's helpers, decoder_rig.h

DecodeRequest Local(std::vector<int32_t> prompt, int max_tokens,
                    model::SamplingParams sampling = kGreedy) {
  DecodeRequest r = Request(std::move(prompt), max_tokens, sampling);
  r.local_prefill = true;
  return r;
}

// The next turn of a conversation: the prompt, the answer and `more` new tokens.
std::vector<int32_t> NextTurn(const DecodeRequest& r, const std::vector<int32_t>& answer, int more,
                              uint32_t seed) {
  std::vector<int32_t> next = r.tokens;
  next.insert(next.end(), answer.begin(), answer.end());
  const auto extra = RandomTokens(more, 256, seed);
  next.insert(next.end(), extra.begin(), extra.end());
  return next;
}

TEST(Decoder, ALocalPrefillGivesTheTokensTheEngineGeneratesAloneOnEveryTurn) {
  Rig rig;
  Transcript t;
  // Turn 1: nothing held, the whole prompt computed here, seeded sampling.
  const DecodeRequest turn1 =
      Local(RandomTokens(40, 256, 1), 20, {.temperature = 0.8f, .top_k = 40, .seed = 3});
  const uint64_t a = PrepareAndLoad(rig, turn1, t);
  RunToEnd(rig, t);
  ASSERT_EQ(t.prefilled.count(a), 1u);
  EXPECT_EQ(t.prefilled[a].held_tokens, 0);
  EXPECT_EQ(t.prefilled[a].computed_tokens, 40);
  EXPECT_EQ(t.tokens[a], Alone(*rig.model, turn1));
  EXPECT_EQ(t.finish[a], "length");
  rig.io.Drain();

  // Turn 2: the conversation (prompt and all but the last answer token) is
  // attached from the pool; only the new tokens are computed.
  const DecodeRequest turn2 = Local(NextTurn(turn1, t.tokens[a], 9, 2), 12);
  const uint64_t b = PrepareAndLoad(rig, turn2, t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.prefilled[b].resident_tokens, 59);
  EXPECT_EQ(t.prefilled[b].held_tokens, 59);
  EXPECT_EQ(t.prefilled[b].computed_tokens, static_cast<int64_t>(turn2.tokens.size()) - 59);
  EXPECT_EQ(t.tokens[b], Alone(*rig.model, turn2));

  // A prompt the pool holds whole (turn 1's conversation with KV: 3
  // chunks and a tail piece): the last token is still computed, for its
  // logits, after its shared block is copied.
  const DecodeRequest again = Local({turn2.tokens.begin(), turn2.tokens.begin() + 59}, 6);
  const uint64_t c = PrepareAndLoad(rig, again, t);
  RunToEnd(rig, t);
  EXPECT_LT(t.prefilled[c].held_tokens, 59);
  EXPECT_EQ(t.prefilled[c].computed_tokens, 59 - t.prefilled[c].held_tokens);
  EXPECT_EQ(t.tokens[c], Alone(*rig.model, again));

  const DecoderStats s = rig.decoder->Stats();
  EXPECT_EQ(s.local_prefills, 3u);
  EXPECT_EQ(s.local_prefill_tokens, 40u + (turn2.tokens.size() - 59) +
                                        static_cast<uint64_t>(t.prefilled[c].computed_tokens));
  EXPECT_EQ(s.local_backlog_tokens, 0);
  EXPECT_GT(s.prefill_ms_per_token, 0.0);
  rig.io.Drain();
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
}

TEST(Decoder, ALocalPrefillPlacesWhatTheKdnHoldsAndComputesTheRest) {
  DecoderOptions o;
  o.resident = false;  // every prefix from the store
  Rig rig(std::make_unique<GatedStore>(), {}, o);
  Transcript t;
  const DecodeRequest turn1 = Request(RandomTokens(40, 256, 1), 30);
  const uint64_t a = RunWhole(rig, turn1, t);
  // A lookup that reached nothing: no load, the whole prompt computed.
  DecodeRequest cold = Local(NextTurn(turn1, t.tokens[a], 10, 4), 10);
  const uint64_t c = PrepareAndLoad(rig, cold, t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.prefilled[c].held_tokens, 0);
  EXPECT_EQ(rig.decoder->Stats().chunks_loaded, 0u);
  // Its lookup reached the 69 tokens with KV stored (4 chunks and a tail
  // piece of 5): they are loaded, the rest computed.
  DecodeRequest turn2 = Local(NextTurn(turn1, t.tokens[a], 10, 5), 10);
  turn2.lookup_tokens = 69;
  const uint64_t b = PrepareAndLoad(rig, turn2, t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.prefilled[b].held_tokens, 69);
  EXPECT_EQ(t.prefilled[b].resident_tokens, 0);
  EXPECT_GT(t.prefilled[b].kv_bytes_loaded, 0u);
  EXPECT_EQ(t.tokens[b], Alone(*rig.model, turn2));
  EXPECT_EQ(t.tokens[c], Alone(*rig.model, cold));
}

TEST(Decoder, ALocalPrefillRunsInBoundedPiecesBetweenTheRunningRequestsSteps) {
  DecoderOptions o;
  o.local_prefill_step_tokens = 16;
  Rig rig(std::make_unique<GatedStore>(), {}, o);
  Transcript t;
  const DecodeRequest running = Request(RandomTokens(20, 256, 1), 40);
  const uint64_t r = PrepareAndStart(rig, running, t);
  const size_t before = t.tokens[r].size();

  const DecodeRequest local = Local(RandomTokens(70, 256, 2), 8);
  DecoderOutput out;
  auto l = rig.decoder->Prepare(local, &out);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  t.Add(out);
  rig.io.Drain();  // its load (a miss)
  // 70 tokens at 16 a step: 5 pieces, the first four each followed by a
  // step that still decodes the running request; the backlog shrinks by a
  // piece each. The Advance of the last piece sends the first token at once,
  // before any step; the next admits the request and steps both.
  int64_t backlog = 70;
  for (int step = 1; step <= 5; ++step) {
    out = {};
    rig.decoder->Advance(&out);
    t.Add(out);
    EXPECT_EQ(t.tokens[r].size(), before + std::min(step, 4)) << "step " << step;
    const int64_t now = rig.decoder->Stats().local_backlog_tokens;
    EXPECT_EQ(now, std::max<int64_t>(backlog - 16, 0)) << "step " << step;
    backlog = now;
    EXPECT_EQ(t.prefilled.count(*l), step == 5 ? 1u : 0u) << "step " << step;
  }
  EXPECT_TRUE(out.events.empty()) << "a step held the first token back";
  EXPECT_TRUE(rig.decoder->Busy());
  out = {};
  rig.decoder->Advance(&out);
  t.Add(out);
  EXPECT_EQ(t.tokens[r].size(), before + 5);
  EXPECT_EQ(t.tokens[*l].size(), 2u) << "admitted, and in the step";
  EXPECT_GT(rig.decoder->Stats().step_ms, 0.0);
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[r], Alone(*rig.model, running));
  EXPECT_EQ(t.tokens[*l], Alone(*rig.model, local));
}

TEST(Decoder, ALocalPrefillGoesInPiecesNoLongerThanTheEnginesLimit) {
  // An engine that, as a GPU's activation buffers do, refuses a Prefill of
  // more than 6 tokens; its twin, the same weights without the limit, gives
  // the answers.
  DecoderOptions o;
  o.local_prefill_step_tokens = 16;
  Rig rig(std::make_unique<GatedStore>(), {.max_prefill_tokens = 6}, o);
  const auto whole = MakeModel("tiny-qwen2", 7);
  ASSERT_EQ(rig.model->max_prefill_tokens(), 6);
  ASSERT_EQ(whole->max_prefill_tokens(), INT64_MAX);
  Transcript t;
  // Nothing running: the whole prompt at once, in 7 calls.
  const DecodeRequest alone = Local(RandomTokens(40, 256, 1), 10);
  const uint64_t a = PrepareAndLoad(rig, alone, t);
  RunToEnd(rig, t);
  ASSERT_EQ(t.prefilled.count(a), 1u);
  EXPECT_EQ(t.prefilled[a].computed_tokens, 40);
  EXPECT_TRUE(t.error[a].ok()) << t.error[a].ToString();
  EXPECT_EQ(t.tokens[a], Alone(*whole, alone));
  rig.io.Drain();

  // A request running: 16 prompt tokens a step, in calls of at most 6.
  const DecodeRequest running = Request(RandomTokens(6, 256, 2), 30);
  const uint64_t r = PrepareAndStart(rig, running, t);
  const DecodeRequest local = Local(RandomTokens(50, 256, 3), 8);
  DecoderOutput out;
  auto l = rig.decoder->Prepare(local, &out);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  t.Add(out);
  rig.io.Drain();  // its load (a miss)
  int64_t backlog = 50;
  for (int step = 1; step <= 4; ++step) {
    out = {};
    rig.decoder->Advance(&out);
    t.Add(out);
    const int64_t now = rig.decoder->Stats().local_backlog_tokens;
    EXPECT_EQ(now, std::max<int64_t>(backlog - 16, 0)) << "step " << step;
    backlog = now;
  }
  ASSERT_EQ(t.prefilled.count(*l), 1u);
  RunToEnd(rig, t);
  EXPECT_TRUE(t.error[*l].ok()) << t.error[*l].ToString();
  EXPECT_EQ(t.tokens[r], Alone(*whole, running));
  EXPECT_EQ(t.tokens[*l], Alone(*whole, local));
}

TEST(Decoder, ALocalPrefillIsRefusedForBlendedAndResumedRequestsAndNeedsNoStart) {
  Rig rig;
  DecoderOutput out;
  DecodeRequest blended = Local(RandomTokens(20, 256, 1), 4);
  blended.blended = true;
  EXPECT_EQ(rig.decoder->Prepare(blended, &out).status().code(), StatusCode::kInvalidArgument);
  DecodeRequest resumed = Local(RandomTokens(20, 256, 1), 4);
  resumed.spec.generated = {resumed.tokens.back()};
  EXPECT_EQ(rig.decoder->Prepare(resumed, &out).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());

  // Held by a store that does not answer: its load stays out.
  rig.gated().CloseGets();
  DecodeRequest loading = Local(RandomTokens(40, 256, 2), 4);
  loading.lookup_tokens = 32;
  auto id = rig.decoder->Prepare(loading, &out);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(rig.decoder->Start(*id, 7, true, &out).code(), StatusCode::kInvalidArgument);
  EXPECT_GT(rig.decoder->Stats().local_backlog_tokens, 0);
  Transcript t;
  out = {};
  ASSERT_TRUE(rig.decoder->Cancel(*id, &out).ok());
  t.Add(out);
  EXPECT_EQ(t.finish[*id], "cancelled");
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
  rig.gated().OpenAll();
  rig.io.Drain();
  out = {};
  rig.decoder->Advance(&out);
  EXPECT_TRUE(out.empty()) << "a cancelled local prefill is not computed";
  EXPECT_EQ(rig.decoder->Stats().local_prefills, 0u);
}

TEST(Decoder, ALocalPrefillIsNeverDroppedForWantOfAStart) {
  auto now = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  DecoderOptions o;
  o.prepare_timeout = std::chrono::seconds(60);
  o.clock = [&] { return now; };
  Rig rig(std::make_unique<GatedStore>(), {}, o);
  rig.gated().CloseGets();  // its load stays out past the timeout
  DecoderOutput out;
  DecodeRequest local = Local(RandomTokens(40, 256, 2), 4);
  local.lookup_tokens = 32;  // a load to wait for
  auto id = rig.decoder->Prepare(local, &out);
  ASSERT_TRUE(id.ok());
  now += std::chrono::minutes(5);
  rig.decoder->Advance(&out);
  EXPECT_TRUE(out.empty());
  rig.gated().OpenAll();
  rig.io.Drain();
  Transcript t;
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[*id], Alone(*rig.model, local));
}

TEST(Decoder, RunningRequestsStepBetweenLocalPrefillsThatFinishOneAfterAnother) {
  DecoderOptions o;
  o.local_prefill_step_tokens = 16;
  Rig rig(std::make_unique<GatedStore>(), {}, o);
  Transcript t;
  const DecodeRequest running = Request(RandomTokens(20, 256, 1), 60);
  const uint64_t r = PrepareAndStart(rig, running, t);
  // Four short local prefills, each done in one piece: each Advance that
  // sends a first token puts the running request's step off to the next,
  // which steps before computing the next prefill.
  std::vector<uint64_t> locals;
  for (int i = 0; i < 4; ++i) {
    DecoderOutput out;
    auto l = rig.decoder->Prepare(Local(RandomTokens(10, 256, 10 + i), 4), &out);
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    t.Add(out);
    locals.push_back(*l);
  }
  rig.io.Drain();  // their loads (misses)
  size_t tokens = t.tokens[r].size();
  int without_a_step = 0;
  for (int advance = 0; advance < 12; ++advance) {
    DecoderOutput out;
    rig.decoder->Advance(&out);
    t.Add(out);
    without_a_step = t.tokens[r].size() > tokens ? 0 : without_a_step + 1;
    tokens = t.tokens[r].size();
    EXPECT_LE(without_a_step, 1) << "two Advances without a step, at " << advance;
  }
  for (uint64_t l : locals) EXPECT_EQ(t.prefilled.count(l), 1u);
  RunToEnd(rig, t);
  EXPECT_EQ(t.tokens[r], Alone(*rig.model, running));
  for (size_t i = 0; i < locals.size(); ++i) {
    EXPECT_EQ(t.tokens[locals[i]],
              Alone(*rig.model, Local(RandomTokens(10, 256, 10 + static_cast<uint32_t>(i)), 4)));
  }
}

TEST(Decoder, ALocalPrefillCancelledRightAfterItsFirstTokenEndsAsAStartedOne) {
  Rig rig;
  Transcript t;
  const DecodeRequest turn = Local(RandomTokens(40, 256, 4), 5);
  const uint64_t a = PrepareAndLoad(rig, turn, t);
  DecoderOutput out;
  rig.decoder->Advance(&out);
  t.Add(out);
  ASSERT_EQ(t.prefilled.count(a), 1u);
  // The client goes away before the next Advance: the request ends as a
  // running one would, its prompt published for the next turn.
  out = {};
  ASSERT_TRUE(rig.decoder->Cancel(a, &out).ok());
  t.Add(out);
  EXPECT_EQ(t.finish[a], "cancelled");
  EXPECT_EQ(t.tokens[a].size(), 1u);
  EXPECT_EQ(rig.decoder->Cancel(a, &out).code(), StatusCode::kNotFound);
  RunToEnd(rig, t);
  EXPECT_EQ(rig.decoder->Stats().prepared + rig.decoder->Stats().running, 0);
  // The same prompt again finds it resident but for its last token.
  const uint64_t b = PrepareAndLoad(rig, turn, t);
  RunToEnd(rig, t);
  EXPECT_EQ(t.prefilled[b].resident_tokens, 39);
  EXPECT_EQ(t.tokens[b], Alone(*rig.model, turn));
  EXPECT_EQ(t.tokens[b][0], t.tokens[a][0]);
}

}  // namespace
}  // namespace kdn::decode_worker
