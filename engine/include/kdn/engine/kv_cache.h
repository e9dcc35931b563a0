#pragma once
// Paged KV cache: a pool of fixed-size blocks (16 tokens) per layer, and the
// sequences that own lists of them.
//
// Layout of one layer's pool, K and V apart:
//   [block][slot in block][kv_head][head_dim]   (fp32 on the CPU backend)
// so one block of one layer is the token-major slice a KV chunk stores
// ([token][kv_head][head_dim]), and a chunk converts to blocks by copies.
//
// Not thread-safe: the engine that owns a cache serialises access to it.

#include <cstdint>
#include <memory>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::engine {

inline constexpr int kKvBlockTokens = 16;

class PagedKvCache;

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
  const std::vector<int32_t>& blocks() const { return blocks_; }
  // Frees every block; length becomes 0.
  void Reset();
  // Drops the KV of positions >= new_length (keeps whole blocks that remain
  // in use). new_length must be <= length().
  void Truncate(int64_t new_length);

 private:
  friend class PagedKvCache;
  PagedKvCache* cache_ = nullptr;
  std::vector<int32_t> blocks_;
  int64_t length_ = 0;
};

class PagedKvCache {
 public:
  PagedKvCache(int num_layers, int num_kv_heads, int head_dim, int num_blocks);

  int num_layers() const { return num_layers_; }
  int num_kv_heads() const { return num_kv_heads_; }
  int head_dim() const { return head_dim_; }
  int num_blocks() const { return num_blocks_; }
  int free_blocks() const { return static_cast<int>(free_.size()); }
  // Floats in one token's K (or V) of one layer.
  int64_t token_stride() const { return static_cast<int64_t>(num_kv_heads_) * head_dim_; }
  int64_t block_stride() const { return token_stride() * kKvBlockTokens; }

  // A new, empty sequence bound to this cache.
  KvSequence NewSequence();
  // Makes `seq` hold room for `new_length` tokens, taking blocks as needed.
  // ResourceExhausted (and `seq` unchanged) when too few blocks are free.
  Status Reserve(KvSequence& seq, int64_t new_length);
  // Marks the first `length` tokens of `seq` as holding KV. length <= reserved.
  void SetLength(KvSequence& seq, int64_t length);

  float* Key(int layer, int32_t block) { return &k_[layer][block * block_stride()]; }
  float* Value(int layer, int32_t block) { return &v_[layer][block * block_stride()]; }
  const float* Key(int layer, int32_t block) const { return &k_[layer][block * block_stride()]; }
  const float* Value(int layer, int32_t block) const { return &v_[layer][block * block_stride()]; }
  // Pointers to the K/V of one token of a sequence at a position it reserved.
  float* KeyAt(const KvSequence& seq, int layer, int64_t pos) {
    return Key(layer, seq.blocks_[pos / kKvBlockTokens]) + (pos % kKvBlockTokens) * token_stride();
  }
  float* ValueAt(const KvSequence& seq, int layer, int64_t pos) {
    return Value(layer, seq.blocks_[pos / kKvBlockTokens]) + (pos % kKvBlockTokens) * token_stride();
  }

 private:
  friend class KvSequence;
  void Release(std::vector<int32_t>& blocks, size_t keep);

  const int num_layers_, num_kv_heads_, head_dim_, num_blocks_;
  std::vector<std::vector<float>> k_, v_;  // [layer] -> pool
  std::vector<int32_t> free_;              // stack of free block ids
};

}  // namespace kdn::engine
