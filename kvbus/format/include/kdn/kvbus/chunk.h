#pragma once
// The KV chunk object (spec: docs/kvbus.md): a fixed little-endian header and
// a layer-major payload [layer][K|V][token][kv_head][head_dim], with an XXH3-64
// checksum of the payload in the header. Whatever reads a chunk from anywhere
// but its own memory verifies it (Chunk::Parse); a bad chunk is a miss, never
// served. Chunks are immutable once built and shared by pointer between
// tiers and transports. Thread-safe (immutable). Moving KV between chunks
// and an engine's paged cache is kvbridge's (kdn/kvbridge/paged_chunks.h).
//
// A chunk is raw (the payload is the KV itself) or encoded (the payload is a
// codec's stream of it: kdn/kvbus/codec.h). The key, shape and dtype are the
// raw chunk's either way; the checksum covers the bytes stored.

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <span>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/common/dtype.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/region.h"

namespace kdn::kvbus {

// Chunks are written as version 4, whose header carries flags for the
// optional parts (encoded, pruned, steering) beside its dtype, so a new combination or
// dtype needs no new version. Versions 1 (raw), 2 (encoded) and 3 (pruned),
// one variant each, are what kdn wrote before; they are still read. A reader
// refuses a version, flag, codec or version 4 dtype it does not know
// (UNIMPLEMENTED: another kdn's chunk, a miss) and damage (CORRUPTION).
inline constexpr uint32_t kRawChunkFormatVersion = 1;
inline constexpr uint32_t kEncodedChunkFormatVersion = 2;
inline constexpr uint32_t kPrunedChunkFormatVersion = 3;
inline constexpr uint32_t kChunkFormatVersion = 4;

// How a chunk's payload holds its KV: kRaw, the layout above; kKvc, kdn's KV
// codec (kdn/kvbus/codec.h), at the level in ChunkInfo::codec_level.
enum class KvCodec : uint32_t { kRaw = 0, kKvc = 1 };

struct ChunkInfo {
  ChunkKey key;
  ChunkKey model_fingerprint;
  uint32_t layers = 0;
  uint32_t kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t tokens = 0;
  DType dtype = DType::kF32;
  // The position of the chunk's first token that its K was rotated (RoPE) for.
  int64_t position = 0;
  KvCodec codec = KvCodec::kRaw;
  uint32_t codec_level = 0;  // the codec's own parameter (0 for kRaw)
  // Pruned KV (kdn/prune/prune.h; docs/kvbus.md, "Pruned KV"): the chunk's
  // `tokens` tokens of KV stand for `logical_tokens` tokens of text (0: not
  // pruned); KV slot j holds, in every layer and KV head, the token at
  // offset kept[j] of the text, its K rotated for position + kept[j].
  // `kept` is ascending, below logical_tokens, one per token; a header read
  // on its own (ParseHeader) leaves it empty. Pruned chunks are raw.
  uint32_t logical_tokens = 0;
  std::vector<uint32_t> kept;
  bool pruned() const { return logical_tokens != 0; }
  // Pruned per head (docs/kvbus.md, "Per-head kept tokens"): each layer's
  // KV head kept tokens of its own, head_counts[l * kv_heads + h] of them
  // (`tokens` is the most any head keeps), so `kept` holds head_slots
  // positions, head after head ([layer][kv_head]), each head's ascending,
  // and the KV is [layer][K|V][kv_head][j < count][head_dim]: only what
  // each head kept. head_slots, the counts' sum, is what a header read on
  // its own knows (head_counts then empty). 0: not pruned per head.
  std::vector<uint32_t> head_counts;
  uint64_t head_slots = 0;
  bool per_head() const { return head_slots != 0; }
  // The tokens of text the chunk stands for.
  uint32_t logical() const { return pruned() ? logical_tokens : tokens; }
  // Whole tokens' worth of KV it holds (every layer and head): `tokens`,
  // or per head the kept (head, token) pairs over layers x KV heads,
  // rounded to nearest.
  uint64_t stored_tokens() const {
    const uint64_t heads = uint64_t{layers} * kv_heads;
    return per_head() && heads > 0 ? (head_slots + heads / 2) / heads : tokens;
  }
  // The bytes of the kept positions (and a per-head chunk's counts), stored
  // between the header and the KV.
  uint64_t kept_bytes() const {
    if (per_head()) return 4 * (uint64_t{layers} * kv_heads + head_slots);
    return pruned() ? uint64_t{tokens} * 4 : 0;
  }
  // A steering vector's chunk (docs/kvbus.md, "Steering vector chunks"), not
  // a document's KV: its one token's values at the vector's layers are the
  // vector, and `steering` (steering_bytes long, kvbridge/steer.h's
  // description of it: name, layers, the prompt pairs) lies between the
  // header and the KV. A header read on its own leaves `steering` empty.
  // Steering chunks are raw and not pruned; nothing loads them as KV.
  uint32_t steering_bytes = 0;
  std::vector<uint8_t> steering;
  bool is_steering() const { return steering_bytes != 0; }
  // What lies between the header and the KV: kept positions, or a steering
  // vector's description.
  uint64_t annex_bytes() const { return kept_bytes() + steering_bytes; }

