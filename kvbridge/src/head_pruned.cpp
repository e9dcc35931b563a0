#include "kdn/kvbridge/head_pruned.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace kdn::kvbridge {

namespace {

// One layer's per-head KV from one layout into the other: the cache's,
// Read's [K|V][slot][kv_head][head_dim] over `tokens` slots ("dense"), and
// the chunk's [K|V][kv_head][j < count][head_dim] ("packed"). Into the
// dense layout when `to_dense` (holes zeroed), else into the packed one.
void Permute(const kvbus::ChunkInfo& info, int layer, size_t elem, const uint8_t* src, uint8_t* dst,
             bool to_dense) {
  const size_t row = size_t{info.head_dim} * elem, slots = info.tokens, heads = info.kv_heads;
  const uint32_t* counts = info.head_counts.data() + size_t(layer) * heads;
  size_t layer_pairs = 0;
  for (size_t h = 0; h < heads; ++h) layer_pairs += counts[h];
  for (size_t kv = 0; kv < 2; ++kv) {
    size_t packed = kv * layer_pairs * row;
    for (size_t h = 0; h < heads; ++h) {
      for (size_t j = 0; j < slots; ++j) {
        const size_t dense = ((kv * slots + j) * heads + h) * row;
        if (j >= counts[h]) {
          if (to_dense) std::memset(dst + dense, 0, row);  // a hole: never read
          continue;
        }
        if (to_dense) {
          std::memcpy(dst + dense, src + packed, row);
        } else {
          std::memcpy(dst + packed, src + dense, row);
        }
        packed += row;
      }
    }
  }
}

// A per-head chunk of the cache's shape.
Status CheckHeadPruned(const kvbus::Chunk& chunk, const engine::KvCache& cache) {
  const kvbus::ChunkInfo& info = chunk.info();
  if (!info.per_head() || chunk.encoded()) {
    return InvalidArgument("chunk " + info.key.ToHex() + " is not KV pruned per head");
  }
  if (static_cast<int>(info.layers) != cache.num_layers() ||
      static_cast<int>(info.kv_heads) != cache.num_kv_heads() ||
      static_cast<int>(info.head_dim) != cache.head_dim()) {
    return InvalidArgument(
        "chunk " + info.key.ToHex() + " has " + std::to_string(info.layers) + " layers x " +
        std::to_string(info.kv_heads) + " KV heads x " + std::to_string(info.head_dim) +
        "; the cache " + std::to_string(cache.num_layers()) + " x " +
        std::to_string(cache.num_kv_heads()) + " x " + std::to_string(cache.head_dim()));
  }
  return Status::Ok();
}

// Bytes of one layer's packed KV.
size_t LayerPackedBytes(const kvbus::ChunkInfo& info, int layer, size_t elem) {
  size_t pairs = 0;
  for (uint32_t h = 0; h < info.kv_heads; ++h) pairs += info.head_counts[layer * info.kv_heads + h];
  return 2 * pairs * info.head_dim * elem;
}

}  // namespace

