// Value steering of stored KV (kvbridge/steer.h): the vector is the mean
// value difference of contrastive pairs' last tokens; a steered chunk
// differs from its original in exactly the steered value rows.
#include "kdn/kvbridge/steer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <vector>

#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/prefix_io.h"
#include "kdn/testing/tiny_model.h"

namespace kdn::kvbridge {
namespace {

using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;

// The value row of `prompt`'s last token at `layer`, prefilled alone.
std::vector<float> LastValueRow(engine::Engine& model, const std::vector<int32_t>& prompt,
                                int layer) {
  engine::KvCache& cache = model.kv_cache();
  engine::KvSequence seq = cache.NewSequence();
  EXPECT_TRUE(cache.Reserve(seq, static_cast<int64_t>(prompt.size())).ok());
  std::vector<float> logits;
  EXPECT_TRUE(model.Prefill(seq, prompt, {}, &logits).ok());
  std::vector<uint8_t> kv(cache.LayerBytes(1, DType::kF32));
  EXPECT_TRUE(cache.ReadLayers(seq, layer, 1, seq.length() - 1, 1, DType::kF32, kv).ok());
  const auto* f = reinterpret_cast<const float*>(kv.data());
  const size_t row = static_cast<size_t>(cache.token_stride());
  return {f + row, f + 2 * row};
}

TEST(Steer, TheVectorIsTheMeanValueDifferenceOfThePairsLastTokens) {
  auto model = MakeModel("tiny");
  const std::vector<int32_t> p1 = RandomTokens(12, 256, 1), n1 = RandomTokens(9, 256, 2);
  const std::vector<int32_t> p2 = RandomTokens(7, 256, 3), n2 = RandomTokens(15, 256, 4);
  auto v = ValueSteeringVector(*model, "trust", {{p1, n1}, {p2, n2}}, {0, 1});
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->name, "trust");
  EXPECT_EQ(v->pairs.size(), 2u);
  const size_t row = v->row();
  ASSERT_EQ(v->values.size(), 2 * row);
  for (int l : {0, 1}) {
    const auto a = LastValueRow(*model, p1, l), b = LastValueRow(*model, n1, l);
    const auto c = LastValueRow(*model, p2, l), d = LastValueRow(*model, n2, l);
    for (size_t j = 0; j < row; ++j) {
      const double want = ((double{a[j]} - b[j]) + (double{c[j]} - d[j])) / 2;
      EXPECT_NEAR(v->values[static_cast<size_t>(l) * row + j], want, 1e-5) << l << " " << j;
    }
  }
  // A pair of one prompt twice steers nowhere.
  auto zero = ValueSteeringVector(*model, "none", {{p1, p1}}, {1});
  ASSERT_TRUE(zero.ok());
  for (float x : zero->values) EXPECT_EQ(x, 0.0f);

  EXPECT_FALSE(ValueSteeringVector(*model, "x", {}, {0}).ok());
  EXPECT_FALSE(ValueSteeringVector(*model, "x", {{p1, n1}}, {1, 0}).ok());
  EXPECT_FALSE(ValueSteeringVector(*model, "x", {{p1, n1}}, {model->config().num_layers}).ok());
  EXPECT_FALSE(ValueSteeringVector(*model, "x", {{p1, {}}}, {0}).ok());
}

TEST(Steer, ASteeredChunkChangesOnlyTheSteeredValuesAndTheOriginalStays) {
  auto model = MakeModel("tiny");
  engine::KvCache& cache = model->kv_cache();
  const std::vector<int32_t> doc = RandomTokens(40, 256, 5);
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 40).ok());
  std::vector<float> logits;
  ASSERT_TRUE(model->Prefill(seq, doc, {}, &logits).ok());
  const kvbus::ChunkKey fp{1, 2}, key{3, 4}, steered_key{5, 6};
  auto original = ChunkFromPagedKv(cache, seq, 0, 40, key, fp, DType::kF32);
  ASSERT_TRUE(original.ok());
  const std::vector<uint8_t> before((*original)->payload().begin(), (*original)->payload().end());

  SteeringVector v;
  v.name = "v";
  v.layers = {1};
  v.kv_heads = cache.num_kv_heads();
  v.head_dim = cache.head_dim();
  for (size_t j = 0; j < v.row(); ++j) v.values.push_back(0.25f * static_cast<float>(j % 7) - 0.5f);
  auto steered = SteerChunkValues(**original, v, 2.0f, 38, 2, steered_key);
  ASSERT_TRUE(steered.ok()) << steered.status().ToString();
  EXPECT_EQ((*steered)->info().key, steered_key);
  EXPECT_EQ((*steered)->info().tokens, 40u);

  // Every float but the steered values of tokens 38 and 39 at layer 1.
  const auto* a = reinterpret_cast<const float*>(before.data());
  const auto* b = reinterpret_cast<const float*>((*steered)->payload().data());
  const size_t row = v.row(), half = 40 * row, n = before.size() / 4;
  size_t changed = 0;
  for (size_t i = 0; i < n; ++i) {
    const size_t layer = i / (2 * half), in_layer = i % (2 * half);
    const bool value = in_layer >= half;
    const size_t token = (in_layer % half) / row, j = in_layer % row;
    if (layer == 1 && value && token >= 38) {
      EXPECT_EQ(b[i], a[i] + 2.0f * v.values[j]) << i;
      changed += v.values[j] != 0.0f;
    } else {
      ASSERT_EQ(b[i], a[i]) << "layer " << layer << (value ? " V" : " K") << " token " << token;
    }
  }
  EXPECT_GT(changed, 0u);
  EXPECT_EQ(std::memcmp((*original)->payload().data(), before.data(), before.size()), 0);

  // Stored and read back: the steered version under its key, the original under its own.
  kvbus::HostTier tier(16u << 20);
  ASSERT_TRUE(tier.Put(*original).ok());
  ASSERT_TRUE(tier.Put(*steered).ok());
  auto got = tier.Get(steered_key);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(std::memcmp((*got)->payload().data(), b, before.size()), 0);
  auto kept = tier.Get(key);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(std::memcmp((*kept)->payload().data(), before.data(), before.size()), 0);

  // What does not fit is refused.
  EXPECT_FALSE(SteerChunkValues(**original, v, 1.0f, 39, 2, steered_key).ok());
  EXPECT_FALSE(SteerChunkValues(**original, v, 1.0f, -1, 1, steered_key).ok());
  SteeringVector wide = v;
  wide.head_dim += 1;
  EXPECT_FALSE(SteerChunkValues(**original, wide, 1.0f, 0, 1, steered_key).ok());
  SteeringVector deep = v;
  deep.layers = {model->config().num_layers};
  EXPECT_FALSE(SteerChunkValues(**original, deep, 1.0f, 0, 1, steered_key).ok());
}

