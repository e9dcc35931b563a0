#pragma once
// The bridge between KV chunks (kvbus) and an engine's paged KV cache: the
// copies that turn a sequence's KV into chunks and layer slices and back,
// through engine::KvCache's Read and Write, so they work on whichever memory
// the blocks live in (host or device). It sits above both libraries, so that
// kvbus (and kdn-store) need no engine.
// Thread-safe as the cache is: calls on one cache are serialised by its
// engine's thread, except Write on distinct layers (see KvCache).

#include <cstdint>
#include <memory>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/engine.h"
#include "kdn/engine/kv_cache.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/transport.h"

namespace kdn::kvbridge {

// Has the chunk buffer pool (kvbus::BufferPool::Default()) pin the buffers
// it maps from now on with `engine`'s HostPinning, when it has one (a GPU):
// chunks built from its KV, and the layer slices a worker receives for it,
// then move to and from the device by DMA. A no-op for a host engine. Call
// it once the engine exists, before the traffic starts.
void PinChunkBuffersFor(const engine::Engine& engine);

// Copies the KV of tokens [first, first + count) of `seq` (fp32 in the cache)
// into a new chunk of `dtype`, rounding to nearest even. The tokens must be
// within seq.length().
Result<std::shared_ptr<const kvbus::Chunk>> ChunkFromPagedKv(
    const engine::KvCache& cache, const engine::KvSequence& seq, int64_t first, int64_t count,
    const kvbus::ChunkKey& key, const kvbus::ChunkKey& model_fingerprint, kdn::DType dtype);

// The chunk of a pruned sequence (kdn/prune/prune.h's CompactKv of a text
// computed from position 0, every layer and head keeping the same tokens):
// its KV, standing for `logical` tokens of text, the token at offset kept[j]
// in slot j (a chunk flagged pruned). INVALID_ARGUMENT when `seq` is not
// that: its length not kept.size(), its next position not `logical`.
Result<std::shared_ptr<const kvbus::Chunk>> PrunedChunkFromPagedKv(
    const engine::KvCache& cache, const engine::KvSequence& seq, uint32_t logical,
    std::vector<uint32_t> kept, const kvbus::ChunkKey& key,
    const kvbus::ChunkKey& model_fingerprint, kdn::DType dtype);

// Writes a chunk's KV into positions [first, first + tokens) of `seq`, which
// must have reserved room for them (KvCache::Reserve); does not change
// seq's length. With `skip`, the chunk's first `skip` tokens are left out
// (positions the sequence already holds, resident KV it shares). INVALID_ARGUMENT
// if the chunk's layers, heads or head_dim do not match the cache.
Status ChunkToPagedKv(const kvbus::Chunk& chunk, engine::KvCache& cache, engine::KvSequence& seq,
                      int64_t first, int64_t skip = 0);

// The same for layer `layer` of a whole chunk alone (for loading a chunk one
// layer at a time while earlier layers compute).
Status ChunkLayerToPagedKv(const kvbus::Chunk& chunk, int layer, engine::KvCache& cache,
                           engine::KvSequence& seq, int64_t first);

// Layer slices: chunks of one layer (info.layers == 1), the unit in which a
// prefill worker pushes KV to a decode worker as each layer finishes
// (LayerSliceKey names them). Same contracts as the whole-chunk functions;
// `layer` is the cache layer read or written. A slice of a sequence with
// holes (a blend over a document pruned per head) holds what its holes
// hold; the holes go to the decode worker beside it (kdn/kvbridge/
// head_pruned.h, PackHoles), as no chunk a tier stores does.
Result<std::shared_ptr<const kvbus::Chunk>> LayerSliceFromPagedKv(
    const engine::KvCache& cache, const engine::KvSequence& seq, int64_t first, int64_t count,
    int layer, const kvbus::ChunkKey& key, const kvbus::ChunkKey& model_fingerprint,
    kdn::DType dtype);
Status LayerSliceToPagedKv(const kvbus::Chunk& slice, int layer, engine::KvCache& cache,
                           engine::KvSequence& seq, int64_t first);

// What a layer slice of tokens [first, first + count) of `cache`'s shape
// is (its header's fields): what LayerSliceFromPagedKv builds, and what a
// decode worker expects to land.
kvbus::ChunkInfo LayerSliceInfo(const engine::KvCache& cache, int64_t first, int64_t count,
                                const kvbus::ChunkKey& key,
                                const kvbus::ChunkKey& model_fingerprint, kdn::DType dtype);

// The same slice read where it lies (kvbus::SourcedChunk): extents of
// `pool`, the memory of cache.Memory() as a DeviceOps backend holds it,
// in the pool's own dtype. FAILED_PRECONDITION when it cannot be (a block
// the sequence shares, a pool that is not one region, `dtype` not the
// pool's); then build it with LayerSliceFromPagedKv.
Result<kvbus::SourcedChunk> SourcedLayerSlice(const engine::KvCache& cache,
                                              const engine::KvSequence& seq,
                                              const kvbus::DeviceMemory& pool, int64_t first,
                                              int64_t count, int layer, const kvbus::ChunkKey& key,
                                              const kvbus::ChunkKey& model_fingerprint,
                                              kdn::DType dtype);

}  // namespace kdn::kvbridge