Result<std::shared_ptr<const kvbus::Chunk>> HeadPrunedChunkFromPagedKv(
    const engine::KvCache& cache, const engine::KvSequence& seq, uint32_t logical,
    std::vector<uint32_t> counts, std::vector<uint32_t> positions, const kvbus::ChunkKey& key,
    const kvbus::ChunkKey& model_fingerprint, kdn::DType dtype) {
  kvbus::ChunkInfo info{key,
                        model_fingerprint,
                        static_cast<uint32_t>(cache.num_layers()),
                        static_cast<uint32_t>(cache.num_kv_heads()),
                        static_cast<uint32_t>(cache.head_dim()),
                        0,
                        dtype,
                        0};
  info.logical_tokens = logical;
  info.SetHeadKept(std::move(counts), std::move(positions));
  const std::string what = "chunk " + key.ToHex() + ": a per-head pruned sequence of " +
                           std::to_string(seq.length()) + " slots at next position " +
                           std::to_string(seq.next_position());
  if (info.head_counts.size() != size_t{info.layers} * info.kv_heads || info.tokens == 0 ||
      seq.length() != int64_t{info.tokens} || seq.next_position() != int64_t{logical}) {
    return InvalidArgument(what + " for head counts of " + std::to_string(info.tokens) +
                           " slots of " + std::to_string(logical));
  }
  for (uint32_t l = 0; l < info.layers; ++l) {
    for (uint32_t h = 0; h < info.kv_heads; ++h) {
      const uint32_t n = info.head_counts[l * info.kv_heads + h];
      // Slots [0, n) held, [n, tokens) holes.
      const std::span<const uint8_t> holes = seq.Holes(static_cast<int>(l), static_cast<int>(h));
      bool fits = holes.empty() ? n == info.tokens : holes.size() == info.tokens;
      for (size_t s = 0; fits && s < holes.size(); ++s) fits = (holes[s] != 0) == (s >= n);
      if (!fits) return InvalidArgument(what + ": a head's holes are not past its count");
    }
  }
  const size_t elem = DTypeSize(dtype);
  std::vector<uint8_t> dense(cache.LayerBytes(info.tokens, dtype));
  Status read;
  // Build checks the counts and positions before it fills.
  auto chunk = kvbus::Chunk::Build(info, [&](uint8_t* out) {
    for (int l = 0; l < cache.num_layers() && read.ok(); ++l) {
      read = cache.Read(seq, l, 0, info.tokens, dtype, dense);
      if (read.ok()) Permute(info, l, elem, dense.data(), out, false);
      out += LayerPackedBytes(info, l, elem);
    }
  });
  KDN_RETURN_IF_ERROR(read);
  return chunk;
}

Status HeadPrunedChunkToPagedKv(const kvbus::Chunk& chunk, engine::KvCache& cache,
                                engine::KvSequence& seq) {
  const kvbus::ChunkInfo& info = chunk.info();
  KDN_RETURN_IF_ERROR(CheckHeadPruned(chunk, cache));
  if (seq.length() != 0 || !seq.blocks().empty()) {
    return InvalidArgument("chunk " + info.key.ToHex() + ": loading into a sequence that holds KV");
  }
  KDN_RETURN_IF_ERROR(cache.Reserve(seq, info.tokens));
  const size_t elem = DTypeSize(info.dtype);
  std::vector<uint8_t> dense(cache.LayerBytes(info.tokens, info.dtype));
  const uint8_t* in = chunk.payload().data();
  Status st;
  for (int l = 0; l < cache.num_layers() && st.ok(); ++l) {
    Permute(info, l, elem, in, dense.data(), true);
    in += LayerPackedBytes(info, l, elem);
    st = cache.Write(seq, l, 0, info.tokens, info.dtype, dense);
  }
  if (st.ok()) {
    cache.SetLength(seq, info.tokens);
    std::vector<int32_t> counts(info.head_counts.begin(), info.head_counts.end());
    // SetHeadTokens leaves no holes where every head kept every slot.
    st = seq.SetHeadTokens(info.tokens, std::move(counts));
  }
  if (st.ok()) st = seq.SetNextPosition(info.position + info.logical_tokens);
  if (!st.ok()) seq.Reset();
  return st;
}

std::vector<uint32_t> HeadPrunedSlots(const kvbus::ChunkInfo& info) {
  std::vector<uint32_t> slots = info.kept;
  std::sort(slots.begin(), slots.end());
  slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
  return slots;
}

std::vector<uint8_t> HeadPrunedHoles(const kvbus::ChunkInfo& info,
                                     std::span<const uint32_t> slots) {
  const size_t n = slots.size();
  std::vector<uint8_t> holes(info.head_counts.size() * n, 1);
  const uint32_t* p = info.kept.data();
  for (size_t i = 0; i < info.head_counts.size(); ++i) {
    // Both ascending: one walk.
    size_t s = 0;
    for (uint32_t j = 0; j < info.head_counts[i]; ++j, ++p) {
      while (s < n && slots[s] < *p) ++s;
      if (s < n && slots[s] == *p) holes[i * n + s] = 0;
    }
  }
  return holes;
}

