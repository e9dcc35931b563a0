// The Prefiller's steering (docs/serving.md, "Steering a document"): a
// vector made from prompt pairs and stored under its name, a steer edit that
// stores a document's steered version beside the original, and a blend that
// reads the version a request names.
#include <gtest/gtest.h>

#include <cstring>

#include "kdn/kvbridge/steer.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/transfer_plan.h"
#include "kdn/prefill_worker/prefiller.h"
#include "kdn/testing/tiny_model.h"
#include "prefiller_rig.h"

namespace kdn::prefill_worker {
namespace {

using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;
using testing::HostStore;
using testing::kChunk;
using testing::Options;

constexpr kvbus::ChunkKey kFp{1, 2};

blend::SteeringVectorSpec VectorSpec(std::string name) {
  return {std::move(name),
          {1},
          {{RandomTokens(9, 256, 71), RandomTokens(8, 256, 72)},
           {RandomTokens(6, 256, 73), RandomTokens(11, 256, 74)}}};
}

InjectSpec MakeVector(blend::SteeringVectorSpec spec) {
  InjectSpec s;
  s.steering_vector = std::move(spec);
  return s;
}

InjectSpec SteerEdit(std::string vector, float strength) {
  InjectSpec s;
  s.steer = blend::SteerSpec{std::move(vector), strength};
  s.base_required = true;
  return s;
}

TEST(PrefillerSteering, AVectorIsMadeOncePerNameAndStoredAsTheEngineComputesIt) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  Prefiller p(*model, *store, kFp, Options());
  const blend::SteeringVectorSpec spec = VectorSpec("trust");
  auto made = p.Inject({}, "tenant", MakeVector(spec));
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  EXPECT_FALSE(made->already_held);

  auto chunk = store->Get(kvbus::SteeringVectorKey({kFp, "tenant", kChunk}, "trust"));
  ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
  auto stored = kvbus::SteeringFromChunk(**chunk);
  ASSERT_TRUE(stored.ok()) << stored.status().ToString();
  auto want = kvbridge::ValueSteeringVector(*model, "trust", spec.pairs, spec.layers);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(stored->values, want->values);
  EXPECT_EQ(stored->pairs, spec.pairs);
  EXPECT_EQ(stored->layers, spec.layers);
  // Not under another namespace.
  EXPECT_FALSE(store->Contains(kvbus::SteeringVectorKey({kFp, "", kChunk}, "trust")));

  // The same again is held, read ahead or not; other pairs under the name are refused.
  EXPECT_TRUE(p.Inject({}, "tenant", MakeVector(spec))->already_held);
  PrefillJob job;
  job.ns = "tenant";
  const InjectSpec again = MakeVector(spec);
  PrefetchedKv read = p.Prefetch(job, &again);
  ASSERT_NE(read.steering, nullptr);
  EXPECT_TRUE(p.Inject({}, "tenant", again, &read)->already_held);
  blend::SteeringVectorSpec other = spec;
  other.layers = {0, 1};
  EXPECT_EQ(p.Inject({}, "tenant", MakeVector(other)).status().code(),
            StatusCode::kFailedPrecondition);

  // Bad specs store nothing.
  const size_t chunks = store->Stats().chunks;
  for (blend::SteeringVectorSpec bad : {VectorSpec(""), VectorSpec("a b"), VectorSpec("x")}) {
    if (bad.name == "x") bad.layers = {model->config().num_layers};
    EXPECT_EQ(p.Inject({}, "", MakeVector(bad)).status().code(), StatusCode::kInvalidArgument)
        << bad.name;
  }
  blend::SteeringVectorSpec no_pairs = VectorSpec("y");
  no_pairs.pairs.clear();
  EXPECT_EQ(p.Inject({}, "", MakeVector(no_pairs)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Stats().chunks, chunks);
}

TEST(PrefillerSteering, ASteerEditStoresTheSteeredVersionBesideTheOriginal) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  Prefiller p(*model, *store, kFp, Options());
  const std::vector<int32_t> doc = RandomTokens(37, 256, 75);
  const kvbus::KeyContext ctx{kFp, "", kChunk};

