#pragma once
// A caller's KV buffers, described once, and the one place KV moves between
// a chunk's payload ([layer][K|V][token][kv_head][head_dim], kdn/kvbus/
// chunk.h) and them: token-major or head-major, K and V apart or
// interleaved (vLLM's concatenated last dimension is V's base one head_dim
// past K's), contiguous or paged by a block table, and f32, f16 or bf16
// on either side. What kdn's client library (kdn/client.h) and its Python
// adapters use. Thread-safe: functions over values; the caller keeps the
// buffers alive and unshared while a copy runs.

#include <cstdint>
#include <span>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"

namespace kdn::kvbus {

// Token t, KV head h, element d of layer l's K lives at
//   k[l] + (block(t) * stride_block + (t % block_tokens) * stride_token
//           + h * stride_head + d) elements of `dtype`
// (V the same from v[l]), where block(t) is block_table[t / block_tokens]
// for a paged layout and 0 for a contiguous one (block_tokens 0: t itself
// is the offset's token index). Strides are in elements, never negative;
// head_dim elements are contiguous.
struct KvLayout {
  DType dtype = DType::kF32;
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::vector<uint8_t*> k;  // one base per layer
  std::vector<uint8_t*> v;
  uint64_t buffer_bytes = 0;  // how many bytes each k[l] and v[l] may be written from its base
  int64_t stride_token = 0;
  int64_t stride_head = 0;
  int block_tokens = 0;  // 0: contiguous
  int64_t stride_block = 0;
  std::span<const int32_t> block_table;  // paged: the physical block of each logical block

  // The element offset of (token t, head 0, element 0); -1 when t has no
  // block in the table.
  int64_t TokenOffset(int64_t t) const;
};

// OK when `layout`'s layers, KV heads and head_dim are those given;
// INVALID_ARGUMENT naming both shapes otherwise. (CheckLayout's first test,
// apart, for a caller that must not read the bases of a wrong shape.)
Status CheckLayoutShape(const KvLayout& layout, int layers, int kv_heads, int head_dim);

// OK when `layout` is well formed and holds KV of the given shape;
// INVALID_ARGUMENT naming the first mismatch (a layer count, a head count,
// a missing base, a negative stride, heads that overlap) otherwise.
Status CheckLayout(const KvLayout& layout, int layers, int kv_heads, int head_dim);

// OK when tokens [first, first + count) all lie within the buffers (and,
// paged, within the block table); INVALID_ARGUMENT naming the first token
// that does not. CheckLayout first.
Status CheckTokens(const KvLayout& layout, int64_t first, int64_t count);

// Writes the KV of the first `count` tokens of a raw chunk (all of them
// when `count` is negative) into tokens [first, first + count) of
// `layout`, converting its dtype. INVALID_ARGUMENT for an encoded chunk, a
// shape other than the layout's, a count past the chunk's, or tokens past
// the buffers.
Status ChunkToLayout(const Chunk& chunk, int64_t first, const KvLayout& layout, int64_t count = -1);

// Reads tokens [first, first + count) of `layout` into `payload` (a raw
// chunk's payload of that many tokens, as `dtype`: ChunkInfo::
// payload_bytes() bytes). CheckLayout and CheckTokens first.
void LayoutToPayload(const KvLayout& layout, int64_t first, int64_t count, DType dtype,
                     uint8_t* payload);

// Converts `n` elements between KV dtypes (the same dtype: a copy).
void ConvertKv(const uint8_t* src, DType from, uint8_t* dst, DType to, size_t n);

}  // namespace kdn::kvbus
