#include "kdn/kvbus/kv_layout.h"

#include <cstring>
#include <string>

#include "kdn/common/half.h"

namespace kdn::kvbus {
namespace {

float LoadF(const uint8_t* p, DType t) {
  if (t == DType::kF32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == DType::kF16 ? F16ToF32(h) : Bf16ToF32(h);
}

void StoreF(uint8_t* p, DType t, float f) {
  if (t == DType::kF32) {
    std::memcpy(p, &f, 4);
    return;
  }
  const uint16_t h = t == DType::kF16 ? F32ToF16(f) : F32ToBf16(f);
  std::memcpy(p, &h, 2);
}

std::string Str(int64_t v) { return std::to_string(v); }

}  // namespace

void ConvertKv(const uint8_t* src, DType from, uint8_t* dst, DType to, size_t n) {
  if (from == to) {
    std::memcpy(dst, src, n * static_cast<size_t>(DTypeSize(from)));
    return;
  }
  const size_t a = static_cast<size_t>(DTypeSize(from)), b = static_cast<size_t>(DTypeSize(to));
  for (size_t i = 0; i < n; ++i) StoreF(dst + i * b, to, LoadF(src + i * a, from));
}

int64_t KvLayout::TokenOffset(int64_t t) const {
  if (block_tokens <= 0) return t * stride_token;
  const int64_t logical = t / block_tokens;
  if (logical >= static_cast<int64_t>(block_table.size())) return -1;
  const int32_t physical = block_table[static_cast<size_t>(logical)];
  if (physical < 0) return -1;
  return physical * stride_block + (t % block_tokens) * stride_token;
}

Status CheckLayoutShape(const KvLayout& l, int layers, int kv_heads, int head_dim) {
  if (l.layers != layers || l.kv_heads != kv_heads || l.head_dim != head_dim) {
    return InvalidArgument("the KV layout is " + Str(l.layers) + " layers x " + Str(l.kv_heads) +
                           " KV heads x head_dim " + Str(l.head_dim) + "; the model's KV is " +
                           Str(layers) + " x " + Str(kv_heads) + " x " + Str(head_dim));
  }
  return Status::Ok();
}

Status CheckLayout(const KvLayout& l, int layers, int kv_heads, int head_dim) {
  KDN_RETURN_IF_ERROR(CheckLayoutShape(l, layers, kv_heads, head_dim));
  if (l.k.size() != static_cast<size_t>(layers) || l.v.size() != static_cast<size_t>(layers)) {
    return InvalidArgument("the KV layout needs one K and one V buffer per layer (" + Str(layers) +
                           "), not " + Str(static_cast<int64_t>(l.k.size())) + " and " +
                           Str(static_cast<int64_t>(l.v.size())));
  }
  for (int i = 0; i < layers; ++i) {
    if (l.k[static_cast<size_t>(i)] == nullptr || l.v[static_cast<size_t>(i)] == nullptr) {
      return InvalidArgument("the KV layout's layer " + Str(i) + " has a null buffer");
    }
  }
  if (l.stride_token < 0 || l.stride_head < 0 || l.stride_block < 0 || l.block_tokens < 0) {
    return InvalidArgument("the KV layout has a negative stride or block size");
  }
  // Elements of one head are contiguous; two heads of a token, or two
  // tokens of a block, may not overlap.
  if (kv_heads > 1 && l.stride_head < head_dim) {
    return InvalidArgument("the KV layout's head stride " + Str(l.stride_head) +
                           " is under head_dim " + Str(head_dim) + ": heads would overlap");
  }
  if (l.block_tokens != 1 && l.stride_token < head_dim) {
    return InvalidArgument("the KV layout's token stride " + Str(l.stride_token) +
                           " is under head_dim " + Str(head_dim) + ": tokens would overlap");
  }
  if (l.block_tokens > 0 && l.stride_block <= 0) {
    return InvalidArgument("a paged KV layout needs a block stride");
  }
  return Status::Ok();
}

Status CheckTokens(const KvLayout& l, int64_t first, int64_t count) {
  const uint64_t elems = l.buffer_bytes / static_cast<uint64_t>(DTypeSize(l.dtype));
  const int64_t span = int64_t{l.kv_heads - 1} * l.stride_head + l.head_dim;
  for (int64_t t = first; t < first + count; ++t) {
    const int64_t off = l.TokenOffset(t);
    if (off < 0) {
      return InvalidArgument("token " + Str(t) + " has no block in the KV layout's block table (" +
                             Str(static_cast<int64_t>(l.block_table.size())) + " blocks of " +
                             Str(l.block_tokens) + ")");
    }
    if (static_cast<uint64_t>(off + span) > elems) {
      return InvalidArgument("token " + Str(t) + " lies past the KV buffers' " +
                             Str(static_cast<int64_t>(l.buffer_bytes)) + " bytes");
    }
  }
  return Status::Ok();
}

namespace {

// Calls f(layout element pointer, payload element index) for each
// (layer, K|V, token, head) row of head_dim elements.
template <typename F>
void ForEachRow(const KvLayout& l, int64_t first, int64_t count, F&& f) {
  const size_t es = static_cast<size_t>(DTypeSize(l.dtype));
  const int64_t row = l.head_dim;
  for (int layer = 0; layer < l.layers; ++layer) {
    for (int kv = 0; kv < 2; ++kv) {
      uint8_t* base = (kv == 0 ? l.k : l.v)[static_cast<size_t>(layer)];
      const int64_t plane = (int64_t{layer} * 2 + kv) * count;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t off = l.TokenOffset(first + i);
        for (int h = 0; h < l.kv_heads; ++h) {
          f(base + static_cast<size_t>(off + h * l.stride_head) * es,
            ((plane + i) * l.kv_heads + h) * row);
        }
      }
    }
  }
}

}  // namespace

Status ChunkToLayout(const Chunk& chunk, int64_t first, const KvLayout& l, int64_t count) {
  const ChunkInfo& info = chunk.info();
  if (chunk.encoded()) return InvalidArgument("an encoded chunk cannot be copied as KV");
  if (count < 0) count = info.tokens;
  if (count > int64_t{info.tokens}) {
    return InvalidArgument(Str(count) + " tokens of a chunk of " + Str(info.tokens));
  }
  KDN_RETURN_IF_ERROR(CheckLayout(l, static_cast<int>(info.layers), static_cast<int>(info.kv_heads),
                                  static_cast<int>(info.head_dim)));
  KDN_RETURN_IF_ERROR(CheckTokens(l, first, count));
  const uint8_t* src = chunk.payload().data();
  const size_t ss = static_cast<size_t>(DTypeSize(info.dtype));
  const size_t n = static_cast<size_t>(l.head_dim);
  // The chunk's rows are [layer][K|V][token][head] over all its tokens: a
  // row of this copy's plane p, token i, head h is the chunk's row of
  // plane p, token i, head h.
  const int64_t per_plane = int64_t{info.tokens} * l.kv_heads * l.head_dim;
  const int64_t per_plane_here = count * l.kv_heads * l.head_dim;
  ForEachRow(l, first, count, [&](uint8_t* dst, int64_t elem) {
    const int64_t src_elem = elem / per_plane_here * per_plane + elem % per_plane_here;
    ConvertKv(src + static_cast<size_t>(src_elem) * ss, info.dtype, dst, l.dtype, n);
  });
  return Status::Ok();
}

void LayoutToPayload(const KvLayout& l, int64_t first, int64_t count, DType dtype,
                     uint8_t* payload) {
  const size_t ds = static_cast<size_t>(DTypeSize(dtype));
  const size_t n = static_cast<size_t>(l.head_dim);
  ForEachRow(l, first, count, [&](uint8_t* src, int64_t elem) {
    ConvertKv(src, l.dtype, payload + static_cast<size_t>(elem) * ds, dtype, n);
  });
}

}  // namespace kdn::kvbus
