#pragma once
// What the Decoder's tests share (decoder_test.cpp, slice_landing_test.cpp):
// a Decoder with everything it borrows, a prefill worker's part played by
// the test (PushPrompt), and a transcript of what the Decoder said.

#include <gtest/gtest.h>

#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <random>

#include "kdn/testing/tiny_model.h"
#include "kdn/testing/recording_store.h"
#include "kdn/kvbus/transfer_plan.h"
#include "kdn/decode_worker/decoder.h"
#include "kdn/engine/generate.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbus/chunk.h"

namespace kdn::decode_worker::testing {

using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;

inline constexpr int kChunk = 16;
inline const kvbus::ChunkKey kFingerprint{1, 2};
inline const model::SamplingParams kGreedy{.temperature = 0.0f};

inline text::ByteTokenizer Bytes() {
  std::vector<int32_t> ids(256);
  std::iota(ids.begin(), ids.end(), 0);
  return text::ByteTokenizer(ids, 258, 256, 257);
}

// A store whose Gets or Puts wait while their gate is closed, so that a test
// can hold the store I/O thread inside a round trip for as long as it likes.
class GatedStore final : public kvbus::ChunkStore {
 public:
  std::string name() const override { return "gated"; }
  Result<std::shared_ptr<const kvbus::Chunk>> Get(const kvbus::ChunkKey& key) override {
    Wait(gets_closed_);
    return inner_.Get(key);
  }
  bool Contains(const kvbus::ChunkKey& key) override { return inner_.Contains(key); }
  Status Put(std::shared_ptr<const kvbus::Chunk> chunk) override {
    Wait(puts_closed_);
    return inner_.Put(std::move(chunk));
  }
  kvbus::TierStats Stats() override { return inner_.Stats(); }

  void CloseGets() { Set(gets_closed_, true); }
  void ClosePuts() { Set(puts_closed_, true); }
  void OpenAll() {
    Set(gets_closed_, false);
    Set(puts_closed_, false);
  }
  kdn::testing::RecordingStore& inner() { return inner_; }

 private:
  void Wait(const bool& closed) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !closed; });
  }
  void Set(bool& flag, bool value) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      flag = value;
    }
    cv_.notify_all();
  }
  kdn::testing::RecordingStore inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool gets_closed_ = false;  // guarded by mu_
  bool puts_closed_ = false;  // guarded by mu_
};

// A store that cannot be reached: every Get and Put fails.
class DownStore final : public kvbus::ChunkStore {
 public:
  std::string name() const override { return "down"; }
  Result<std::shared_ptr<const kvbus::Chunk>> Get(const kvbus::ChunkKey&) override {
    return Unavailable("store down");
  }
  bool Contains(const kvbus::ChunkKey&) override { return false; }
  Status Put(std::shared_ptr<const kvbus::Chunk>) override { return Unavailable("store down"); }
  kvbus::TierStats Stats() override { return {}; }
};

// A Decoder with everything it borrows, destroyed in a safe order (the
// Decoder, then the store I/O thread, then what its jobs use).
struct Rig {
  explicit Rig(std::unique_ptr<kvbus::ChunkStore> s = std::make_unique<GatedStore>(),
               engine::EngineOptions eo = {}, DecoderOptions o = {})
      : model(MakeModel("tiny-qwen2", 7, eo)), store(std::move(s)) {
    o.chunk_tokens = kChunk;
    // Chunks of 16 make every tail shorter than kvbus::kMinTailTokens: use
    // tails of any length here.
    o.min_tail_tokens = 1;
    decoder = std::make_unique<Decoder>(*model, tok, kFingerprint, *store, staging, io, o);
  }
  GatedStore& gated() { return dynamic_cast<GatedStore&>(*store); }
  int free_blocks() const { return model->kv_cache().free_blocks(); }
  int num_blocks() const { return model->kv_cache().num_blocks(); }

  std::unique_ptr<engine::CpuEngine> model;
  text::ByteTokenizer tok = Bytes();
  std::unique_ptr<kvbus::ChunkStore> store;
  kvbus::HostTier staging{64u << 20};
  JobThread io{kStoreLanes};
  std::unique_ptr<Decoder> decoder;
};

