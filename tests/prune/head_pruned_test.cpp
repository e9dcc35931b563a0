// KV pruned per head in a chunk (docs/kvbus.md, "Per-head kept tokens"):
// what prune::CompactKv makes of a text whose heads kept tokens of their
// own is stored with only those heads' KV, read back into the same
// sequence (the same answers, bit for bit), and refused where a reader
// would take it for every head's KV.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kdn/blend/blend.h"
#include "kdn/kvbridge/head_pruned.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbus/prefix_io.h"
#include "kdn/prune/prune.h"
#include "kdn/prune/prune_text.h"
#include "kdn/testing/tiny_model.h"

namespace kdn::prune {
namespace {

using kdn::testing::AnswerOver;
using kdn::testing::MakeModel;
using kdn::testing::RandomTokens;

constexpr kvbus::ChunkKey kKey{1, 2}, kFingerprint{3, 4};

// Scores drawn from `seed`: each head's choice its own.
Scores RandomScores(const model::ModelConfig& c, int64_t tokens, uint32_t seed) {
  Scores s{c.num_layers, c.num_kv_heads, tokens, {}};
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  s.v.resize(size_t(c.num_layers) * c.num_kv_heads * tokens);
  for (float& v : s.v) v = u(rng);
  return s;
}

struct Pruned {
  KeptTokens kept;
  engine::KvSequence seq;
};

// A text of `n` tokens computed from position 0 and compacted at
// `granularity` (random scores; `sinks` kept in every head).
Pruned PruneRandom(engine::CpuEngine& model, int64_t n, Granularity granularity, uint32_t seed,
                   int sinks = 4, std::vector<int32_t> text = {}) {
  engine::CpuKvCache& cache = model.kv_cache();
  if (text.empty()) text = RandomTokens(static_cast<int>(n), model.config().vocab_size, seed);
  engine::KvSequence whole = cache.NewSequence();
  std::vector<float> logits;
  EXPECT_TRUE(model.Prefill(whole, text, {}, &logits).ok());
  auto kept = SelectKept(RandomScores(model.config(), n, seed), 0.25, sinks, granularity);
  EXPECT_TRUE(kept.ok()) << kept.status().ToString();
  Pruned out{*kept, cache.NewSequence()};
  EXPECT_TRUE(CompactKv(cache, whole, out.kept, &out.seq).ok());
  return out;
}

std::shared_ptr<const kvbus::Chunk> ChunkOf(engine::CpuEngine& model, const Pruned& p,
                                            kdn::DType dtype = kdn::DType::kF32) {
  HeadKept hk = HeadKeptOf(p.kept);
  auto chunk = kvbridge::HeadPrunedChunkFromPagedKv(
      model.kv_cache(), p.seq, static_cast<uint32_t>(p.kept.logical), std::move(hk.counts),
      std::move(hk.positions), kKey, kFingerprint, dtype);
  EXPECT_TRUE(chunk.ok()) << chunk.status().ToString();
  if (!chunk.ok()) return nullptr;
  // What a tier hands back: the bytes, parsed.
  auto parsed =
      kvbus::Chunk::Parse(std::vector<uint8_t>((*chunk)->bytes().begin(), (*chunk)->bytes().end()));
  EXPECT_TRUE(parsed.ok()) << parsed.status().ToString();
  return parsed.ok() ? *parsed : nullptr;
}

class HeadPrunedChunk : public ::testing::TestWithParam<Granularity> {};

TEST_P(HeadPrunedChunk, ReadsBackIntoTheSequenceItWasWrittenFrom) {
  auto model = MakeModel("tiny");
  const auto& c = model->config();
  engine::CpuKvCache& cache = model->kv_cache();
  Pruned p = PruneRandom(*model, 48, GetParam(), 11);
  auto chunk = ChunkOf(*model, p);
  ASSERT_NE(chunk, nullptr);
  const kvbus::ChunkInfo& info = chunk->info();
  EXPECT_TRUE(info.per_head());
  EXPECT_EQ(info.logical(), 48u);
  EXPECT_EQ(int64_t{info.tokens}, p.kept.kept);
  // Only what each head kept is stored: its K and V, f32.
  uint64_t pairs = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    for (int h = 0; h < c.num_kv_heads; ++h) pairs += p.kept.count(l, h);
  }
  EXPECT_EQ(info.head_slots, pairs);
  EXPECT_EQ(chunk->payload().size(), pairs * 2 * c.head_dim * sizeof(float));
  if (GetParam() == Granularity::kGlobal) {
    EXPECT_LT(pairs, uint64_t(c.num_layers) * c.num_kv_heads * info.tokens) << "no holes drawn";
  }
  engine::KvSequence loaded = cache.NewSequence();
  ASSERT_TRUE(kvbridge::HeadPrunedChunkToPagedKv(*chunk, cache, loaded).ok());
  EXPECT_EQ(loaded.length(), p.seq.length());
  EXPECT_EQ(loaded.next_position(), 48);
  EXPECT_EQ(loaded.has_holes(), p.seq.has_holes());
  for (int l = 0; l < c.num_layers; ++l) {
    for (int h = 0; h < c.num_kv_heads; ++h) {
      const auto a = loaded.Holes(l, h), b = p.seq.Holes(l, h);
      EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end())) << l << " " << h;
    }
  }
  const auto question = RandomTokens(12, c.vocab_size, 12);
  EXPECT_EQ(AnswerOver(*model, loaded, question), AnswerOver(*model, p.seq, question));
}

