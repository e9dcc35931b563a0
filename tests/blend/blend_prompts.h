#pragma once
// The blend tests' prompts on the tiny model: documents with the KV each
// had computed alone (as the KDN holds it), a question, and the full
// prefill a blend is measured against.

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "kdn/blend/blend.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/testing/tiny_model.h"

namespace kdn::blend {

using kdn::testing::RandomTokens;

// A segment's KV as a blend finds it in the KDN: computed alone, from 0.
inline std::shared_ptr<const kvbus::Chunk> KvAlone(engine::CpuEngine& model,
                                                   const std::vector<int32_t>& tokens) {
  engine::KvSequence seq = model.kv_cache().NewSequence();
  std::vector<float> logits;
  EXPECT_TRUE(model.Prefill(seq, tokens, {}, &logits).ok());
  auto chunk =
      kvbridge::ChunkFromPagedKv(model.kv_cache(), seq, 0, static_cast<int64_t>(tokens.size()),
                                 {0, 1}, {0, 2}, kdn::DType::kF32);
  EXPECT_TRUE(chunk.ok());
  return chunk.ok() ? *chunk : nullptr;
}

struct Prompt {
  std::vector<Segment> segments;
  std::vector<int32_t> suffix;
  std::vector<int32_t> all;  // segments then suffix
};

// BOS (uncached), then `docs` documents of `len` tokens with their KV, then a question.
inline Prompt MakePrompt(engine::CpuEngine& model, int docs, int len, uint32_t seed) {
  Prompt p;
  const int V = model.config().vocab_size;
  p.segments.push_back({{256}, nullptr});
  for (int i = 0; i < docs; ++i) {
    Segment s{RandomTokens(len, 256, seed * 100 + i), nullptr};
    s.kv = KvAlone(model, s.tokens);
    p.segments.push_back(std::move(s));
  }
  p.suffix = RandomTokens(12, std::min(V, 256), seed * 100 + 99);
  for (const Segment& s : p.segments) p.all.insert(p.all.end(), s.tokens.begin(), s.tokens.end());
  p.all.insert(p.all.end(), p.suffix.begin(), p.suffix.end());
  return p;
}

inline std::vector<float> FullPrefill(engine::CpuEngine& model,
                                      const std::vector<int32_t>& tokens) {
  engine::KvSequence seq = model.kv_cache().NewSequence();
  std::vector<float> logits;
  EXPECT_TRUE(model.Prefill(seq, tokens, {}, &logits).ok());
  return logits;
}

}  // namespace kdn::blend
