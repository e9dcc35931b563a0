// The Prefiller with documents: blend (CacheBlend over documents stored
// alone under segment keys, in any order) and inject (a document stored
// once, pruned or not), each also served by a prefetch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/transfer_plan.h"
#include "kdn/prefill_worker/prefiller.h"
#include "kdn/testing/tiny_model.h"
#include "prefiller_rig.h"

namespace kdn::prefill_worker {
namespace {

using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;
using testing::GreedyFirstToken;
using testing::HostStore;
using testing::kChunk;
using testing::Options;

// BOS, three documents and a question, as a blend job.
PrefillJob BlendJobOf(const std::vector<std::vector<int32_t>>& docs,
                      const std::vector<int32_t>& question, double ratio) {
  PrefillJob job;
  job.tokens = {256};
  BlendJob b;
  b.head_tokens = 1;
  for (const auto& d : docs) {
    job.tokens.insert(job.tokens.end(), d.begin(), d.end());
    b.segment_tokens.push_back(static_cast<int>(d.size()));
  }
  job.tokens.insert(job.tokens.end(), question.begin(), question.end());
  b.recompute_ratio = ratio;
  job.blend = b;
  job.sampling.temperature = 0;
  return job;
}

TEST(Prefiller, BlendStoresDocumentsAloneUnderSegmentKeysThenReusesThemInAnyOrder) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  const std::vector<std::vector<int32_t>> docs = {
      RandomTokens(40, 256, 11), RandomTokens(33, 256, 12), RandomTokens(50, 256, 13)};
  const auto question = RandomTokens(9, 256, 14);

  // First sight: no document is held, so everything is computed in full.
  auto first = p.Run(BlendJobOf(docs, question, 0.15));
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->cached_tokens, 0);
  EXPECT_EQ(first->blended_tokens, 0);
  EXPECT_EQ(first->computed_tokens, 1 + 123 + 9);
  PrefillJob plain;
  plain.tokens = BlendJobOf(docs, question, 0).tokens;
  EXPECT_EQ(first->first_token, GreedyFirstToken(*model, plain.tokens));
  ASSERT_TRUE(p.StoreNewChunks().ok());
  // Each document is stored on its own; nothing under prefix keys.
  const kvbus::KeyContext ctx{fp, "", kChunk};
  for (const auto& d : docs) {
    auto chunk = store->Get(kvbus::SegmentKey(ctx, d));
    ASSERT_TRUE(chunk.ok());
    EXPECT_EQ((*chunk)->info().tokens, d.size());
    EXPECT_EQ((*chunk)->info().position, 0);
  }
  EXPECT_EQ(store->Stats().chunks, 3u);

  // The documents in another order: all blended, 15% of them recomputed.
  const std::vector<std::vector<int32_t>> shuffled = {docs[2], docs[0], docs[1]};
  auto second = p.Run(BlendJobOf(shuffled, question, 0.15));
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->cached_tokens, 123);
  EXPECT_EQ(second->blended_tokens, 123);
  EXPECT_EQ(second->recomputed_tokens, 19);  // ceil(0.15 * 123)
  EXPECT_EQ(second->computed_tokens, 10);
  ASSERT_TRUE(p.StoreNewChunks().ok());
  EXPECT_EQ(store->Stats().chunks, 3u);  // the blended prompt is not stored

  // Ratio 1 recomputes everything: the first token of a full prefill.
  auto full = p.Run(BlendJobOf(shuffled, question, 1.0));
  ASSERT_TRUE(full.ok());
  PrefillJob shuffled_plain;
  shuffled_plain.tokens = BlendJobOf(shuffled, question, 0).tokens;
  EXPECT_EQ(full->recomputed_tokens, 123);
  EXPECT_EQ(full->first_token, GreedyFirstToken(*model, shuffled_plain.tokens));
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