TEST(Steer, AVectorStoredAsAChunkReadsBackWholeAndIsNeverKv) {
  auto model = MakeModel("tiny");
  const int layers = model->config().num_layers;
  const std::vector<int32_t> p1 = RandomTokens(6, 256, 7), n1 = RandomTokens(5, 256, 8);
  auto v = ValueSteeringVector(*model, "trust-the-text", {{p1, n1}, {n1, p1}}, {1});
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  const kvbus::ChunkKey fp{1, 2}, key{7, 8};
  auto chunk = kvbus::SteeringChunk(*v, layers, key, fp);
  ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
  EXPECT_TRUE((*chunk)->info().is_steering());
  EXPECT_EQ((*chunk)->info().layers, static_cast<uint32_t>(layers));

  // Through the bytes a tier stores, back to the same vector.
  auto parsed =
      kvbus::Chunk::Parse(std::vector<uint8_t>((*chunk)->bytes().begin(), (*chunk)->bytes().end()));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  auto back = kvbus::SteeringFromChunk(**parsed);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->name, "trust-the-text");
  EXPECT_EQ(back->layers, v->layers);
  EXPECT_EQ(back->kv_heads, v->kv_heads);
  EXPECT_EQ(back->head_dim, v->head_dim);
  EXPECT_EQ(back->values, v->values);
  EXPECT_EQ(back->pairs, v->pairs);

  // Not KV: no cache takes it, no document fits it.
  engine::KvCache& cache = model->kv_cache();
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 1).ok());
  EXPECT_EQ(ChunkToPagedKv(**parsed, cache, seq, 0).code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(kvbus::SegmentChunkFits(**parsed, fp, 1, DType::kF32));

  // A KV chunk is not a vector; a vector that does not fit the model is not stored.
  kvbus::ChunkInfo kv_info = (*chunk)->info();
  kv_info.steering.clear();
  kv_info.steering_bytes = 0;
  auto kv = kvbus::Chunk::Make(kv_info, std::vector<uint8_t>(kv_info.payload_bytes()));
  ASSERT_TRUE(kv.ok());
  EXPECT_EQ(kvbus::SteeringFromChunk(**kv).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(kvbus::SteeringChunk(*v, 1, key, fp).ok());
  SteeringVector cut = *v;
  cut.values.pop_back();
  EXPECT_FALSE(kvbus::SteeringChunk(cut, layers, key, fp).ok());

  // A description cut short, or with bytes past its pairs, is damage.
  for (const auto& edit : std::vector<std::function<void(std::vector<uint8_t>&)>>{
           [](std::vector<uint8_t>& d) { d.resize(d.size() - 4); },
           [](std::vector<uint8_t>& d) {
             d.insert(d.end(), {0, 0, 0, 0});
           },
           [](std::vector<uint8_t>& d) { d[0] = 9; }}) {
    kvbus::ChunkInfo info = (*chunk)->info();
    edit(info.steering);
    info.steering_bytes = static_cast<uint32_t>(info.steering.size());
    const std::span<const uint8_t> payload = (*chunk)->payload();
    auto forged = kvbus::Chunk::Make(info, {payload.begin(), payload.end()});
    ASSERT_TRUE(forged.ok()) << forged.status().ToString();
    EXPECT_EQ(kvbus::SteeringFromChunk(**forged).status().code(), StatusCode::kCorruption);
  }
}

}  // namespace
}  // namespace kdn::kvbridge