  // The vector not held, then the document not held: refused, nothing stored.
  EXPECT_EQ(p.Inject(doc, "", SteerEdit("trust", 2)).status().code(),
            StatusCode::kFailedPrecondition);
  ASSERT_TRUE(p.Inject({}, "", MakeVector(VectorSpec("trust"))).ok());
  EXPECT_EQ(p.Inject(doc, "", SteerEdit("trust", 2)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store->Stats().chunks, 1u);
  ASSERT_TRUE(p.Inject(doc, "").ok());
  EXPECT_EQ(p.Inject(doc, "", SteerEdit("trust", 0)).status().code(), StatusCode::kInvalidArgument);

  const kvbus::ChunkKey doc_key = kvbus::SegmentKey(ctx, doc);
  auto original = store->Get(doc_key);
  ASSERT_TRUE(original.ok());
  const std::vector<uint8_t> before((*original)->payload().begin(), (*original)->payload().end());
  PrefillJob job;
  job.tokens = doc;
  const InjectSpec edit = SteerEdit("trust", 2);
  PrefetchedKv read = p.Prefetch(job, &edit);
  ASSERT_NE(read.inject_base, nullptr);
  ASSERT_NE(read.steering, nullptr);
  auto stored = p.Inject(doc, "", edit, &read);
  ASSERT_TRUE(stored.ok()) << stored.status().ToString();
  EXPECT_FALSE(stored->already_held);
  EXPECT_EQ(stored->stored_tokens, static_cast<int64_t>(doc.size()));
  EXPECT_TRUE(p.Inject(doc, "", edit)->already_held);

  // The steered version is the original with the vector added at its last
  // token (kvbridge::SteerChunkValues), under the steered key; the original stays.
  const kvbus::ChunkKey vector_key = kvbus::SteeringVectorKey(ctx, "trust");
  auto vector_chunk = store->Get(vector_key);
  ASSERT_TRUE(vector_chunk.ok());
  const kvbus::ChunkKey key =
      kvbus::SteeredKey(doc_key, kvbus::SteeringVectorId(**vector_chunk), 2.0f);
  auto got = store->Get(key);
  ASSERT_TRUE(got.ok());
  auto vector = kvbus::SteeringFromChunk(**vector_chunk);
  ASSERT_TRUE(vector.ok());
  auto want = kvbridge::SteerChunkValues(**original, *vector, 2.0f, 36, 1, key);
  ASSERT_TRUE(want.ok());
  ASSERT_EQ((*got)->payload().size(), (*want)->payload().size());
  EXPECT_EQ(
      std::memcmp((*got)->payload().data(), (*want)->payload().data(), (*want)->payload().size()),
      0);
  EXPECT_NE(std::memcmp((*got)->payload().data(), before.data(), before.size()), 0);
  auto kept = store->Get(doc_key);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(std::memcmp((*kept)->payload().data(), before.data(), before.size()), 0);
}

// The value row that a blend pushed for KV slot `slot` at `layer`.
std::vector<float> PushedValueRow(kvbus::HostTier& sink, const PrefillJob& job, int layer,
                                  int64_t slot) {
  auto s = sink.Get(kvbus::LayerSliceKey(kvbus::TransferRegionKey(job.transfer_id, 0), layer));
  EXPECT_TRUE(s.ok());
  if (!s.ok()) return {};
  const kvbus::ChunkInfo& info = (*s)->info();
  const size_t row = size_t{info.kv_heads} * info.head_dim;
  const auto* f = reinterpret_cast<const float*>((*s)->payload().data());
  const float* v = f + size_t{info.tokens} * row + static_cast<size_t>(slot) * row;  // K, then V
  return {v, v + row};
}

// A stored chunk's value row of token `t` at `layer`.
std::vector<float> StoredValueRow(const kvbus::Chunk& c, int layer, int64_t t) {
  const kvbus::ChunkInfo& info = c.info();
  const size_t row = size_t{info.kv_heads} * info.head_dim, half = size_t{info.tokens} * row;
  const auto* f = reinterpret_cast<const float*>(c.payload().data());
  const float* v = f + static_cast<size_t>(layer) * 2 * half + half + static_cast<size_t>(t) * row;
  return {v, v + row};
}

// A blend naming a document's steered version fuses that version's KV, and
// keeps the steered token's stored values past the check layer whatever its
// deviation (blend::Segment::pinned). A version not stored is refused, and
// nothing is stored in its place.
TEST(PrefillerSteering, ABlendNamingASteeredVersionFusesItsKv) {
  auto model = MakeModel("tiny");
  const std::vector<int32_t> doc = RandomTokens(40, 256, 76), other = RandomTokens(30, 256, 77);
  const std::vector<int32_t> question = RandomTokens(7, 256, 78);
  const kvbus::KeyContext ctx{kFp, "", kChunk};
  kvbus::HostTier sink(64u << 20);
  auto receiver = kvbus::Listen("tcp://127.0.0.1:0", sink);
  ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();

  PrefillJob job;
  job.tokens = {256};
  job.tokens.insert(job.tokens.end(), doc.begin(), doc.end());
  job.tokens.insert(job.tokens.end(), other.begin(), other.end());
  job.tokens.insert(job.tokens.end(), question.begin(), question.end());
  job.blend = BlendJob{};
  job.blend->head_tokens = 1;
  job.blend->segment_tokens = {40, 30};
  // Checked at layer 0: stored KV is used at layer 1, where the vector is;
  // every ratio recomputes the steered token unless it is pinned (its
  // deviation is the largest at this ratio, a steered row at 1.0).
  job.blend->check_layer = 0;
  job.blend->recompute_ratio = 1.0;
  job.sampling.temperature = 0;
  job.decode_endpoint = (*receiver)->endpoint();

  auto store = HostStore();
  Prefiller p(*model, *store, kFp, Options());
  ASSERT_TRUE(p.Inject(doc, "").ok());
  ASSERT_TRUE(p.Inject(other, "").ok());
  ASSERT_TRUE(p.Inject({}, "", MakeVector(VectorSpec("trust"))).ok());
  PrefillJob steered = job;
  steered.blend->steer = {blend::SteerSpec{"trust", 8}, std::nullopt};
  steered.transfer_id = "steered";
  auto missing = p.Run(steered);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("/v1/kdn/edit"), std::string::npos);
  ASSERT_TRUE(p.StoreNewChunks().ok());
  const kvbus::ChunkKey vector_key = kvbus::SteeringVectorKey(ctx, "trust");
  const kvbus::ChunkKey key = kvbus::SteeredKey(
      kvbus::SegmentKey(ctx, doc), kvbus::SteeringVectorId(**store->Get(vector_key)), 8.0f);
  EXPECT_FALSE(store->Contains(key)) << "a refused blend stored the plain KV as the steered";