TEST(Prefiller, ABlendOrInjectServedByAPrefetchGivesWhatItsOwnReadsGive) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  const std::vector<std::vector<int32_t>> docs = {RandomTokens(40, 256, 11),
                                                  RandomTokens(33, 256, 12)};
  const auto question = RandomTokens(9, 256, 14);
  PrefillJob inject;
  inject.tokens = docs[0];
  inject.ns = "";
  const InjectSpec plain;
  PrefetchedKv read = p.Prefetch(inject, &plain);
  EXPECT_FALSE(read.inject_held);
  auto injected = p.Inject(docs[0], "", nullptr, &read);
  ASSERT_TRUE(injected.ok()) << injected.status().ToString();
  EXPECT_FALSE(injected->already_held);
  read = p.Prefetch(inject, &plain);
  EXPECT_TRUE(read.inject_held);
  injected = p.Inject(docs[0], "", nullptr, &read);
  ASSERT_TRUE(injected.ok());
  EXPECT_TRUE(injected->already_held);

  // One document held, one not: read ahead, the blend fuses the one and
  // computes the other, as when it asks the store itself.
  const PrefillJob blend = BlendJobOf(docs, question, 0.15);
  read = p.Prefetch(blend);
  EXPECT_EQ(read.segments.size(), 1u);
  auto ahead = p.Run(blend, &read);
  ASSERT_TRUE(ahead.ok()) << ahead.status().ToString();
  p.WaitForStores();
  ASSERT_TRUE(p.StoreNewChunks().ok());  // stores the second document
  auto own = p.Run(blend);               // now both are held
  ASSERT_TRUE(own.ok());
  EXPECT_EQ(ahead->blended_tokens, 40);
  EXPECT_EQ(own->blended_tokens, 73);
  ASSERT_TRUE(p.StoreNewChunks().ok());
  // A read taken before this worker stored the second document still finds
  // it, in the host tier.
  auto late = p.Run(blend, &read);
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->blended_tokens, 73);
  EXPECT_EQ(late->first_token, own->first_token);
  ASSERT_TRUE(p.StoreNewChunks().ok());
  read = p.Prefetch(blend);
  EXPECT_EQ(read.segments.size(), 2u);
  auto again = p.Run(blend, &read);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->blended_tokens, own->blended_tokens);
  EXPECT_EQ(again->first_token, own->first_token);
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

// A blend job's fused KV as its decode worker's receiver got it: one slice
// of `kv_tokens` tokens per layer, named for the job's transfer from
// position 0, and the bytes the outcome says it sent.
void ExpectFusedKvArrived(engine::CpuEngine& model, kvbus::HostTier& sink, const PrefillJob& job,
                          const PrefillOutcome& out, uint32_t kv_tokens) {
  const int layers = model.config().num_layers;
  const uint64_t token_bytes = model.kv_cache().token_stride() * 2 * sizeof(float);
  EXPECT_EQ(out.kv_bytes_sent, kv_tokens * token_bytes * layers);
  const kvbus::ChunkKey xfer = kvbus::TransferRegionKey(job.transfer_id, 0);
  for (int l = 0; l < layers; ++l) {
    auto slice = sink.Get(kvbus::LayerSliceKey(xfer, l));
    ASSERT_TRUE(slice.ok()) << "layer " << l;
    EXPECT_EQ((*slice)->info().tokens, kv_tokens);
  }
}

TEST(Prefiller, BlendPushesTheFusedKvUnderTheTransferKeyOnly) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  kvbus::HostTier sink(64u << 20);
  auto receiver = kvbus::Listen("tcp://127.0.0.1:0", sink);
  ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();
  const std::vector<std::vector<int32_t>> docs = {RandomTokens(40, 256, 21),
                                                  RandomTokens(30, 256, 22)};
  for (const auto& d : docs) ASSERT_FALSE(p.Inject(d, "")->already_held);
  PrefillJob job = BlendJobOf(docs, RandomTokens(7, 256, 23), 0.15);
  job.decode_endpoint = (*receiver)->endpoint();
  job.transfer_id = "blend-1";
  auto out = p.Run(job);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->blended_tokens, 70);
  ExpectFusedKvArrived(*model, sink, job, *out, 78);
  const auto prefix = kvbus::PrefixKeys({fp, "", kChunk}, job.tokens);
  for (int l = 0; l < model->config().num_layers; ++l) {
    for (const auto& k : prefix) EXPECT_FALSE(sink.Contains(kvbus::LayerSliceKey(k, l)));
  }
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

