// The engine's per-layer calls for blend: RowPass and RotateCachedKeys.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "kdn/engine/cpu_engine.h"
#include "kdn/testing/tiny_model.h"

namespace kdn::engine {
namespace {

using testing::MakeModel;
using testing::RandomTokens;
using testing::RelError;

class RowPassTest : public ::testing::TestWithParam<std::string> {};

// Every position at every layer, over a cache holding garbage, is a full
// prefill: each layer overwrites the rows' KV before attending.
TEST_P(RowPassTest, EveryPositionAtEveryLayerIsAFullPrefill) {
  auto model = MakeModel(GetParam());
  CpuKvCache& cache = model->kv_cache();
  const auto tokens = RandomTokens(70, model->config().vocab_size, 11);
  std::vector<float> want;
  KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(
      model->Prefill(seq, RandomTokens(70, model->config().vocab_size, 12), {}, &want).ok());
  std::vector<int64_t> all(70);
  std::iota(all.begin(), all.end(), 0);
  auto pass = model->BeginRowPass(seq, tokens, all);
  ASSERT_TRUE(pass.ok()) << pass.status().ToString();
  for (int l = 0; l < model->config().num_layers; ++l) ASSERT_TRUE((*pass)->RunLayer().ok());
  std::vector<float> got;
  ASSERT_TRUE((*pass)->Logits(&got).ok());
  // The reference: the same tokens prefilled in one go.
  KvSequence ref = cache.NewSequence();
  ASSERT_TRUE(model->Prefill(ref, tokens, {}, &want).ok());
  EXPECT_LT(RelError(got.data(), want.data(), want.size()), 1e-5);
  // And the cache now holds the true KV.
  const int64_t stride = cache.token_stride();
  for (int l = 0; l < model->config().num_layers; ++l) {
    for (int64_t t : {0, 33, 69}) {
      EXPECT_LT(RelError(cache.KeyAt(seq, l, t), cache.KeyAt(ref, l, t), stride), 1e-5);
      EXPECT_LT(RelError(cache.ValueAt(seq, l, t), cache.ValueAt(ref, l, t), stride), 1e-5);
    }
  }
}

// Recomputing only the suffix over a cache holding the prefix's true KV is a
// prefill of the suffix on the prefix; on true KV the deviation is ~0.
TEST_P(RowPassTest, ChosenRowsOverTrueKvGiveTheSameLogitsAndNoDeviation) {
  auto model = MakeModel(GetParam());
  CpuKvCache& cache = model->kv_cache();
  const auto tokens = RandomTokens(90, model->config().vocab_size, 13);
  KvSequence seq = cache.NewSequence();
  std::vector<float> want;
  ASSERT_TRUE(model->Prefill(seq, tokens, {}, &want).ok());
  // Rows 20..89 at layer 0 (deviation ~0: the cache holds what they give),
  // then only a few of them, ending with the last.
  std::vector<int64_t> rows(70);
  std::iota(rows.begin(), rows.end(), 20);
  auto pass = model->BeginRowPass(seq, tokens, rows);
  ASSERT_TRUE(pass.ok());
  std::vector<float> dev;
  ASSERT_TRUE((*pass)->RunLayer(&dev).ok());
  ASSERT_EQ(dev.size(), 70u);
  for (float d : dev) EXPECT_LT(d, 1e-6f);
  const std::vector<int64_t> keep = {3, 40, 69};
  ASSERT_TRUE((*pass)->Keep(keep).ok());
  EXPECT_EQ((*pass)->positions(), (std::vector<int64_t>{23, 60, 89}));
  while ((*pass)->next_layer() < model->config().num_layers) ASSERT_TRUE((*pass)->RunLayer().ok());
  std::vector<float> got;
  ASSERT_TRUE((*pass)->Logits(&got).ok());
  EXPECT_LT(RelError(got.data(), want.data(), want.size()), 1e-5);
}

// At layer 0 a token's K depends only on the token and its position, so a K
// computed at position p and rotated by d equals the K computed at p + d.
TEST_P(RowPassTest, CachedKeyRotatedToANewPositionEqualsTheKeyComputedThere) {
  auto model = MakeModel(GetParam());
  CpuKvCache& cache = model->kv_cache();
  const int V = model->config().vocab_size;
  const auto doc = RandomTokens(40, V, 14);
  const int64_t shift = 123;  // not a multiple of the block size
  KvSequence alone = cache.NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(alone, doc, {}, &logits).ok());
  std::vector<int32_t> placed = RandomTokens(static_cast<int>(shift), V, 15);
  placed.insert(placed.end(), doc.begin(), doc.end());
  KvSequence there = cache.NewSequence();
  ASSERT_TRUE(model->Prefill(there, placed, {}, &logits).ok());

  // Move the document's K as a blend would: copy into a sequence at the new
  // position, then rotate by the shift.
  KvSequence moved = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(moved, shift + 40).ok());
  cache.SetLength(moved, shift + 40);
  const int64_t stride = cache.token_stride();
  for (int64_t t = 0; t < 40; ++t) {
    std::memcpy(cache.KeyAt(moved, 0, shift + t), cache.KeyAt(alone, 0, t), stride * sizeof(float));
  }
  ASSERT_TRUE(model->RotateCachedKeys(moved, shift, 40, shift).ok());
  for (int64_t t = 0; t < 40; ++t) {
    EXPECT_LT(RelError(cache.KeyAt(moved, 0, shift + t), cache.KeyAt(there, 0, shift + t), stride),
              1e-5)
        << "token " << t;
  }
  // Rotating back restores the original.
  ASSERT_TRUE(model->RotateCachedKeys(moved, shift, 40, -shift).ok());
  EXPECT_LT(RelError(cache.KeyAt(moved, 0, shift), cache.KeyAt(alone, 0, 0), stride), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Presets, RowPassTest,
                         ::testing::Values("tiny", "tiny-qwen2", "tiny-mistral"),
                         testing::PresetTestName());

TEST(RowPass, RefusesBadPositionsAndRunsNoLayerTwice) {
  auto model = MakeModel("tiny");
  const auto tokens = RandomTokens(20, model->config().vocab_size, 16);
  KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, tokens, {}, &logits).ok());
  const std::vector<int64_t> unsorted = {3, 2}, beyond = {25}, ok = {19};
  EXPECT_FALSE(model->BeginRowPass(seq, tokens, unsorted).ok());
  EXPECT_FALSE(model->BeginRowPass(seq, tokens, beyond).ok());
  EXPECT_FALSE(model->BeginRowPass(seq, std::span(tokens).first(10), ok).ok());
  auto pass = model->BeginRowPass(seq, tokens, ok);
  ASSERT_TRUE(pass.ok());
  EXPECT_EQ((*pass)->Logits(&logits).code(), StatusCode::kFailedPrecondition);
  for (int l = 0; l < model->config().num_layers; ++l) ASSERT_TRUE((*pass)->RunLayer().ok());
  EXPECT_EQ((*pass)->RunLayer().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(model->RotateCachedKeys(seq, 10, 20, 5).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kdn::engine
