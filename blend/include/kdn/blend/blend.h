#pragma once
// CacheBlend's fusion step (arXiv 2405.16444; docs/design.md, "Blend"): a
// prompt made of segments, each with the KV it had when computed on its own
// (positions 0..n-1) or with none, then a suffix. The fused prefill
//   1. places each cached segment's KV at its position in the prompt and
//      rotates its K there (RoPE is a rotation: a delta rotation suffices);
//   2. recomputes every token at layers 0..check_layer and, at the check
//      layer, scores each cached token by how far its recomputed KV is from
//      the cached KV;
//   3. keeps the top recompute_ratio of cached tokens by that deviation, plus
//      every uncached token and the suffix;
//   4. recomputes only those at the later layers, over the fused cache.
// With check_layers (the paper's progressive filtering), steps 2-3 repeat at
// each check layer: the rows still recomputed are scored again there and
// narrowed to that check's ratio (blend::CheckSchedule).
// Which cached tokens go on is the selection policy's (SelectionPolicy:
// CacheBlend's deviation by default); a policy that needs no deviation
// (boundary, EPIC's first tokens of each document; query, the tokens the
// question attends to) chooses before layer 0, and its tokens alone are
// recomputed, at every layer, with no check. For the query policies the
// question is first prefilled over the cached documents' KV as it is (full
// reuse), apart from the prompt, and its attention to each cached token
// (QuestionAttention) is what the policy chooses by; that pass's KV goes.
// recompute_ratio 1 is a full prefill; recompute_ratio 0 is full reuse (no
// cached token is recomputed at any layer). With overlap_load, a loader
// thread places (copies and rotates) layer l+1 of the cached KV while layer l
// computes; layers below the check layer are recomputed for every token when
// recompute_ratio > 0, so their cached KV is never placed.
//
// Not thread-safe: runs on the model's thread.

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/blend/spec.h"
#include "kdn/engine/engine.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbridge/head_pruned.h"
#include "kdn/kvbridge/paged_chunks.h"