TEST(Prefiller, InjectStoresADocumentOnceAndRefusesBadOnes) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  const auto doc = RandomTokens(60, 256, 31);
  auto first = p.Inject(doc, "tenant");
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_FALSE(first->already_held);
  EXPECT_EQ(first->stored_tokens, 60);
  auto again = p.Inject(doc, "tenant");
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->already_held);
  EXPECT_EQ(again->stored_tokens, 0);
  EXPECT_TRUE(store->Contains(kvbus::SegmentKey({fp, "tenant", kChunk}, doc)));
  EXPECT_FALSE(store->Contains(kvbus::SegmentKey({fp, "", kChunk}, doc)));
  EXPECT_EQ(p.Inject(std::vector<int32_t>{}, "").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p.Inject(std::vector<int32_t>{1, 2, 999}, "").status().code(),
            StatusCode::kInvalidArgument);
  // A blend job whose documents leave no question is refused.
  PrefillJob job = BlendJobOf({doc}, {}, 0.15);
  EXPECT_EQ(p.Run(job).status().code(), StatusCode::kInvalidArgument);
}

// Whether two chunks hold the same KV bytes.
bool SamePayload(const kvbus::Chunk& a, const kvbus::Chunk& b) {
  return a.payload().size() == b.payload().size() &&
         std::equal(a.payload().begin(), a.payload().end(), b.payload().begin());
}

// An erratum edit (InjectSpec::base_tokens): the note's KV computed on top of
// the stored original is the KV one prefill of the document and the note
// gives, stored under the segment key of both; the original stays.
TEST(Prefiller, AnErratumIsComputedOnTheStoredDocumentAsOnePrefillOfBoth) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  const auto doc = RandomTokens(45, 256, 61);
  const auto note = RandomTokens(7, 256, 62);
  std::vector<int32_t> edited = doc;
  edited.insert(edited.end(), note.begin(), note.end());
  InjectSpec edit;
  edit.base_tokens = static_cast<int64_t>(doc.size());
  edit.base_required = true;

  // The original not held: an edit is refused and stores nothing.
  auto missing = p.Inject(edited, "", edit);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status().ToString();
  EXPECT_EQ(store->Stats().chunks, 0u);

  ASSERT_TRUE(p.Inject(doc, "").ok());
  const auto original_before = store->Get(kvbus::SegmentKey({fp, "", kChunk}, doc));
  ASSERT_TRUE(original_before.ok());
  PrefillJob job;
  job.tokens = edited;
  PrefetchedKv read = p.Prefetch(job, &edit);
  ASSERT_NE(read.inject_base, nullptr);
  auto stored = p.Inject(edited, "", edit, &read);
  ASSERT_TRUE(stored.ok()) << stored.status().ToString();
  EXPECT_FALSE(stored->already_held);
  EXPECT_EQ(stored->stored_tokens, static_cast<int64_t>(edited.size()));
  EXPECT_TRUE(p.Inject(edited, "", edit)->already_held);

  // The reference: the document and the note in one prefill.
  auto ref_store = HostStore();
  Prefiller ref(*model, *ref_store, fp, Options());
  ASSERT_TRUE(ref.Inject(edited, "").ok());
  const kvbus::ChunkKey key = kvbus::SegmentKey({fp, "", kChunk}, edited);
  auto got = store->Get(key);
  auto want = ref_store->Get(key);
  ASSERT_TRUE(got.ok() && want.ok());
  EXPECT_TRUE(SamePayload(**got, **want)) << "the erratum's KV is not the one-prefill KV";
  // The original is untouched, under its own key.
  auto original = store->Get(kvbus::SegmentKey({fp, "", kChunk}, doc));
  ASSERT_TRUE(original.ok());
  EXPECT_TRUE(SamePayload(**original, **original_before));
  EXPECT_EQ((*original)->info().tokens, doc.size());

  // Not required: a missing original is computed with the note.
  auto other_store = HostStore();
  Prefiller q(*model, *other_store, fp, Options());
  InjectSpec optional_base = edit;
  optional_base.base_required = false;
  ASSERT_TRUE(q.Inject(edited, "", optional_base).ok());
  auto whole = other_store->Get(key);
  ASSERT_TRUE(whole.ok());
  EXPECT_TRUE(SamePayload(**whole, **want));

  // Bad bases: none left for the note, a pruned erratum.
  InjectSpec all = edit;
  all.base_tokens = static_cast<int64_t>(edited.size());
  EXPECT_EQ(p.Inject(edited, "", all).status().code(), StatusCode::kInvalidArgument);
  InjectSpec pruned = edit;
  pruned.prune = prune::PruneSpec{.method = "knorm", .keep = 0.5};
  EXPECT_EQ(p.Inject(RandomTokens(60, 256, 63), "", pruned).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(Prefiller, InjectWithPruneStoresAPrunedChunkThatABlendPushesWithoutItsDroppedTokens) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  kvbus::HostTier sink(64u << 20);
  auto receiver = kvbus::Listen("tcp://127.0.0.1:0", sink);
  ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();
  const std::vector<std::vector<int32_t>> docs = {RandomTokens(40, 256, 41),
                                                  RandomTokens(30, 256, 42)};
  const prune::PruneSpec half{
      .method = "expected_attention", .keep = 0.5, .granularity = prune::Granularity::kToken};
  auto pruned = p.Inject(docs[0], "", &half);
  ASSERT_TRUE(pruned.ok()) << pruned.status().ToString();
  EXPECT_FALSE(pruned->already_held);
  EXPECT_EQ(pruned->stored_tokens, 20);  // floor(40 * 0.5), its 4 sinks among them
  auto whole = p.Inject(docs[1], "");
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(whole->stored_tokens, 30);
  auto chunk = store->Get(kvbus::SegmentKey({fp, "", kChunk}, docs[0]));
  ASSERT_TRUE(chunk.ok());
  const kvbus::ChunkInfo& info = (*chunk)->info();
  EXPECT_TRUE(info.pruned());
  EXPECT_EQ(info.tokens, 20u);
  EXPECT_EQ(info.logical(), 40u);
  for (uint32_t j = 0; j < 4; ++j) EXPECT_EQ(info.kept[j], j) << "the sinks are kept";
  // A blend reads it as a document, a prefix lookup never.
  EXPECT_TRUE(kvbus::SegmentChunkFits(**chunk, fp, 40, kdn::DType::kF32));
  EXPECT_FALSE(kvbus::ChunkFits(**chunk, fp, 20, kdn::DType::kF32));
  // Injected again with or without pruning: held, nothing computed.
  EXPECT_TRUE(p.Inject(docs[0], "")->already_held);

  PrefillJob job = BlendJobOf(docs, RandomTokens(7, 256, 43), 0.15);
  job.decode_endpoint = (*receiver)->endpoint();
  job.transfer_id = "pruned-blend";
  auto out = p.Run(job);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->blended_tokens, 70);
  EXPECT_EQ(out->pruned_tokens, 20);
  EXPECT_EQ(out->kv_tokens, 78 - 20);
  ExpectFusedKvArrived(*model, sink, job, *out, 58);
  ASSERT_TRUE(p.StoreNewChunks().ok());
}