  ASSERT_TRUE(p.Inject(doc, "", SteerEdit("trust", 8)).ok());
  PrefetchedKv read = p.Prefetch(steered);
  EXPECT_EQ(read.segments.count(key), 1u);
  auto out = p.Run(steered, &read);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->blended_tokens, 70);
  EXPECT_EQ(out->recomputed_tokens, 69) << "every cached token but the pinned one";
  ASSERT_TRUE(p.StoreNewChunks().ok());

  // The steered token (the document's last, slot 40) holds the steered
  // version's values at the vector's layer; the stored original's differ.
  auto steered_chunk = store->Get(key);
  auto original = store->Get(kvbus::SegmentKey(ctx, doc));
  ASSERT_TRUE(steered_chunk.ok() && original.ok());
  const std::vector<float> pushed = PushedValueRow(sink, steered, 1, 40);
  EXPECT_EQ(pushed, StoredValueRow(**steered_chunk, 1, 39));
  EXPECT_NE(pushed, StoredValueRow(**original, 1, 39));

  // The same blend of the plain document recomputes that token too.
  PrefillJob plain = job;
  plain.transfer_id = "plain";
  auto plain_out = p.Run(plain);
  ASSERT_TRUE(plain_out.ok());
  EXPECT_EQ(plain_out->recomputed_tokens, 70);
  EXPECT_NE(PushedValueRow(sink, plain, 1, 40), pushed);
  ASSERT_TRUE(p.StoreNewChunks().ok());

  // The vector gone from the KDN, its name made again from other pairs: the
  // versions of the old vector are not the new one's (a 400, not the old
  // steering under the new name).
  ASSERT_TRUE(store->host()->Erase(vector_key));
  steered.transfer_id = "no-vector";
  EXPECT_EQ(p.Run(steered).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(p.StoreNewChunks().ok());
  blend::SteeringVectorSpec remade = VectorSpec("trust");
  remade.pairs.pop_back();
  ASSERT_TRUE(p.Inject({}, "", MakeVector(remade)).ok());
  steered.transfer_id = "remade";
  auto stale = p.Run(steered);
  ASSERT_FALSE(stale.ok());
  EXPECT_NE(stale.status().message().find("/v1/kdn/edit"), std::string::npos);
  ASSERT_TRUE(p.StoreNewChunks().ok());
  EXPECT_TRUE(store->Contains(key)) << "the old version stays, under its own key";
}

}  // namespace
}  // namespace kdn::prefill_worker