INSTANTIATE_TEST_SUITE_P(Granularities, HeadPrunedChunk,
                         ::testing::Values(Granularity::kLayer, Granularity::kHead,
                                           Granularity::kGlobal),
                         [](const auto& info) { return std::string(GranularityName(info.param)); });

TEST(HeadPrunedChunkTest, Bf16RoundsAsAnyChunkDoes) {
  auto model = MakeModel("tiny");
  engine::CpuKvCache& cache = model->kv_cache();
  Pruned p = PruneRandom(*model, 40, Granularity::kGlobal, 21);
  auto chunk = ChunkOf(*model, p, kdn::DType::kBF16);
  ASSERT_NE(chunk, nullptr);
  EXPECT_EQ(chunk->payload().size(), chunk->info().head_slots * 2 * model->config().head_dim * 2);
  engine::KvSequence loaded = cache.NewSequence();
  ASSERT_TRUE(kvbridge::HeadPrunedChunkToPagedKv(*chunk, cache, loaded).ok());
  // Each kept K and V within bf16's rounding of the compacted one.
  const int hd = model->config().head_dim;
  for (int l = 0; l < model->config().num_layers; ++l) {
    for (int h = 0; h < model->config().num_kv_heads; ++h) {
      for (int64_t j = 0; j < p.kept.count(l, h); ++j) {
        for (int i = 0; i < hd; ++i) {
          const float want = cache.KeyAt(p.seq, l, j)[h * hd + i],
                      got = cache.KeyAt(loaded, l, j)[h * hd + i];
          EXPECT_NEAR(got, want, std::abs(want) / 128 + 1e-30f);
        }
      }
    }
  }
}

