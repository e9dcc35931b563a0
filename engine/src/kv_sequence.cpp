#include "kdn/engine/kv_sequence.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <string>
#include <utility>

#include "kdn/engine/kv_cache.h"

namespace kdn::engine {

KvSequence::~KvSequence() { Reset(); }

KvSequence::KvSequence(KvSequence&& o) noexcept
    : cache_(o.cache_),
      blocks_(std::move(o.blocks_)),
      length_(o.length_),
      position_shift_(std::exchange(o.position_shift_, 0)),
      hole_end_(std::exchange(o.hole_end_, 0)),
      hole_count_(std::exchange(o.hole_count_, 0)),
      holes_(std::move(o.holes_)),
      bias_(std::exchange(o.bias_, {})) {
  o.cache_ = nullptr;
  o.blocks_.clear();
  o.length_ = 0;
  o.holes_.clear();
}

KvSequence& KvSequence::operator=(KvSequence&& o) noexcept {
  if (this != &o) {
    Reset();
    cache_ = o.cache_;
    blocks_ = std::move(o.blocks_);
    length_ = o.length_;
    position_shift_ = std::exchange(o.position_shift_, 0);
    hole_end_ = std::exchange(o.hole_end_, 0);
    hole_count_ = std::exchange(o.hole_count_, 0);
    holes_ = std::move(o.holes_);
    bias_ = std::exchange(o.bias_, {});
    o.cache_ = nullptr;
    o.blocks_.clear();
    o.length_ = 0;
    o.holes_.clear();
  }
  return *this;
}

void KvSequence::Reset() {
  if (cache_ != nullptr) cache_->Release(blocks_, 0);
  blocks_.clear();
  length_ = 0;
  position_shift_ = 0;
  hole_end_ = 0;
  hole_count_ = 0;
  holes_.clear();
  bias_ = {};
}

Status KvSequence::SetAttentionBias(AttentionBias bias) {
  if (bias.spans.empty()) {
    bias_ = {};
    return Status::Ok();
  }
  int64_t last_end = 0;
  for (const auto& [begin, end] : bias.spans) {
    if (begin < last_end || end <= begin) {
      return InvalidArgument(
          "sequence: attention bias spans must be non-empty [begin, end) slot "
          "ranges, ascending and disjoint");
    }
    last_end = end;
  }
  const size_t want = cache_ == nullptr || bias.heads <= 0
                          ? 0
                          : static_cast<size_t>(cache_->num_layers()) * bias.heads;
  if (want == 0 || bias.bias.size() != want ||
      !std::all_of(bias.bias.begin(), bias.bias.end(), [](float b) { return std::isfinite(b); })) {
    return InvalidArgument(
        "sequence: an attention bias needs one finite value per layer and "
        "query head (" +
        std::to_string(bias.bias.size()) + " for " + std::to_string(bias.heads) + " heads)");
  }
  bias_ = std::move(bias);
  return Status::Ok();
}

Status KvSequence::SetNextPosition(int64_t position) {
  if (position < length_) {
    return InvalidArgument("sequence: next position " + std::to_string(position) +
                           " is below its " + std::to_string(length_) + " tokens of KV");
  }
  position_shift_ = position - length_;
  return Status::Ok();
}

Status KvSequence::SetHeadTokens(int64_t slots, std::vector<int32_t> head_tokens) {
  const size_t heads =
      cache_ == nullptr ? 0 : size_t(cache_->num_layers()) * cache_->num_kv_heads();
  bool fits = slots > 0 && slots <= length_ && head_tokens.size() == heads;
  for (int32_t n : head_tokens) fits = fits && n >= 0 && n <= slots;
  if (!fits) {
    return InvalidArgument("sequence: " + std::to_string(head_tokens.size()) +
                           " head token counts over " + std::to_string(slots) + " slots, for " +
                           std::to_string(heads) + " layers' KV heads and " +
                           std::to_string(length_) + " tokens of KV");
  }
  std::vector<uint8_t> holes(heads * static_cast<size_t>(slots), 0);
  for (size_t i = 0; i < heads; ++i) {
    std::fill(holes.begin() + static_cast<int64_t>(i) * slots + head_tokens[i],
              holes.begin() + static_cast<int64_t>(i + 1) * slots, uint8_t{1});
  }
  return SetHoles(slots, std::move(holes));
}

Status KvSequence::SetHoles(int64_t slots, std::vector<uint8_t> holes) {
  const size_t heads =
      cache_ == nullptr ? 0 : size_t(cache_->num_layers()) * cache_->num_kv_heads();
  if (slots <= 0 || slots > length_ || holes.size() != heads * static_cast<size_t>(slots)) {
    return InvalidArgument("sequence: " + std::to_string(holes.size()) + " hole marks over " +
                           std::to_string(slots) + " slots, for " + std::to_string(heads) +
                           " layers' KV heads and " + std::to_string(length_) + " tokens of KV");
  }
  hole_end_ = slots;
  holes_ = std::move(holes);
  hole_count_ = std::count_if(holes_.begin(), holes_.end(), [](uint8_t b) { return b != 0; });
  DropHolesIfNone();
  return Status::Ok();
}

void KvSequence::DropHolesIfNone() {
  if (hole_count_ > 0) return;
  hole_end_ = 0;
  hole_count_ = 0;
  holes_.clear();
}

void KvSequence::FillHoles(int layer, int64_t slot) {
  if (hole_count_ == 0 || slot >= hole_end_) return;
  const int heads = cache_->num_kv_heads();
  for (int h = 0; h < heads; ++h) {
    uint8_t& b = holes_[(static_cast<size_t>(layer) * heads + h) * hole_end_ + slot];
    hole_count_ -= b != 0;
    b = 0;
  }
  DropHolesIfNone();
}

std::span<const uint8_t> KvSequence::Holes(int layer, int kv_head) const {
  if (hole_count_ == 0) return {};
  return std::span<const uint8_t>(holes_).subspan(
      (static_cast<size_t>(layer) * cache_->num_kv_heads() + kv_head) * hole_end_,
      static_cast<size_t>(hole_end_));
}

void KvSequence::Truncate(int64_t new_length) {
  assert(new_length >= 0 && new_length <= length_);
  length_ = new_length;
  if (new_length == 0) position_shift_ = 0;
  if (new_length < hole_end_) {
    // Each head's row of marks, cut to the slots left.
    const size_t rows = holes_.size() / static_cast<size_t>(hole_end_);
    std::vector<uint8_t> cut(rows * static_cast<size_t>(new_length));
    for (size_t i = 0; i < rows; ++i) {
      std::copy_n(holes_.begin() + static_cast<int64_t>(i) * hole_end_, new_length,
                  cut.begin() + static_cast<int64_t>(i) * new_length);
    }
    hole_end_ = new_length;
    holes_ = std::move(cut);
    hole_count_ = std::count_if(holes_.begin(), holes_.end(), [](uint8_t b) { return b != 0; });
    DropHolesIfNone();
  }
  const size_t keep = static_cast<size_t>((new_length + kKvBlockTokens - 1) / kKvBlockTokens);
  if (cache_ != nullptr) cache_->Release(blocks_, keep);
}

}  // namespace kdn::engine