inline DecodeRequest Request(std::vector<int32_t> prompt, int max_tokens,
                             model::SamplingParams sampling = kGreedy) {
  DecodeRequest r;
  static int transfer = 0;
  r.transfer_id = "transfer-" + std::to_string(++transfer);
  r.tokens = std::move(prompt);
  r.spec.sampling = sampling;
  r.spec.max_tokens = max_tokens;
  return r;
}

// Acts as the prefill worker: computes the whole prompt on a sequence of its
// own, hands `deliver` each layer slice of what the decode worker lacks
// (every chunk past `held_tokens`, and the tail), and returns the first
// token.
inline int32_t PushSlices(Rig& rig, const DecodeRequest& r, int64_t held_tokens,
                          const std::function<void(std::shared_ptr<const kvbus::Chunk>)>& deliver) {
  engine::KvCache& cache = rig.model->kv_cache();
  engine::KvSequence seq = cache.NewSequence();
  if (r.emphasis) {
    EXPECT_TRUE(seq.SetAttentionBias(*r.emphasis).ok());
  }
  std::vector<float> logits;
  EXPECT_TRUE(rig.model->Prefill(seq, r.tokens, {}, &logits).ok());
  std::vector<kvbus::ChunkKey> keys;
  if (!r.blended) keys = kvbus::PrefixKeys({kFingerprint, r.ns, kChunk}, r.tokens);
  const auto n = static_cast<int64_t>(r.tokens.size());
  for (const kvbus::KvRegion& region :
       kvbus::TransferRegions(std::ssize(keys), n, kChunk, held_tokens, r.transfer_id)) {
    for (int l = 0; l < cache.num_layers(); ++l) {
      auto slice = kvbridge::LayerSliceFromPagedKv(cache, seq, region.first, region.count, l,
                                                   kvbus::LayerSliceKey(region.parent, l),
                                                   kFingerprint, kdn::DType::kF32);
      EXPECT_TRUE(slice.ok());
      if (slice.ok()) deliver(*std::move(slice));
    }
  }
  engine::Sampler sampler(r.spec.sampling);
  return sampler.Sample(logits);
}

// PushSlices into staging, as the kvbus receiver puts slices nobody claims.
inline int32_t PushPrompt(Rig& rig, const DecodeRequest& r, int64_t held_tokens) {
  return PushSlices(rig, r, held_tokens, [&](std::shared_ptr<const kvbus::Chunk> slice) {
    EXPECT_TRUE(rig.staging.Put(std::move(slice)).ok());
  });
}

// Collects what the Decoder said, per request.
struct Transcript {
  std::map<uint64_t, int64_t> held;  // tokens, from PrepareDone
  std::map<uint64_t, std::vector<int32_t>> tokens;
  std::map<uint64_t, std::string> finish;
  std::map<uint64_t, Status> error;
  std::map<uint64_t, int> finished_events;
  std::map<uint64_t, LocalPrefillDone> prefilled;
  void Add(const DecoderOutput& out) {
    for (const PrepareDone& d : out.prepared) {
      EXPECT_EQ(held.count(d.id), 0u) << "two PrepareDone for " << d.id;
      held[d.id] = d.held_tokens;
    }
    for (const LocalPrefillDone& d : out.prefilled) {
      EXPECT_EQ(prefilled.count(d.id), 0u) << "two LocalPrefillDone for " << d.id;
      EXPECT_EQ(tokens.count(d.id), 0u) << "an event before the first token of " << d.id;
      prefilled[d.id] = d;
      tokens[d.id].push_back(d.first_token);  // the router sends it; events follow it
    }
    for (const TokenEvent& e : out.events) {
      EXPECT_EQ(finished_events[e.id], 0) << "an event after the finish of " << e.id;
      if (e.token >= 0) tokens[e.id].push_back(e.token);
      if (e.finished) {
        ++finished_events[e.id];
        finish[e.id] = e.finish_reason;
        error[e.id] = e.error;
      }
    }
  }
};

