// A sequence whose next position is not its KV length (pruned KV:
// KvSequence::SetNextPosition): tokens appended to it are rotated for their
// positions, and attend to the KV held, by slot.
#include <gtest/gtest.h>

#include <cstring>

#include "kdn/testing/tiny_model.h"

namespace kdn::engine {
namespace {

using testing::MakeModel;
using testing::RandomTokens;
using testing::RelError;

TEST(PositionShift, SetNextPositionRefusesToGoBelowTheKvAndResetClearsIt) {
  auto model = MakeModel("tiny");
  KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, RandomTokens(20, 256, 1), {}, &logits).ok());
  EXPECT_EQ(seq.next_position(), 20);
  EXPECT_EQ(seq.SetNextPosition(19).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(seq.SetNextPosition(50).ok());
  EXPECT_EQ(seq.next_position(), 50);
  EXPECT_EQ(seq.position_shift(), 30);
  ASSERT_TRUE(model->Prefill(seq, RandomTokens(3, 256, 2), {}, &logits).ok());
  EXPECT_EQ(seq.length(), 23);
  EXPECT_EQ(seq.next_position(), 53);
  seq.Truncate(21);  // keeps the shift
  EXPECT_EQ(seq.next_position(), 51);
  KvSequence moved = std::move(seq);
  EXPECT_EQ(moved.next_position(), 51);
  moved.Truncate(0);
  EXPECT_EQ(moved.next_position(), 0);
  ASSERT_TRUE(moved.SetNextPosition(7).ok());
  moved.Reset();
  EXPECT_EQ(moved.next_position(), 0);
}

// Prefilled after SetNextPosition(s), a sequence's K is the unshifted K
// rotated by s, and (RoPE being relative) its continuation's logits are the
// unshifted sequence's; a decode step follows the same rule.
class PositionShiftTest : public ::testing::TestWithParam<const char*> {};

TEST_P(PositionShiftTest, TokensAreRotatedForTheirPositionsAndAttendByRelativePosition) {
  auto model = MakeModel(GetParam());
  CpuKvCache& cache = model->kv_cache();
  const int V = model->config().vocab_size;
  const auto context = RandomTokens(37, V, 3), more = RandomTokens(21, V, 4);
  const int64_t shift = 45;  // not a multiple of the block size
  KvSequence plain = cache.NewSequence(), shifted = cache.NewSequence();
  ASSERT_TRUE(shifted.SetNextPosition(shift).ok());
  std::vector<float> a, b;
  ASSERT_TRUE(model->Prefill(plain, context, {}, &a).ok());
  ASSERT_TRUE(model->Prefill(shifted, context, {}, &b).ok());
  EXPECT_EQ(shifted.length(), 37);
  EXPECT_EQ(shifted.next_position(), 37 + shift);
  EXPECT_LT(RelError(b.data(), a.data(), a.size()), 1e-4);
  ASSERT_TRUE(model->RotateCachedKeys(plain, 0, 37, shift).ok());
  const int64_t stride = cache.token_stride();
  for (int l = 0; l < model->config().num_layers; ++l) {
    for (int64_t t = 0; t < 37; ++t) {
      ASSERT_LT(RelError(cache.KeyAt(shifted, l, t), cache.KeyAt(plain, l, t), stride), 1e-5)
          << "layer " << l << " token " << t;
    }
  }
  ASSERT_TRUE(model->RotateCachedKeys(plain, 0, 37, -shift).ok());
  ASSERT_TRUE(model->Prefill(plain, more, {.all_logits = true}, &a).ok());
  ASSERT_TRUE(model->Prefill(shifted, more, {.all_logits = true}, &b).ok());
  EXPECT_LT(RelError(b.data(), a.data(), a.size()), 1e-4);
  const int32_t next = more[0];
  KvSequence* p = &plain;
  KvSequence* s = &shifted;
  ASSERT_TRUE(model->DecodeStep(std::span(&p, 1), std::span(&next, 1), &a).ok());
  ASSERT_TRUE(model->DecodeStep(std::span(&s, 1), std::span(&next, 1), &b).ok());
  EXPECT_EQ(shifted.next_position(), 37 + 21 + 1 + shift);
  EXPECT_LT(RelError(b.data(), a.data(), a.size()), 1e-4);
  // The decoded token's K is rotated for its own position, 58 + shift.
  ASSERT_TRUE(model->RotateCachedKeys(plain, 58, 1, shift).ok());
  EXPECT_LT(RelError(cache.KeyAt(shifted, 0, 58), cache.KeyAt(plain, 0, 58), stride), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Presets, PositionShiftTest,
                         ::testing::Values("tiny", "tiny-qwen2", "tiny-mistral"),
                         testing::PresetTestName());

TEST(PositionShift, ARowPassOverPrunedKvNeedsItsSlotsPositions) {
  auto model = MakeModel("tiny");
  KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  const auto tokens = RandomTokens(20, 256, 5);
  ASSERT_TRUE(model->Prefill(seq, tokens, {}, &logits).ok());
  ASSERT_TRUE(seq.SetNextPosition(30).ok());
  const int64_t rows[] = {3, 4};
  EXPECT_EQ(model->BeginRowPass(seq, tokens, rows).status().code(), StatusCode::kInvalidArgument);
  std::vector<int64_t> at(20);
  for (int i = 0; i < 20; ++i) at[i] = 2 * i;
  EXPECT_TRUE(model->BeginRowPass(seq, tokens, rows, at).ok());
  at[5] = at[4];  // not ascending
  EXPECT_EQ(model->BeginRowPass(seq, tokens, rows, at).status().code(),
            StatusCode::kInvalidArgument);
  at.pop_back();  // one short
  EXPECT_EQ(model->BeginRowPass(seq, tokens, rows, at).status().code(),
            StatusCode::kInvalidArgument);
}

// Every slot recomputed at its given position is a prefill at those
// positions: the row pass writes the KV, and gives the logits, that the
// prefill of a shifted sequence does.
TEST(PositionShift, ARowPassRotatesEachRowForItsSlotsPosition) {
  auto model = MakeModel("tiny-qwen2");
  CpuKvCache& cache = model->kv_cache();
  const int V = model->config().vocab_size;
  const auto tokens = RandomTokens(30, V, 6);
  const int64_t shift = 21;
  KvSequence shifted = cache.NewSequence();
  ASSERT_TRUE(shifted.SetNextPosition(shift).ok());
  std::vector<float> want;
  ASSERT_TRUE(model->Prefill(shifted, tokens, {}, &want).ok());
  KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 30).ok());
  cache.SetLength(seq, 30);
  ASSERT_TRUE(seq.SetNextPosition(30 + shift).ok());
  std::vector<int64_t> rows(30), at(30);
  for (int i = 0; i < 30; ++i) rows[i] = i, at[i] = shift + i;
  auto pass = model->BeginRowPass(seq, tokens, rows, at);
  ASSERT_TRUE(pass.ok()) << pass.status().ToString();
  for (int l = 0; l < model->config().num_layers; ++l) ASSERT_TRUE((*pass)->RunLayer().ok());
  std::vector<float> got;
  ASSERT_TRUE((*pass)->Logits(&got).ok());
  EXPECT_LT(RelError(got.data(), want.data(), want.size()), 1e-4);
  const int64_t stride = cache.token_stride();
  for (int64_t t = 0; t < 30; ++t) {
    EXPECT_LT(RelError(cache.KeyAt(seq, 1, t), cache.KeyAt(shifted, 1, t), stride), 1e-4)
        << "token " << t;
  }
}

TEST(PositionShift, TheContextLimitCountsPositionsNotKv) {
  auto model = MakeModel("tiny");
  const int64_t max = model->config().max_context;
  KvSequence seq = model->kv_cache().NewSequence();
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, RandomTokens(8, 256, 6), {}, &logits).ok());
  ASSERT_TRUE(seq.SetNextPosition(max - 2).ok());
  EXPECT_EQ(model->Prefill(seq, RandomTokens(3, 256, 7), {}, &logits).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(seq.length(), 8);
  EXPECT_TRUE(model->Prefill(seq, RandomTokens(2, 256, 7), {}, &logits).ok());
}

}  // namespace
}  // namespace kdn::engine
