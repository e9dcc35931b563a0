#include "kdn/engine/kv_cache.h"

#include <cassert>

namespace kdn::engine {

KvSequence::~KvSequence() { Reset(); }

KvSequence::KvSequence(KvSequence&& o) noexcept
    : cache_(o.cache_), blocks_(std::move(o.blocks_)), length_(o.length_) {
  o.cache_ = nullptr;
  o.blocks_.clear();
  o.length_ = 0;
}

KvSequence& KvSequence::operator=(KvSequence&& o) noexcept {
  if (this != &o) {
    Reset();
    cache_ = o.cache_;
    blocks_ = std::move(o.blocks_);
    length_ = o.length_;
    o.cache_ = nullptr;
    o.blocks_.clear();
    o.length_ = 0;
  }
  return *this;
}

void KvSequence::Reset() {
  if (cache_ != nullptr) cache_->Release(blocks_, 0);
  blocks_.clear();
  length_ = 0;
}

void KvSequence::Truncate(int64_t new_length) {
  assert(new_length >= 0 && new_length <= length_);
  length_ = new_length;
  const size_t keep = static_cast<size_t>((new_length + kKvBlockTokens - 1) / kKvBlockTokens);
  if (cache_ != nullptr) cache_->Release(blocks_, keep);
}

PagedKvCache::PagedKvCache(int num_layers, int num_kv_heads, int head_dim, int num_blocks)
    : num_layers_(num_layers), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
      num_blocks_(num_blocks), k_(num_layers), v_(num_layers) {
  for (int l = 0; l < num_layers; ++l) {
    k_[l].assign(static_cast<size_t>(num_blocks) * block_stride(), 0.0f);
    v_[l].assign(static_cast<size_t>(num_blocks) * block_stride(), 0.0f);
  }
  free_.reserve(num_blocks);
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

KvSequence PagedKvCache::NewSequence() {
  KvSequence s;
  s.cache_ = this;
  return s;
}

Status PagedKvCache::Reserve(KvSequence& seq, int64_t new_length) {
  assert(seq.cache_ == this);
  const size_t need = static_cast<size_t>((new_length + kKvBlockTokens - 1) / kKvBlockTokens);
  if (need <= seq.blocks_.size()) return Status::Ok();
  const size_t more = need - seq.blocks_.size();
  if (more > free_.size()) {
    return ResourceExhausted("KV cache: " + std::to_string(more) + " more blocks needed for " +
                             std::to_string(new_length) + " tokens, " +
                             std::to_string(free_.size()) + " of " + std::to_string(num_blocks_) +
                             " free");
  }
  for (size_t i = 0; i < more; ++i) {
    seq.blocks_.push_back(free_.back());
    free_.pop_back();
  }
  return Status::Ok();
}

void PagedKvCache::SetLength(KvSequence& seq, int64_t length) {
  assert(length <= static_cast<int64_t>(seq.blocks_.size()) * kKvBlockTokens);
  seq.length_ = length;
}

void PagedKvCache::Release(std::vector<int32_t>& blocks, size_t keep) {
  while (blocks.size() > keep) {
    free_.push_back(blocks.back());
    blocks.pop_back();
  }
}

}  // namespace kdn::engine
