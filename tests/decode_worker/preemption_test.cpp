// The decode worker's admission by what a request needs now, and preemption
// into the KDN when its KV pool runs short (docs/serving.md, "Admission and
// preemption").

#include <gtest/gtest.h>

#include "decoder_rig.h"
#include "kdn/decode_worker/decoder.h"

namespace kdn::decode_worker {
namespace {

using namespace testing;  // NOLINT: the rig's helpers, decoder_rig.h

const model::SamplingParams kSeeded{.temperature = 0.8f, .top_k = 40, .top_p = 0.9f, .seed = 11};

// Three requests of 40 + 60 tokens (7 blocks each at their longest) in a
// pool of 12 blocks: each is admitted with 4 (its prompt and a block to
// grow), and as they grow the pool runs short several times.
std::vector<DecodeRequest> Overcommit() {
  return {Request(RandomTokens(40, 256, 1), 60), Request(RandomTokens(40, 256, 2), 60, kSeeded),
          Request(RandomTokens(40, 256, 3), 60)};
}

// Pushes every prompt (the stand-in prefill needs blocks of its own, so it
// runs while the pool is empty), then prepares and starts each.
std::vector<uint64_t> StartAll(Rig& rig, const std::vector<DecodeRequest>& reqs, Transcript& t) {
  std::vector<int32_t> first;
  for (const DecodeRequest& r : reqs) first.push_back(PushPrompt(rig, r, 0));
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < reqs.size(); ++i) {
    ids.push_back(PrepareAndLoad(rig, reqs[i], t));
    Start(rig, ids.back(), first[i], t);
  }
  return ids;
}

TEST(Preemption, PrepareTakesWhatTheRequestNeedsNowAndRefusesWhatCanNeverFit) {
  Rig rig(std::make_unique<GatedStore>(), {.kv_blocks = 8});
  Transcript t;
  // 40 prompt tokens and a block to grow: 4 blocks, not the 7 of 40 + 60.
  PrepareAndLoad(rig, Request(RandomTokens(40, 256, 1), 60), t);
  EXPECT_EQ(rig.free_blocks(), 4);
  DecoderOutput out;
  // A short answer needs no margin past its end: 40 + 4 tokens, 3 blocks.
  ASSERT_TRUE(rig.decoder->Prepare(Request(RandomTokens(40, 256, 2), 4), &out).ok());
  EXPECT_EQ(rig.free_blocks(), 1);
  auto full = rig.decoder->Prepare(Request(RandomTokens(40, 256, 3), 60), &out);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  // 40 + 100 tokens pass the whole pool of 128: never, whatever is free.
  auto never = rig.decoder->Prepare(Request(RandomTokens(40, 256, 4), 100), &out);
  ASSERT_FALSE(never.ok());
  EXPECT_EQ(never.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(never.status().message().find("KV pool of 128 tokens"), std::string::npos)
      << never.status().ToString();
}

TEST(Preemption, PreemptedRequestsResumeWithTheTokensTheyGenerateAlone) {
  Rig rig(std::make_unique<GatedStore>(), {.kv_blocks = 12});
  const std::vector<DecodeRequest> reqs = Overcommit();
  Transcript t;
  const std::vector<uint64_t> ids = StartAll(rig, reqs, t);
  EXPECT_EQ(rig.free_blocks(), 0);
  RunToEnd(rig, t, /*drain=*/true);
  rig.io.Drain();
  const DecoderStats s = rig.decoder->Stats();
  EXPECT_GE(s.preemptions, 2u);
  // Each found all its KV again, in the pool or the KDN: nothing recomputed.
  EXPECT_EQ(s.resumed_by_load, s.preemptions);
  EXPECT_EQ(s.resumed_by_recompute, 0u);
  EXPECT_EQ(s.preempted, 0);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(t.tokens[ids[i]], Alone(*rig.model, reqs[i])) << "request " << i;
    EXPECT_EQ(t.finished_events[ids[i]], 1);
    EXPECT_EQ(t.finish[ids[i]], "length");
    EXPECT_TRUE(t.error[ids[i]].ok()) << t.error[ids[i]].ToString();
  }
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
  EXPECT_EQ(s.running, 0);
}

TEST(Preemption, KvEvictedWhileItWaitedIsRecomputed) {
  // No KDN below the pool: a preempted request's KV lives only in blocks
  // the others' growth takes back, and its resume recomputes it.
  Rig rig(std::make_unique<DownStore>(), {.kv_blocks = 12});
  const std::vector<DecodeRequest> reqs = Overcommit();
  Transcript t;
  const std::vector<uint64_t> ids = StartAll(rig, reqs, t);
  RunToEnd(rig, t, /*drain=*/true);
  const DecoderStats s = rig.decoder->Stats();
  EXPECT_GE(s.resumed_by_recompute, 1u);
  EXPECT_GT(s.resume_recomputed_tokens, 0u);
  EXPECT_EQ(s.resumed_by_load + s.resumed_by_recompute, s.preemptions);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(t.tokens[ids[i]].size(), 60u) << "request " << i;
    EXPECT_EQ(t.finish[ids[i]], "length");
    EXPECT_TRUE(t.error[ids[i]].ok()) << t.error[ids[i]].ToString();
  }
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
}

TEST(Preemption, NothingNewIsAdmittedWhilePreemptedRequestsWaitAndCancelFreesThem) {
  Rig rig(std::make_unique<GatedStore>(), {.kv_blocks = 12});
  const std::vector<DecodeRequest> reqs = Overcommit();
  Transcript t;
  const std::vector<uint64_t> ids = StartAll(rig, reqs, t);
  for (int i = 0; i < 200 && rig.decoder->Stats().preempted == 0; ++i) {
    DecoderOutput out;
    rig.decoder->Advance(&out);
    t.Add(out);
  }
  ASSERT_EQ(rig.decoder->Stats().preempted, 1);
  EXPECT_EQ(t.finished_events[ids[2]], 0);  // the newest, waiting: no event
  // Blocks are free (its own, resident), but it resumes first.
  DecoderOutput out;
  auto refused = rig.decoder->Prepare(Request(RandomTokens(8, 256, 9), 4), &out);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("preempted"), std::string::npos);

  ASSERT_TRUE(rig.decoder->Cancel(ids[2], &out).ok());
  t.Add(out);
  EXPECT_EQ(t.finish[ids[2]], "cancelled");
  EXPECT_EQ(rig.decoder->Stats().preempted, 0);
  EXPECT_EQ(rig.decoder->Cancel(ids[2], &out).code(), StatusCode::kNotFound);
  RunToEnd(rig, t, /*drain=*/true);
  rig.io.Drain();
  for (size_t i : {0u, 1u}) {
    EXPECT_EQ(t.tokens[ids[i]], Alone(*rig.model, reqs[i])) << "request " << i;
  }
  EXPECT_EQ(t.finished_events[ids[2]], 1);
  EXPECT_EQ(rig.free_blocks(), rig.num_blocks());
}

}  // namespace
}  // namespace kdn::decode_worker
