// A decode step allocates nothing once its buffers have grown (issue: no
// allocation per token). Its own binary: it replaces the global operator new
// with a counting one.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "kdn/engine/cpu_engine.h"
#include "kdn/engine/presets.h"
#include "kdn/engine/sampler.h"
#include "quant_encode.h"
#include "kdn/testing/tiny_model.h"

namespace {
std::atomic<bool> counting{false};
std::atomic<int64_t> allocations{0};
}  // namespace

void* operator new(size_t n) {
  if (counting.load(std::memory_order_relaxed)) allocations.fetch_add(1);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace kdn::engine {
namespace {

// Decode steps of two sequences, within one KV block (so that no sequence
// takes a new block), after two steps that let the buffers grow: no
// allocation, on f32 weights and on Q8_0 ones, with two threads.
TEST(DecodeAllocations, AStepAllocatesNothingOnceWarm) {
  for (auto type : {model::GgmlType::kF32, model::GgmlType::kQ8_0}) {
    auto p = FindPreset("tiny-qwen2");
    ASSERT_TRUE(p.ok());
    ModelWeights w = GenerateWeights(p->config, 4, DType::kF32);
    for (auto& [name, t] : w) {
      if (t.shape.size() == 2 && type != model::GgmlType::kF32) {
        t.bytes = Encode(type, t.data);
        t.type = type;
        t.data.clear();
      }
    }
    EngineOptions o;
    o.threads = 2;
    o.kv_tokens = 256;
    auto e = CpuEngine::Create(p->config, std::move(w), o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    KvSequence a = (*e)->kv_cache().NewSequence(), b = (*e)->kv_cache().NewSequence();
    std::vector<float> logits;
    const auto prompt = testing::RandomTokens(17, p->config.vocab_size, 1);
    ASSERT_TRUE((*e)->Prefill(a, prompt, {}, &logits).ok());
    ASSERT_TRUE((*e)->Prefill(b, prompt, {}, &logits).ok());
    KvSequence* seqs[] = {&a, &b};
    int32_t tokens[] = {5, 6};
    Sampler sa({.temperature = 0.0f}), sb({.temperature = 0.0f});
    Sampler* samplers[] = {&sa, &sb};
    std::vector<int32_t> next;
    for (int step = 0; step < 8; ++step) {  // positions 17..24: block 1 throughout
      if (step == 2) counting = true;
      ASSERT_TRUE((*e)->DecodeSample(seqs, tokens, samplers, &next).ok());
      tokens[0] = next[0];
      tokens[1] = next[1];
    }
    counting = false;
    EXPECT_EQ(allocations.exchange(0), 0) << FindQuantTraits(type)->name;
  }
}

}  // namespace
}  // namespace kdn::engine