TEST(HeadPrunedChunkTest, NothingTakesItForEveryHeadsKvOfItsTokens) {
  auto model = MakeModel("tiny");
  engine::CpuKvCache& cache = model->kv_cache();
  Pruned p = PruneRandom(*model, 40, Granularity::kHead, 31);
  auto chunk = ChunkOf(*model, p);
  ASSERT_NE(chunk, nullptr);
  // Not the prefix path's, nor the whole-chunk copy's; a blend's segment
  // it is (below).
  EXPECT_FALSE(kvbus::ChunkFits(*chunk, kFingerprint, 40, kdn::DType::kF32));
  EXPECT_TRUE(kvbus::SegmentChunkFits(*chunk, kFingerprint, 40, kdn::DType::kF32));
  engine::KvSequence seq = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(seq, 40).ok());
  EXPECT_EQ(kvbridge::ChunkToPagedKv(*chunk, cache, seq, 0).code(), StatusCode::kInvalidArgument);
  // The query selections' pass reads no holes.
  std::vector<blend::Segment> segments(1);
  segments[0].tokens = RandomTokens(40, model->config().vocab_size, 31);
  segments[0].kv = chunk;
  engine::KvSequence fused = cache.NewSequence();
  blend::BlendOptions query;
  query.spec.recompute_ratio = 0.15;
  query.spec.selection = *blend::ParseBlendSelection("query");
  auto r = blend::BlendPrefill(*model, fused, segments, RandomTokens(4, 50, 1), query);
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
  // A per-head load wants an empty sequence, and a per-head chunk.
  EXPECT_EQ(kvbridge::HeadPrunedChunkToPagedKv(*chunk, cache, seq).code(),
            StatusCode::kInvalidArgument);
  cache.SetLength(seq, 8);
  auto whole = kvbridge::ChunkFromPagedKv(cache, seq, 0, 8, kKey, kFingerprint, kdn::DType::kF32);
  ASSERT_TRUE(whole.ok());
  engine::KvSequence other = cache.NewSequence();
  EXPECT_EQ(kvbridge::HeadPrunedChunkToPagedKv(**whole, cache, other).code(),
            StatusCode::kInvalidArgument);
}

TEST(HeadPrunedChunkTest, AWriterRefusesASequenceThatIsNotWhatItsCountsSay) {
  auto model = MakeModel("tiny");
  engine::CpuKvCache& cache = model->kv_cache();
  Pruned p = PruneRandom(*model, 40, Granularity::kGlobal, 41);
  ASSERT_TRUE(p.seq.has_holes());
  const auto build = [&](HeadKept hk, uint32_t logical = 40) {
    return kvbridge::HeadPrunedChunkFromPagedKv(cache, p.seq, logical, std::move(hk.counts),
                                                std::move(hk.positions), kKey, kFingerprint,
                                                kdn::DType::kF32)
        .status()
        .code();
  };
  EXPECT_EQ(build(HeadKeptOf(p.kept)), StatusCode::kOk);
  EXPECT_EQ(build(HeadKeptOf(p.kept), 41), StatusCode::kInvalidArgument);  // another text
  // A head whose count is one short: its hole would not start there.
  HeadKept shorter = HeadKeptOf(p.kept);
  size_t at = 0;
  while (shorter.counts[at] < 2) ++at;
  size_t first = 0;
  for (size_t i = 0; i <= at; ++i) first += shorter.counts[i];
  --shorter.counts[at];
  shorter.positions.erase(shorter.positions.begin() + static_cast<int64_t>(first) - 1);
  EXPECT_EQ(build(shorter), StatusCode::kInvalidArgument);
  // Positions out of order within a head.
  HeadKept swapped = HeadKeptOf(p.kept);
  std::swap(swapped.positions[0], swapped.positions[1]);
  EXPECT_EQ(build(swapped), StatusCode::kInvalidArgument);
}

// A blend over a per-head segment (kdn/blend/blend.h): a slot per token
// any head kept, holes in the heads that did not keep it.
struct HeadBlend {
  std::vector<int32_t> head, doc, question;
  Pruned pruned;
  std::shared_ptr<const kvbus::Chunk> chunk;
  std::vector<uint32_t> slots;  // the offsets any head kept
};
HeadBlend MakeHeadBlend(engine::CpuEngine& model, int sinks, uint32_t seed) {
  const int V = model.config().vocab_size;
  HeadBlend b{RandomTokens(3, V, seed),
              RandomTokens(48, V, seed + 1),
              RandomTokens(6, V, seed + 2),
              {},
              nullptr,
              {}};
  b.pruned = PruneRandom(model, 48, Granularity::kGlobal, seed, sinks, b.doc);
  b.chunk = ChunkOf(model, b.pruned);
  if (b.chunk != nullptr) b.slots = kvbridge::HeadPrunedSlots(b.chunk->info());
  return b;
}
std::vector<blend::Segment> SegmentsOf(const HeadBlend& b) {
  std::vector<blend::Segment> s(2);
  s[0].tokens = b.head;
  s[1].tokens = b.doc;
  s[1].kv = b.chunk;
  return s;
}

