#pragma once
// What the Prefiller tests share (prefiller_test.cpp,
// prefiller_documents_test.cpp): a host-memory KDN, options for chunks of
// kChunk tokens and short peer timeouts, and the engine's own first token.

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "kdn/engine/sampler.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/tiered_store.h"
#include "kdn/prefill_worker/prefiller.h"
#include "kdn/testing/tiny_model.h"

namespace kdn::prefill_worker::testing {

inline constexpr int kChunk = 16;

inline std::unique_ptr<kvbus::TieredStore> HostStore() {
  std::vector<std::unique_ptr<kvbus::ChunkStore>> tiers;
  tiers.push_back(std::make_unique<kvbus::HostTier>(64u << 20));
  return std::make_unique<kvbus::TieredStore>(std::move(tiers));
}

inline PrefillerOptions Options() {
  PrefillerOptions o;
  o.chunk_tokens = kChunk;
  o.sender.peer_timeout = std::chrono::milliseconds(500);
  o.sender.heartbeat_interval = std::chrono::milliseconds(100);
  o.push_timeout = std::chrono::milliseconds(5000);
  o.min_tail_tokens = 1;  // chunks of 16: every tail is shorter than the default
  return o;
}

// `bias`: an attention bias on the sequence (KvSequence::SetAttentionBias).
inline int32_t GreedyFirstToken(engine::CpuEngine& model, const std::vector<int32_t>& prompt,
                                const engine::KvSequence::AttentionBias* bias = nullptr) {
  engine::KvSequence seq = model.kv_cache().NewSequence();
  if (bias != nullptr) {
    EXPECT_TRUE(seq.SetAttentionBias(*bias).ok());
  }
  std::vector<float> logits;
  EXPECT_TRUE(model.Prefill(seq, prompt, {}, &logits).ok());
  return engine::Argmax(logits);
}

}  // namespace kdn::prefill_worker::testing