namespace kdn::blend {

struct Segment {
  std::vector<int32_t> tokens;
  // Its KV computed alone (all layers, from position chunk->info().position),
  // or null: computed in full like the suffix. A pruned chunk (kdn/prune)
  // holds the KV of some of the tokens only; the rest have none in the
  // fused prompt, which keeps every token's position. Pruned per head, a
  // token any head kept has a slot, and the heads that did not keep it a
  // hole there (KvSequence::SetHoles) until its row is recomputed, which
  // fills it in every head; the query selections do not take such a chunk.
  std::shared_ptr<const kvbus::Chunk> kv;
  // Slots of `kv` (ascending offsets into its tokens) whose stored KV the
  // blend keeps wherever it places cached KV: never chosen for recompute (a
  // steered document's steered token, docs/serving.md, "Steering a
  // document"). Below the first check layer every row is computed anew,
  // these too.
  std::vector<int64_t> pinned;
};

// The KV slots a cached segment's chunk fills in a fused prompt: its tokens,
// or pruned per head a slot per token any head kept.
int64_t SegmentSlots(const kvbus::ChunkInfo& info);

// A cached document's place in the prompt, in KV slots (a pruned segment
// has fewer slots than tokens; positions and slots agree otherwise).
struct DocumentSpan {
  int64_t first = 0;
  int64_t count = 0;
  friend bool operator==(const DocumentSpan&, const DocumentSpan&) = default;
};

// What a selection policy sees at a check (or, for a policy without checks,
// before layer 0): the current rows (their prompt `positions`), which
// positions came from a cache, each current row's KV deviation at this
// layer (empty before layer 0), the cached documents' spans, and the
// budget: how many of the current cached rows to keep.
struct SelectionInput {
  std::span<const int64_t> positions;
  const std::vector<bool>& cached;
  std::span<const float> deviation;
  std::span<const DocumentSpan> documents;
  int64_t keep = 0;
  uint64_t seed = 0;
  // The query policies': the question's attention to each KV slot of the
  // prompt (QuestionAttention; 0 for uncached slots), indexed by position.
  std::span<const float> attention;
};

// A selection policy returns the rows to go on with: indices into the
// current rows, ascending, every uncached row among them. It may keep more
// cached rows than the budget (boundary tokens are kept whatever it is).
using SelectionPolicy = std::function<std::vector<int64_t>(const SelectionInput&)>;

// The policies of blend::BlendSelection, each a pure function:
// deviation (the `keep` cached rows of largest deviation, ties to the
// earlier row), random (`keep` drawn with the seed), boundary (the first K
// positions of each document, the budget not used) and boundary+deviation
// (those, and the rest of the budget by deviation).
std::vector<int64_t> DeviationRows(const SelectionInput& in);
std::vector<int64_t> RandomRows(const SelectionInput& in);
std::vector<int64_t> BoundaryRows(const SelectionInput& in, int boundary_tokens);
std::vector<int64_t> BoundaryDeviationRows(const SelectionInput& in, int boundary_tokens);
// query (the `keep` cached rows the question attends to most, ties to the
// earlier row) and query+boundary (the first K of each document, and the
// rest of the budget by attention).
std::vector<int64_t> QueryRows(const SelectionInput& in);
std::vector<int64_t> QueryBoundaryRows(const SelectionInput& in, int boundary_tokens);
SelectionPolicy PolicyFor(const blend::BlendSelection& selection);

// A cached segment's KV as the blend places it: the chunk, the KV slot it
// starts at, its slots, and the rotation from the position its K was
// computed at to its place in the prompt. A chunk pruned per head
// (docs/kvbus.md, "Per-head kept tokens") takes a slot per offset any head
// kept (`head_slots`, kvbridge::HeadPrunedSlots; empty for other chunks),
// each head's others being holes.
struct PlacedSegment {
  const kvbus::Chunk* kv = nullptr;
  int64_t at = 0;
  int64_t len = 0;
  int64_t delta = 0;
  std::vector<uint32_t> head_slots;
};

// The question's attention to the cached segments' tokens: `question`
// (positions `question_position` on) prefilled in a sequence of its own over
// the segments' KV as cached, placed at every layer and rotated to their
// places (full reuse; the prompt's uncached tokens absent), its queries
// kept; for each cached slot, the softmax weight the question's tokens pay
// it, summed over the tokens, query heads and layers. Indexed by the slot in
// the prompt (`slots` of them; 0 for uncached slots). The pass's KV is
// dropped. An engine's error (RESOURCE_EXHAUSTED when the pool has no room
// for the pass) as it is.
Result<std::vector<float>> QuestionAttention(engine::Engine& model,
                                             std::span<const PlacedSegment> segments, int64_t slots,
                                             std::span<const int32_t> question,
                                             int64_t question_position);

// A quality target (BlendSpec::max_kl; docs/blend.md, "A quality target"):
// at the first check every cached token's deviation is known; the residual
// of a ratio is the share of the cached tokens' total deviation that the
// tokens it does not recompute hold. The KL a blend ends with grows with
// it, about linearly: KL ~ kl_per_residual x residual, the slope fitted
// offline (kdn-bench blend-fidelity --calibrate) on prompts other than
// those the benchmark reports. The ratio is raised along kRatioLadder, from
// the request's, until the predicted KL is at most max_kl (1: all).
inline constexpr double kRatioLadder[] = {0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0};
// SmolLM2-135M-Instruct's slope: 0.333 over 160 prompt-rows of 20
// calibration prompts (kdn-bench blend-fidelity --seed 2 --calibrate;
// bench/results/cpu-2026-11-27/blend-calibration.txt, docs/blend.md).
// Another model's is measured the same way and given to the prefill worker
// (--blend-kl-per-residual).
inline constexpr double kDefaultKlPerResidual = 0.333;

// The residual of keeping the `keep` cached rows of largest deviation:
// the rest's share of the total deviation (0 when the total is 0).
double ResidualShare(std::span<const float> cached_deviation, int64_t keep);
// The first ratio of kRatioLadder at or past `start` (start itself first)
// whose residual times kl_per_residual is at most max_kl; 1 if none is.
double TargetRatio(std::span<const float> cached_deviation, double start, double max_kl,
                   double kl_per_residual);

struct BlendOptions {
  // The request's ratio, checks and selection (blend::CheckSchedule and
  // blend::BlendSelection); its head and segment lengths are the
  // segments' own here.
  blend::BlendSpec spec;
  // A policy in place of spec.selection's (tests, benches); with checks
  // unless spec.selection says none.
  SelectionPolicy policy;
  uint64_t seed = 0;                               // for random selection
  double kl_per_residual = kDefaultKlPerResidual;  // for spec.max_kl
  bool overlap_load = true;
  // Called on the caller's thread once layer l of the fused KV is final in
  // `seq` (for pushing it to a decode worker); an error stops the blend.
  std::function<Status(int layer)> on_layer;
};

struct BlendResult {
  std::vector<float> logits;  // of the prompt's last token
  int cached_tokens = 0;      // tokens whose KV came from a segment's cache
  // Tokens of cached segments with no KV at all: pruned away when stored.
  int dropped_tokens = 0;
  // Of those, recomputed past the last check layer (with boundary
  // selection, the boundary tokens, recomputed at every layer).
  int recomputed_tokens = 0;
  // The ratio used: the request's, or the one its quality target chose.
  double recompute_ratio = 0;
  // At the first check (deviation selections): the residual of that ratio
  // (ResidualShare), the quantity a quality target bounds.
  double residual = 0;
  // Cached tokens kept at each check, in order (the last is recomputed_tokens).
  std::vector<int> kept_at_check;
  // The query policies' question pass: its tokens, computed at every layer
  // once more (count them with the recomputed tokens for the compute a
  // blend costs).
  int question_pass_tokens = 0;
  int computed_tokens = 0;  // uncached segments and the suffix
  // Where the time went: the layers up to the check and the choice of rows,
  // and of all the layers' time, how long the compute waited for the
  // loader to place a layer's cached KV.
  double check_seconds = 0;
  double load_wait_seconds = 0;
};

// Fuses `segments` then `suffix` (non-empty) into `seq` (empty on entry; it
// holds the fused prompt's KV on return). INVALID_ARGUMENT for a chunk that
// does not fit the model or its segment, a bad ratio or check layer.
Result<BlendResult> BlendPrefill(engine::Engine& model, engine::KvSequence& seq,
                                 std::span<const Segment> segments, std::span<const int32_t> suffix,
                                 const BlendOptions& options);

// KL(p || q) of the next-token distributions softmax(p_logits) and
// softmax(q_logits): how far a blend's prediction is from full prefill's.
double KlDivergence(std::span<const float> p_logits, std::span<const float> q_logits);

}  // namespace kdn::blend