// A blend's emphasis (docs/serving.md, "Emphasis") is on the sequence of
// its fused KV: recomputing every document token (ratio 1) gives the first
// token of one prefill with the same bias. Over a document stored pruned,
// whose spans would not be its KV slots, it is refused.
// The largest difference between the last layer's KV a blend pushed and
// that of one prefill of its prompt, with `bias` on it or none.
float LastLayerDistance(engine::CpuEngine& model, kvbus::HostTier& sink, const PrefillJob& job,
                        const engine::KvSequence::AttentionBias* bias) {
  const int last = model.config().num_layers - 1;
  auto pushed = sink.Get(kvbus::LayerSliceKey(kvbus::TransferRegionKey(job.transfer_id, 0), last));
  EXPECT_TRUE(pushed.ok());
  engine::KvSequence seq = model.kv_cache().NewSequence();
  if (bias != nullptr) {
    EXPECT_TRUE(seq.SetAttentionBias(*bias).ok());
  }
  std::vector<float> logits;
  EXPECT_TRUE(model.Prefill(seq, job.tokens, {}, &logits).ok());
  auto want = kvbridge::LayerSliceFromPagedKv(model.kv_cache(), seq, 0, seq.length(), last, {},
                                              {1, 2}, kdn::DType::kF32);
  EXPECT_TRUE(want.ok());
  if (!pushed.ok() || !want.ok()) return INFINITY;
  const std::span<const uint8_t> a = (*pushed)->payload(), b = (*want)->payload();
  EXPECT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i + sizeof(float) <= std::min(a.size(), b.size()); i += sizeof(float)) {
    float x, y;
    std::memcpy(&x, a.data() + i, sizeof x);
    std::memcpy(&y, b.data() + i, sizeof y);
    worst = std::max(worst, std::fabs(x - y));
  }
  return worst;
}