  // The raw KV's size, which the shape implies (an encoded chunk's stored
  // payload is smaller: Chunk::payload().size()); a per-head chunk's holds
  // head_slots (head, token) pairs' K and V.
  uint64_t payload_bytes() const {
    if (per_head()) return head_slots * 2 * head_dim * DTypeSize(dtype);
    return uint64_t{layers} * 2 * tokens * kv_heads * head_dim * DTypeSize(dtype);
  }
  // A per-head info from the kept tokens of each (layer, KV head): counts
  // and positions as above; `tokens` becomes the largest count.
  void SetHeadKept(std::vector<uint32_t> counts, std::vector<uint32_t> positions);
};

// A chunk's header read on its own, its payload elsewhere (a layer slice
// landed in place: docs/kvbus.md, "Landing in place").
struct ChunkHeaderFields {
  ChunkInfo info;
  uint64_t payload_bytes = 0;     // stored after the header (a pruned chunk's kept positions too)
  uint64_t payload_checksum = 0;  // XXH3-64 of them
};

// The XXH3-64 of the bytes of `extents` of `base`, in order: a payload's
// checksum when its bytes lie in pieces (the same value as over one piece).
uint64_t PayloadChecksum(const uint8_t* base, std::span<const Extent> extents);

class Chunk {
 public:
  static constexpr size_t kHeaderBytes = 128;

  // Builds a chunk from `info` and a payload of exactly info.payload_bytes().
  // A pruned info (logical_tokens set) needs its kept positions, which the
  // chunk stores too; INVALID_ARGUMENT for kept positions that do not fit.
  static Result<std::shared_ptr<const Chunk>> Make(const ChunkInfo& info,
                                                   std::vector<uint8_t> payload);
  // Builds a chunk whose payload `fill` writes in place (exactly
  // info.payload_bytes() bytes at the pointer it gets): one pre-faulted
  // buffer from BufferPool::Default(), no copy. RESOURCE_EXHAUSTED when no
  // memory can be had; pruned infos as Make.
  static Result<std::shared_ptr<const Chunk>> Build(const ChunkInfo& info,
                                                    const std::function<void(uint8_t*)>& fill);
  // An encoded chunk (info.codec not kRaw): `bytes` holds kHeaderBytes of
  // room for the header, then the codec's stream, which becomes the payload;
  // the header is written over that room. No copy.
  static Result<std::shared_ptr<const Chunk>> FromEncoded(const ChunkInfo& info,
                                                          std::vector<uint8_t> bytes);
  // Parses and verifies serialized bytes (header fields, sizes, checksum).
  // UNIMPLEMENTED for a sound header of a format version or codec this
  // build does not know (another kdn version's chunk); CORRUPTION naming
  // what is wrong otherwise.
  static Result<std::shared_ptr<const Chunk>> Parse(std::vector<uint8_t> bytes);
  // The same over `size` bytes at `data`, which the chunk then shares (a
  // buffer from BufferPool, filled by a transport): no copy. Nobody may
  // write to those bytes afterwards (chunks are immutable).
  static Result<std::shared_ptr<const Chunk>> Parse(std::shared_ptr<const uint8_t> data,
                                                    size_t size);
  // The header of a raw chunk of `info` whose payload's XXH3-64 is
  // `payload_checksum` (PayloadChecksum over it where it lies): what
  // announces a chunk a sender reads in place rather than from a Chunk
  // (kdn/kvbus/transport.h, SourcedChunk). INVALID_ARGUMENT for an encoded
  // or pruned info.
  static Result<std::array<uint8_t, kHeaderBytes>> SealedHeader(const ChunkInfo& info,
                                                                uint64_t payload_checksum);
  // Parses and verifies a header of kHeaderBytes alone (magic, its own
  // checksum, version, codec, dtype, a possible shape, and a payload size
  // that agrees with the shape); its payload is the caller's to check
  // against payload_checksum. CORRUPTION naming what is wrong otherwise.
  static Result<ChunkHeaderFields> ParseHeader(std::span<const uint8_t> header);

  const ChunkInfo& info() const { return info_; }
  const ChunkKey& key() const { return info_.key; }
  // Header followed by payload: what is stored and sent.
  std::span<const uint8_t> bytes() const { return {data_.get(), size_}; }
  // The KV (or its codec's stream), past a pruned chunk's kept positions or
  // a steering chunk's description.
  std::span<const uint8_t> payload() const {
    return bytes().subspan(kHeaderBytes + info_.annex_bytes());
  }
  size_t size() const { return size_; }
  bool encoded() const { return info_.codec != KvCodec::kRaw; }

 private:
  Chunk() = default;
  // Writes the header for info_ over the first kHeaderBytes of `bytes`
  // (size_ in all), checksums included.
  void SealHeader(uint8_t* bytes);
  // The same for a payload of `payload` bytes whose checksum is given.
  static void SealHeaderOf(const ChunkInfo& info, uint64_t payload, uint64_t payload_checksum,
                           uint8_t* h);
  ChunkInfo info_;
  std::shared_ptr<const uint8_t> data_;  // size_ bytes: header, then payload
  size_t size_ = 0;
};

// A span of a prompt and its chunk, as FetchPrefix (kdn/kvbus/prefix_io.h)
// reads them; no chunk for a span the caller holds.
using FetchedSpan = std::pair<KeyedSpan, std::shared_ptr<const Chunk>>;

}  // namespace kdn::kvbus