// Full reuse: the question over the document's kept KV, as over the
// sequence the chunk loads into (each head's tokens in its first slots):
// the same keys and values, attended in another order.
TEST(HeadPrunedBlend, FullReuseAnswersAsTheLoadedSequenceDoes) {
  auto model = MakeModel("tiny");
  engine::CpuKvCache& cache = model->kv_cache();
  const HeadBlend b = MakeHeadBlend(*model, 4, 51);
  ASSERT_NE(b.chunk, nullptr);
  ASSERT_LT(b.chunk->info().tokens, b.slots.size()) << "the heads kept the same tokens";
  std::vector<blend::Segment> segments = SegmentsOf(b);
  segments.erase(segments.begin());  // the document alone, at position 0
  engine::KvSequence fused = cache.NewSequence();
  blend::BlendOptions reuse;
  reuse.spec.recompute_ratio = 0;
  auto r = blend::BlendPrefill(*model, fused, segments, b.question, reuse);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(fused.length(), static_cast<int64_t>(b.slots.size() + b.question.size()));
  EXPECT_EQ(fused.next_position(), 48 + 6);
  EXPECT_EQ(r->dropped_tokens, static_cast<int>(48 - b.slots.size()));
  EXPECT_TRUE(fused.has_holes());
  engine::KvSequence loaded = cache.NewSequence();
  ASSERT_TRUE(kvbridge::HeadPrunedChunkToPagedKv(*b.chunk, cache, loaded).ok());
  std::vector<float> want;
  ASSERT_TRUE(model->Prefill(loaded, b.question, {}, &want).ok());
  EXPECT_LT(kdn::testing::RelError(r->logits.data(), want.data(), want.size()), 1e-5);

  // The holes as a prefill worker sends them and a decode worker sets them.
  const int64_t slots = fused.length();
  const std::string bits = kvbridge::PackHoles(cache, fused, slots);
  const auto& c = model->config();
  EXPECT_EQ(static_cast<int64_t>(bits.size()), (c.num_layers * c.num_kv_heads * slots + 7) / 8);
  engine::KvSequence placed = cache.NewSequence();
  ASSERT_TRUE(cache.Reserve(placed, slots).ok());
  cache.SetLength(placed, slots);
  ASSERT_TRUE(kvbridge::UnpackHoles(bits, slots, cache, placed).ok());
  for (int l = 0; l < c.num_layers; ++l) {
    for (int g = 0; g < c.num_kv_heads; ++g) {
      const auto want_holes = fused.Holes(l, g), got_holes = placed.Holes(l, g);
      for (int64_t s = 0; s < slots; ++s) {
        const bool want_hole = s < static_cast<int64_t>(want_holes.size()) && want_holes[s] != 0;
        EXPECT_EQ(s < static_cast<int64_t>(got_holes.size()) && got_holes[s] != 0, want_hole);
      }
    }
  }
  EXPECT_EQ(kvbridge::UnpackHoles(bits.substr(1), slots, cache, placed).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(kvbridge::PackHoles(cache, loaded, loaded.length()).empty() == !loaded.has_holes());
}

// Recomputing every slot is a prefill of the tokens some head kept, each
// at its own position: the recomputed rows fill their holes in every head.
TEST(HeadPrunedBlend, RecomputingEverySlotIsAPrefillOfTheTokensKept) {
  auto model = MakeModel("tiny");
  engine::CpuKvCache& cache = model->kv_cache();
  const HeadBlend b = MakeHeadBlend(*model, 4, 61);
  ASSERT_NE(b.chunk, nullptr);
  engine::KvSequence want_seq = cache.NewSequence();
  std::vector<float> want;
  ASSERT_TRUE(model->Prefill(want_seq, b.head, {}, &want).ok());
  for (uint32_t t : b.slots) {
    ASSERT_TRUE(want_seq.SetNextPosition(3 + t).ok());
    ASSERT_TRUE(model->Prefill(want_seq, std::span(&b.doc[t], 1), {}, &want).ok());
  }
  ASSERT_TRUE(want_seq.SetNextPosition(3 + 48).ok());
  ASSERT_TRUE(model->Prefill(want_seq, b.question, {}, &want).ok());
  engine::KvSequence fused = cache.NewSequence();
  blend::BlendOptions all;
  all.spec.recompute_ratio = 1;
  all.spec.check_layer = 0;
  auto r = blend::BlendPrefill(*model, fused, SegmentsOf(b), b.question, all);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(fused.has_holes());
  EXPECT_LT(kdn::testing::RelError(r->logits.data(), want.data(), want.size()), 1e-5);
}

// A blend that recomputes some of the document's tokens (its first K, by
// boundary selection) gives them every head's KV, as a full prefill of the
// prompt's kept tokens computes it (their context is recomputed too), and
// keeps each head's own set, with its holes, for the others.
TEST(HeadPrunedBlend, RecomputedTokensGetFullHeadsAndTheOthersKeepTheirHeadsSets) {
  auto model = MakeModel("tiny");
  const auto& c = model->config();
  engine::CpuKvCache& cache = model->kv_cache();
  // No sinks: the first tokens are held by some heads only.
  const HeadBlend b = MakeHeadBlend(*model, 0, 71);
  ASSERT_NE(b.chunk, nullptr);
  constexpr int kBoundary = 6;
  engine::KvSequence part = cache.NewSequence(), full = cache.NewSequence();
  blend::BlendOptions boundary;
  boundary.spec.recompute_ratio = 0.15;
  boundary.spec.selection = *blend::ParseBlendSelection("boundary:" + std::to_string(kBoundary));
  auto r = blend::BlendPrefill(*model, part, SegmentsOf(b), b.question, boundary);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->recomputed_tokens, kBoundary);
  blend::BlendOptions all;
  all.spec.recompute_ratio = 1;
  all.spec.check_layer = 0;
  ASSERT_TRUE(blend::BlendPrefill(*model, full, SegmentsOf(b), b.question, all).ok());
  const std::vector<uint8_t> stored =
      kvbridge::HeadPrunedHoles(b.chunk->info(), b.slots);  // [layer][head][slot]
  const int64_t at = 3, n = static_cast<int64_t>(b.slots.size());
  const int hd = c.head_dim;
  int holes_seen = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    for (int g = 0; g < c.num_kv_heads; ++g) {
      const std::span<const uint8_t> holes = part.Holes(l, g);
      for (int64_t s = 0; s < n; ++s) {
        const bool was_hole = stored[(size_t(l) * c.num_kv_heads + g) * n + s] != 0;
        const bool hole = !holes.empty() && holes[at + s] != 0;
        if (s < kBoundary) {
          EXPECT_FALSE(hole) << "layer " << l << " head " << g << " slot " << s;
          holes_seen += was_hole;
          for (int i = 0; i < hd; ++i) {
            EXPECT_NEAR(cache.KeyAt(part, l, at + s)[g * hd + i],
                        cache.KeyAt(full, l, at + s)[g * hd + i], 1e-4f);
            EXPECT_NEAR(cache.ValueAt(part, l, at + s)[g * hd + i],
                        cache.ValueAt(full, l, at + s)[g * hd + i], 1e-4f);
          }
        } else {
          EXPECT_EQ(hole, was_hole) << "layer " << l << " head " << g << " slot " << s;
        }
      }
    }
  }
  EXPECT_GT(holes_seen, 0) << "no recomputed token filled a hole";
}

}  // namespace
}  // namespace kdn::prune
