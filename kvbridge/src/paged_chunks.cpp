#include "kdn/kvbridge/paged_chunks.h"

#include <algorithm>
#include <vector>

#include <span>
#include <string>

#include "kdn/kvbus/buffer_pool.h"

namespace kdn::kvbridge {

namespace {

using kdn::DType;
using kvbus::Chunk;
using kvbus::ChunkInfo;
using kvbus::ChunkKey;

// Layers [layer0, layer0 + layers) of tokens [first, first + count) of `seq`.
Result<std::shared_ptr<const kvbus::Chunk>> FromPaged(
    const engine::KvCache& cache, const engine::KvSequence& seq, int64_t first, int64_t count,
    int layer0, int layers, const ChunkKey& key, const ChunkKey& model_fingerprint, DType dtype,
    uint32_t logical = 0, std::vector<uint32_t> kept = {}, bool holes_sent_apart = false) {
  if (first < 0 || count <= 0 || first + count > seq.length()) {
    return InvalidArgument("chunk: tokens [" + std::to_string(first) + ", " +
                           std::to_string(first + count) + ") are not all in a sequence of " +
                           std::to_string(seq.length()));
  }
  if (seq.has_holes() && !holes_sent_apart) {
    // A chunk's KV is every head's for each token it holds.
    return InvalidArgument(
        "chunk: pruned KV whose heads kept different tokens has no chunk "
        "format");
  }
  if (layer0 < 0 || layers <= 0 || layer0 + layers > cache.num_layers()) {
    return InvalidArgument("chunk: layers [" + std::to_string(layer0) + ", " +
                           std::to_string(layer0 + layers) + ") are not all in a cache of " +
                           std::to_string(cache.num_layers()));
  }
  ChunkInfo info = LayerSliceInfo(cache, first, count, key, model_fingerprint, dtype);
  info.layers = static_cast<uint32_t>(layers);
  info.logical_tokens = logical;
  info.kept = std::move(kept);
  // The payload is the cache's layers, each K rows then V rows: one read.
  const size_t bytes = layers * cache.LayerBytes(count, dtype);
  Status read;
  auto chunk = Chunk::Build(info, [&](uint8_t* out) {
    read =
        cache.ReadLayers(seq, layer0, layers, first, count, dtype, std::span<uint8_t>(out, bytes));
  });
  KDN_RETURN_IF_ERROR(read);
  return chunk;
}

// Writes the chunk's layers [src_layer, src_layer + n_layers) into the
// cache's layers from layer0 on.
Status ToPaged(const Chunk& chunk, int src_layer, int n_layers, int layer0, engine::KvCache& cache,
               engine::KvSequence& seq, int64_t first, int64_t skip = 0) {
  const ChunkInfo& info = chunk.info();
  if (chunk.encoded()) {
    return InvalidArgument("chunk " + info.key.ToHex() +
                           " is encoded (kvbus::DecodeChunk it before use)");
  }
  if (info.is_steering()) {
    return InvalidArgument("chunk " + info.key.ToHex() + " is a steering vector, not KV");
  }
  if (info.per_head()) {
    return InvalidArgument("chunk " + info.key.ToHex() +
                           " is pruned per head (kvbridge::HeadPrunedChunkToPagedKv loads it)");
  }
  if (layer0 < 0 || layer0 + static_cast<int64_t>(n_layers) > cache.num_layers() ||
      static_cast<int>(info.kv_heads) != cache.num_kv_heads() ||
      static_cast<int>(info.head_dim) != cache.head_dim()) {
    return InvalidArgument(
        "chunk " + info.key.ToHex() + " has " + std::to_string(info.layers) + " layers x " +
        std::to_string(info.kv_heads) + " KV heads x " + std::to_string(info.head_dim) +
        "; the cache from layer " + std::to_string(layer0) + " has " +
        std::to_string(cache.num_layers() - layer0) + " x " + std::to_string(cache.num_kv_heads()) +
        " x " + std::to_string(cache.head_dim()));
  }
  const int64_t end = first + info.tokens;
  if (first < 0 || end > seq.reserved() || skip < 0 || skip >= info.tokens) {
    return InvalidArgument("chunk " + info.key.ToHex() + ": positions [" +
                           std::to_string(first + skip) + ", " + std::to_string(end) +
                           ") are not reserved in the sequence");
  }
  const engine::DType dtype = info.dtype;
  const size_t layer_bytes = cache.LayerBytes(info.tokens, dtype);
  const uint8_t* in = chunk.payload().data() + static_cast<size_t>(src_layer) * layer_bytes;
  if (skip == 0) {
    return cache.WriteLayers(seq, layer0, n_layers, first, info.tokens, dtype,
                             std::span<const uint8_t>(in, n_layers * layer_bytes));
  }
  // The rows past `skip` of each layer's K and V, gathered.
  const int64_t count = info.tokens - skip;
  const size_t row = layer_bytes / (2 * static_cast<size_t>(info.tokens));
  std::vector<uint8_t> rows(static_cast<size_t>(n_layers) * cache.LayerBytes(count, dtype));
  uint8_t* out = rows.data();
  for (int l = 0; l < n_layers; ++l, in += layer_bytes) {
    for (int half = 0; half < 2; ++half) {
      const uint8_t* from = in + (half * info.tokens + skip) * row;
      out = std::copy(from, from + count * row, out);
    }
  }
  return cache.WriteLayers(seq, layer0, n_layers, first + skip, count, dtype, rows);
}

}  // namespace

void PinChunkBuffersFor(const engine::Engine& engine) {
  const engine::HostPinning* pinning = engine.host_pinning();
  if (pinning == nullptr) return;
  kvbus::BufferPool::Default().SetMapHooks(
      {[pin = pinning->pin](void* p, size_t bytes) { return pin(p, bytes); },
       [unpin = pinning->unpin](void* p) { unpin(p); }});
}

Result<std::shared_ptr<const kvbus::Chunk>> ChunkFromPagedKv(
    const engine::KvCache& cache, const engine::KvSequence& seq, int64_t first, int64_t count,
    const ChunkKey& key, const ChunkKey& model_fingerprint, DType dtype) {
  return FromPaged(cache, seq, first, count, 0, cache.num_layers(), key, model_fingerprint, dtype);
}

Result<std::shared_ptr<const kvbus::Chunk>> PrunedChunkFromPagedKv(
    const engine::KvCache& cache, const engine::KvSequence& seq, uint32_t logical,
    std::vector<uint32_t> kept, const ChunkKey& key, const ChunkKey& model_fingerprint,
    DType dtype) {
  if (seq.next_position() != logical || seq.length() != static_cast<int64_t>(kept.size())) {
    return InvalidArgument("chunk: a pruned sequence of " + std::to_string(seq.length()) +
                           " tokens at next position " + std::to_string(seq.next_position()) +
                           " for " + std::to_string(kept.size()) + " kept of " +
                           std::to_string(logical));
  }
  return FromPaged(cache, seq, 0, seq.length(), 0, cache.num_layers(), key, model_fingerprint,
                   dtype, logical, std::move(kept));
}

Status ChunkToPagedKv(const Chunk& chunk, engine::KvCache& cache, engine::KvSequence& seq,
                      int64_t first, int64_t skip) {
  if (static_cast<int>(chunk.info().layers) != cache.num_layers()) {
    return InvalidArgument("chunk " + chunk.key().ToHex() + " has " +
                           std::to_string(chunk.info().layers) + " layers, the cache " +
                           std::to_string(cache.num_layers()));
  }
  return ToPaged(chunk, 0, cache.num_layers(), 0, cache, seq, first, skip);
}

Status ChunkLayerToPagedKv(const Chunk& chunk, int layer, engine::KvCache& cache,
                           engine::KvSequence& seq, int64_t first) {
  if (static_cast<int>(chunk.info().layers) != cache.num_layers() || layer < 0 ||
      layer >= cache.num_layers()) {
    return InvalidArgument("chunk " + chunk.key().ToHex() + " has " +
                           std::to_string(chunk.info().layers) + " layers, the cache " +
                           std::to_string(cache.num_layers()) + "; layer " + std::to_string(layer) +
                           " asked for");
  }
  return ToPaged(chunk, layer, 1, layer, cache, seq, first);
}

Result<std::shared_ptr<const kvbus::Chunk>> LayerSliceFromPagedKv(
    const engine::KvCache& cache, const engine::KvSequence& seq, int64_t first, int64_t count,
    int layer, const ChunkKey& key, const ChunkKey& model_fingerprint, DType dtype) {
  // A transfer's slice: the holes go with the request (PackHoles).
  return FromPaged(cache, seq, first, count, layer, 1, key, model_fingerprint, dtype, 0, {}, true);
}

ChunkInfo LayerSliceInfo(const engine::KvCache& cache, int64_t first, int64_t count,
                         const ChunkKey& key, const ChunkKey& model_fingerprint, DType dtype) {
  return ChunkInfo{key,
                   model_fingerprint,
                   1,
                   static_cast<uint32_t>(cache.num_kv_heads()),
                   static_cast<uint32_t>(cache.head_dim()),
                   static_cast<uint32_t>(count),
                   dtype,
                   first};
}

Result<kvbus::SourcedChunk> SourcedLayerSlice(const engine::KvCache& cache,
                                              const engine::KvSequence& seq,
                                              const kvbus::DeviceMemory& pool, int64_t first,
                                              int64_t count, int layer, const ChunkKey& key,
                                              const ChunkKey& model_fingerprint, DType dtype) {
  if (cache.Memory().dtype != dtype) {
    return FailedPrecondition("layer slice " + key.ToHex() + ": the pool holds " +
                              engine::DTypeName(cache.Memory().dtype) + ", the slice is " +
                              kdn::DTypeName(dtype));
  }
  std::vector<engine::KvPoolRange> ranges;
  KDN_RETURN_IF_ERROR(cache.LayerRanges(seq, layer, first, count, &ranges));
  return kvbus::MakeSourcedChunk(LayerSliceInfo(cache, first, count, key, model_fingerprint, dtype),
                                 pool, std::move(ranges));
}

Status LayerSliceToPagedKv(const Chunk& slice, int layer, engine::KvCache& cache,
                           engine::KvSequence& seq, int64_t first) {
  if (slice.info().layers != 1) {
    return InvalidArgument("chunk " + slice.key().ToHex() + " has " +
                           std::to_string(slice.info().layers) + " layers; a layer slice has 1");
  }
  return ToPaged(slice, 0, 1, layer, cache, seq, first);
}

}  // namespace kdn::kvbridge