// A blend's emphasis (docs/serving.md, "Emphasis") is on the sequence of
// its fused KV: recomputing every document token (ratio 1) gives the KV and
// the first token of one prefill with the same bias. Over a document
// stored pruned, whose spans would not be its KV slots, it is refused.
TEST(Prefiller, ABlendsEmphasisBiasesItsPrefillAndIsRefusedOverPrunedKv) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  const kvbus::ChunkKey fp{1, 2};
  Prefiller p(*model, *store, fp, Options());
  kvbus::HostTier sink(64u << 20);
  auto receiver = kvbus::Listen("tcp://127.0.0.1:0", sink);
  ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();
  const std::vector<std::vector<int32_t>> docs = {RandomTokens(40, 256, 51),
                                                  RandomTokens(30, 256, 52)};
  for (const auto& d : docs) ASSERT_TRUE(p.Inject(d, "").ok());
  const model::ModelConfig& c = model->config();
  const blend::Emphasis emphasis{
      {{5, 15}, {45, 60}},
      c.num_heads,
      std::vector<float>(static_cast<size_t>(c.num_layers) * c.num_heads, 4.0f)};
  const engine::KvSequence::AttentionBias bias{emphasis.spans, emphasis.heads, emphasis.bias};
  const std::vector<int32_t> question = RandomTokens(7, 256, 53);
  PrefillJob job = BlendJobOf(docs, question, 1.0);
  job.blend->emphasis = emphasis;
  job.decode_endpoint = (*receiver)->endpoint();
  job.transfer_id = "emphasized";
  auto out = p.Run(job);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->blended_tokens, 70);
  EXPECT_EQ(out->first_token, GreedyFirstToken(*model, job.tokens, &bias));
  EXPECT_LT(LastLayerDistance(*model, sink, job, &bias), 1e-4f);
  EXPECT_GT(LastLayerDistance(*model, sink, job, nullptr), 1e-2f) << "the bias changes nothing";
  ASSERT_TRUE(p.StoreNewChunks().ok());

  const prune::PruneSpec half{
      .method = "expected_attention", .keep = 0.5, .granularity = prune::Granularity::kToken};
  const std::vector<int32_t> third = RandomTokens(40, 256, 54);
  ASSERT_TRUE(p.Inject(third, "", &half).ok());
  PrefillJob over_pruned = BlendJobOf({third}, question, 0.15);
  over_pruned.blend->emphasis = blend::Emphasis{{{5, 15}}, emphasis.heads, emphasis.bias};
  auto refused = p.Run(over_pruned);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("pruned"), std::string::npos);
}

TEST(Prefiller, InjectRefusesABadPruneSpec) {
  auto model = MakeModel("tiny");
  auto store = HostStore();
  Prefiller p(*model, *store, kvbus::ChunkKey{1, 2}, Options());
  const auto doc = RandomTokens(30, 256, 51);
  for (const prune::PruneSpec& bad :
       {prune::PruneSpec{.method = "snapkv", .keep = 0.5},
        prune::PruneSpec{.method = "knorm", .keep = 0},
        prune::PruneSpec{.method = "knorm", .keep = 1.5},
        prune::PruneSpec{.method = "knorm", .keep = 0.5, .sinks = -1},
        prune::PruneSpec{.method = "kvzip", .keep = 0.5},  // without its prompts
        prune::PruneSpec{.method = "knorm", .keep = 0.5, .sinks = 30}}) {
    EXPECT_EQ(p.Inject(doc, "", &bad).status().code(), StatusCode::kInvalidArgument)
        << bad.method << " " << bad.keep << " " << bad.sinks;
  }
  // KVzip's repeat pass must fit the context (tiny's 2,048) beside the text.
  const prune::PruneSpec kvzip{.method = "kvzip",
                               .keep = 0.5,
                               .kvzip_first = {1, 2, 3},
                               .kvzip_next = {4, 5},
                               .kvzip_suffix = {6}};
  EXPECT_EQ(p.Inject(RandomTokens(1100, 256, 52), "", &kvzip).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store->Stats().chunks, 0u);
  // The key-norm method needs no query hooks: it prunes the same way.
  const prune::PruneSpec knorm{.method = "knorm", .keep = 0.25};
  auto ok = p.Inject(doc, "", &knorm);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->stored_tokens, 7);  // floor(30 * 0.25)
}

}  // namespace
}  // namespace kdn::prefill_worker