// Fills every free block of the cache with noise. Freed blocks keep their
// KV, and a request often gets back the very blocks that held the same
// tokens a moment before: without this, KV the Decoder failed to place could
// go unnoticed.
inline void ScrubFreeBlocks(Rig& rig) {
  engine::CpuKvCache& cache = rig.model->kv_cache();
  engine::KvSequence seq = cache.NewSequence();
  // Unused blocks only: those the pool keeps resident stay as they are.
  ASSERT_TRUE(cache.Reserve(seq, int64_t{cache.unused_blocks()} * engine::kKvBlockTokens).ok());
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> noise(-4.0f, 4.0f);
  for (int32_t block : seq.blocks()) {
    for (int l = 0; l < cache.num_layers(); ++l) {
      for (float* p : {cache.Key(l, block), cache.Value(l, block)}) {
        for (int64_t i = 0; i < cache.block_stride(); ++i) p[i] = noise(rng);
      }
    }
  }
}

// Prepare, then (if it has something to load) wait for the store I/O thread
// and take its load in.
inline uint64_t PrepareAndLoad(Rig& rig, DecodeRequest r, Transcript& t) {
  ScrubFreeBlocks(rig);
  DecoderOutput out;
  auto id = rig.decoder->Prepare(std::move(r), &out);
  EXPECT_TRUE(id.ok()) << id.status().ToString();
  t.Add(out);
  if (t.held.count(*id) != 0) return *id;
  rig.io.Drain();
  out = {};
  rig.decoder->Advance(&out);
  t.Add(out);
  EXPECT_EQ(t.held.count(*id), 1u) << "no PrepareDone for " << *id;
  return *id;
}

inline void Start(Rig& rig, uint64_t id, int32_t first, Transcript& t) {
  DecoderOutput out;
  EXPECT_TRUE(rig.decoder->Start(id, first, false, &out).ok());
  t.Add(out);
}

// Advances until the Decoder has no work. `drain`: when idle, waits for the
// store I/O thread first (a preempted request's resume may have posted a
// load), so not with a store whose gate is closed.
inline void RunToEnd(Rig& rig, Transcript& t, bool drain = false) {
  for (int i = 0; i < 2000; ++i) {
    if (!rig.decoder->Busy()) {
      if (!drain) break;
      rig.io.Drain();
      if (!rig.decoder->Busy()) break;
    }
    DecoderOutput out;
    rig.decoder->Advance(&out);
    t.Add(out);
  }
  EXPECT_FALSE(rig.decoder->Busy());
}

inline std::vector<int32_t> Alone(engine::CpuEngine& model, const DecodeRequest& r) {
  if (r.emphasis) {
    // Greedy, with the request's emphasis on its sequence.
    EXPECT_EQ(r.spec.sampling.temperature, 0.0f);
    engine::KvSequence seq = model.kv_cache().NewSequence();
    EXPECT_TRUE(seq.SetAttentionBias(*r.emphasis).ok());
    EXPECT_TRUE(model.kv_cache().Reserve(seq, std::ssize(r.tokens) + r.spec.max_tokens).ok());
    std::vector<float> logits;
    EXPECT_TRUE(model.Prefill(seq, r.tokens, {}, &logits).ok());
    auto g = engine::GreedyTokens(model, seq, std::move(logits), r.spec.max_tokens);
    EXPECT_TRUE(g.ok()) << g.status().ToString();
    return g.ok() ? *g : std::vector<int32_t>{};
  }
  auto g = engine::Generate(model, r.tokens,
                            {.max_tokens = r.spec.max_tokens, .sampling = r.spec.sampling});
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  return g.ok() ? g->tokens : std::vector<int32_t>{};
}

// A request prepared, its load in, and started with its whole prompt pushed
// by the prefill worker: running. Returns its id.
inline uint64_t PrepareAndStart(Rig& rig, const DecodeRequest& r, Transcript& t) {
  const uint64_t id = PrepareAndLoad(rig, r, t);
  Start(rig, id, PushPrompt(rig, r, 0), t);
  return id;
}

// One whole request: prepared, started with the prompt pushed, decoded to
// its end, its conversation handed to the store. Returns its id.
inline uint64_t RunWhole(Rig& rig, const DecodeRequest& r, Transcript& t) {
  const uint64_t id = PrepareAndStart(rig, r, t);
  RunToEnd(rig, t);
  rig.io.Drain();
  return id;
}

}  // namespace kdn::decode_worker::testing