Status HeadPrunedLayerToSlots(const kvbus::Chunk& chunk, int layer, std::span<const uint32_t> slots,
                              engine::KvCache& cache, engine::KvSequence& seq, int64_t first) {
  const kvbus::ChunkInfo& info = chunk.info();
  KDN_RETURN_IF_ERROR(CheckHeadPruned(chunk, cache));
  if (layer < 0 || layer >= cache.num_layers() || slots.size() < info.tokens) {
    return InvalidArgument("chunk " + info.key.ToHex() + ": layer " + std::to_string(layer) +
                           " into " + std::to_string(slots.size()) + " slots");
  }
  const size_t elem = DTypeSize(info.dtype), row = size_t{info.head_dim} * elem,
               heads = info.kv_heads, n = slots.size();
  std::vector<uint8_t> dense(cache.LayerBytes(static_cast<int64_t>(n), info.dtype), 0);
  // This layer's packed K, then V, and where its heads' positions start.
  const uint8_t* packed = chunk.payload().data();
  const uint32_t* pos = info.kept.data();
  size_t layer_pairs = 0;
  for (int l = 0; l <= layer; ++l) {
    size_t pairs = 0;
    for (size_t h = 0; h < heads; ++h) pairs += info.head_counts[l * heads + h];
    if (l < layer) {
      packed += 2 * pairs * row;
      pos += pairs;
    } else {
      layer_pairs = pairs;
    }
  }
  size_t at = 0;
  for (size_t h = 0; h < heads; ++h) {
    size_t s = 0;
    for (uint32_t j = 0; j < info.head_counts[layer * heads + h]; ++j, ++at) {
      while (s < n && slots[s] < pos[at]) ++s;
      if (s == n || slots[s] != pos[at]) {
        return InvalidArgument("chunk " + info.key.ToHex() + ": offset " + std::to_string(pos[at]) +
                               " has no slot");
      }
      for (size_t kv = 0; kv < 2; ++kv) {
        std::memcpy(&dense[((kv * n + s) * heads + h) * row],
                    packed + (kv * layer_pairs + at) * row, row);
      }
    }
  }
  return cache.Write(seq, layer, first, static_cast<int64_t>(n), info.dtype, dense);
}

std::string PackHoles(const engine::KvCache& cache, const engine::KvSequence& seq, int64_t slots) {
  if (!seq.has_holes()) return {};
  const int heads = cache.num_kv_heads();
  std::string bits(static_cast<size_t>((int64_t{cache.num_layers()} * heads * slots + 7) / 8), 0);
  for (int l = 0; l < cache.num_layers(); ++l) {
    for (int h = 0; h < heads; ++h) {
      const std::span<const uint8_t> holes = seq.Holes(l, h);
      const int64_t row = (int64_t{l} * heads + h) * slots;
      for (int64_t s = 0; s < std::min<int64_t>(slots, static_cast<int64_t>(holes.size())); ++s) {
        if (holes[s] != 0) bits[(row + s) / 8] |= static_cast<char>(1 << ((row + s) % 8));
      }
    }
  }
  return bits;
}

Status UnpackHoles(std::string_view bits, int64_t slots, const engine::KvCache& cache,
                   engine::KvSequence& seq) {
  const int64_t n = int64_t{cache.num_layers()} * cache.num_kv_heads() * slots;
  if (slots <= 0 || static_cast<int64_t>(bits.size()) != (n + 7) / 8) {
    return InvalidArgument(std::to_string(bits.size()) + " bytes of KV holes for " +
                           std::to_string(slots) + " slots");
  }
  std::vector<uint8_t> holes(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) holes[i] = (static_cast<uint8_t>(bits[i / 8]) >> (i % 8)) & 1;
  return seq.SetHoles(slots, std::move(holes));
}

}  // namespace kdn::kvbridge
