#pragma once
// A sequence's place in a paged KV cache (kdn/engine/kv_cache.h): its block
// table, the length of the KV it holds, and what attention over it takes
// into account beside the KV: the position its next token sits at, the
// holes of KV pruned per head, an attention bias. Not thread-safe, as the
// cache.

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "kdn/common/kv_block.h"
#include "kdn/common/status.h"

namespace kdn::engine {

using kdn::kKvBlockTokens;

class KvCache;

// A sequence's view of the cache: its block table and how many tokens of KV
// it holds. Move-only; gives its blocks back when destroyed or Reset.
class KvSequence {
 public:
  KvSequence() = default;
  ~KvSequence();
  KvSequence(KvSequence&& other) noexcept;
  KvSequence& operator=(KvSequence&& other) noexcept;
  KvSequence(const KvSequence&) = delete;
  KvSequence& operator=(const KvSequence&) = delete;

  int64_t length() const { return length_; }
  // The position (RoPE's) of the next token appended: length(), unless the
  // sequence holds pruned KV (kdn/prune/prune.h), whose kept tokens keep the
  // positions they were computed at while the KV is shorter than the text it
  // stands for; the next token then sits past the text, not past the KV.
  // Attention is over the KV held (causal by slot), whatever the positions.
  int64_t next_position() const { return length_ + position_shift_; }
  // next_position() - length(): what every token appended from now on adds
  // to its slot to get its position.
  int64_t position_shift() const { return position_shift_; }
  // Makes next_position() `position`; INVALID_ARGUMENT below length().
  // Truncate keeps the shift (Truncate(0) and Reset clear it).
  Status SetNextPosition(int64_t position);
  // Pruned KV whose layers and KV heads kept different tokens (prune's
  // kLayer, kHead and kGlobal granularities): some slots hold no KV in some
  // heads. Those are holes, which attention skips as if they were not
  // there. SetHeadTokens: of slots [0, slots), layer l's KV head h holds its
  // tokens in the first head_tokens[l * kv_heads + h], and the rest are
  // holes (what prune::CompactKv makes); INVALID_ARGUMENT unless slots <=
  // length() and there is one count in [0, slots] per layer and KV head.
  // SetHoles: any holes, `holes[(l * kv_heads + h) * slots + s]` not 0 for
  // a hole (a blend's fused per-head segments: kdn/blend/blend.h);
  // INVALID_ARGUMENT unless slots <= length() and there is one per layer,
  // KV head and slot. Slots from `slots` on are every head's. FillHoles
  // marks slot `slot` of layer `layer` held in every head (a row pass's
  // row, computed there). Truncate shortens the holes with the slots; once
  // no hole is left (and after Reset) has_holes() is false.
  Status SetHeadTokens(int64_t slots, std::vector<int32_t> head_tokens);
  Status SetHoles(int64_t slots, std::vector<uint8_t> holes);
  void FillHoles(int layer, int64_t slot);
  // Layer `layer`'s KV head `kv_head`: one byte per slot below hole_end(),
  // not 0 for a hole; empty where the sequence has none.
  std::span<const uint8_t> Holes(int layer, int kv_head) const;
  bool has_holes() const { return hole_count_ > 0; }
  int64_t hole_end() const { return hole_end_; }
  // An additive bias on attention scores, as PASTA steers attention (docs/
  // kvbus.md, "Editing stored KV"): for every query row computed over this
  // sequence (prefill, decode, row passes), at layer l and query head h,
  // each key whose slot lies in one of `spans` ([begin, end) slots,
  // ascending, disjoint, not empty) has bias[l * heads + h] added to its
  // score before the softmax. `heads` is the model's query heads, which the
  // engine checks at use. INVALID_ARGUMENT for bad spans or a bias that is
  // not one finite value per layer and head; no spans clears it. Reset
  // clears it; Truncate keeps it. Both engines apply it (the CUDA engine
  // through its reference attention kernels, ScoreBiasCuda).
  struct AttentionBias {
    std::vector<std::pair<int64_t, int64_t>> spans;
    int heads = 0;
    std::vector<float> bias;  // [layer][head]
  };
  Status SetAttentionBias(AttentionBias bias);
  // Null when none is set.
  const AttentionBias* attention_bias() const { return bias_.spans.empty() ? nullptr : &bias_; }
  const std::vector<int32_t>& blocks() const { return blocks_; }
  // Tokens of room its blocks give.
  int64_t reserved() const { return static_cast<int64_t>(blocks_.size()) * kKvBlockTokens; }
  // Frees every block; length becomes 0.
  void Reset();
  // Drops the KV of positions >= new_length (keeps whole blocks that remain
  // in use). new_length must be <= length().
  void Truncate(int64_t new_length);

 private:
  friend class KvCache;
  KvCache* cache_ = nullptr;
  std::vector<int32_t> blocks_;
  int64_t length_ = 0;
  int64_t position_shift_ = 0;
  // Clears the holes when none is left.
  void DropHolesIfNone();
  int64_t hole_end_ = 0;        // the holes' slots, at most length_
  int64_t hole_count_ = 0;      // holes (bytes not 0) in holes_
  std::vector<uint8_t> holes_;  // [layer][kv_head][hole_end_], when hole_count_ > 0
  AttentionBias bias_;          // no spans: none
};

}  // namespace kdn::engine
