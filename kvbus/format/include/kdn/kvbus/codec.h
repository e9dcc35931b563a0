#pragma once
// kvc, kdn's KV codec: a chunk's layer-major KV as a compact stream, for the
// tiers and links where bytes cost more than the CPU time to code them (the
// disk tier, kdn-store, the wire across hosts). Raw KV stays in device memory
// and the host tier. Spec: docs/kvbus.md, "KV codec".
//
// The stream codes each (layer, K|V) plane of `tokens x kv_heads*head_dim`
// values on its own, after what CacheGen (arXiv 2310.07240) found about KV:
// - values of one channel in nearby tokens are close, so a plane may be coded
//   as each token's delta from the one before, with an anchor token coded on
//   its own every 16 (the encoder keeps the deltas only where they cost
//   fewer bits than the values);
// - shallow layers are more sensitive to quantization than deep ones, so the
//   first third of the layers gets 2 more bits and the middle third 1 more;
// - an entropy coder fitted to each plane's value distribution (rANS, with
//   frequency tables carried in the stream) beats a generic compressor.
//   rANS decodes several times slower than unpacking fixed-width values, so
//   a plane where it saves under 10% of the bits is packed at its width.
//
// Levels:
// - "lossless": every bit kept; each plane's elements are split into byte
//   planes, each coded with its own table.
// - "q2" ... "q8": per-channel uniform quantization over the plane's range,
//   at b bits in the deepest third of the layers, b+1 in the middle third and
//   b+2 in the first (capped at 8): "q8" is 8 bits in every layer, the grid
//   of plain 8-bit quantization. A plane holding a NaN or an infinity, or a
//   channel whose range overflows a float, is coded losslessly instead.
//
// The chunk header names the codec and level (kdn/kvbus/chunk.h), so a
// reader needs no configuration to decode. The key does not change: an
// encoded chunk answers to its raw chunk's key.
//
// Decoding never trusts its input: a stream that is truncated, overlong,
// names a table or mode it cannot have, or whose coder state does not end
// where the encoder started it is CORRUPTION, and the chunk is a miss.
//
// Thread-safe: the functions are pure; CodecTier is thread-safe if its inner
// store is.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/chunk_store.h"

namespace kdn::kvbus {

struct CodecLevel {
  KvCodec codec = KvCodec::kRaw;
  uint32_t level = 0;  // kKvc: 0 lossless, else the deepest layers' bits (2..8)

  bool raw() const { return codec == KvCodec::kRaw; }
  bool operator==(const CodecLevel&) const = default;
};

// "raw", "lossless", "q2" ... "q8"; INVALID_ARGUMENT naming the choices.
Result<CodecLevel> ParseCodecLevel(std::string_view name);
std::string CodecLevelName(CodecLevel level);
// Whether `level` is one this build can encode and decode.
bool ValidCodecLevel(CodecLevel level);
// Quantization bits of layer `layer` of `layers` at a kKvc level (0: lossless).
int LayerBits(uint32_t level, uint32_t layer, uint32_t layers);

// The chunk coded at `level` (header: codec and level; same key, shape,
// dtype and position). A raw level, or a chunk already encoded, gives
// `chunk` back as it is. RESOURCE_EXHAUSTED when memory runs out.
Result<std::shared_ptr<const Chunk>> EncodeChunk(std::shared_ptr<const Chunk> chunk,
                                                 CodecLevel level);
// The most raw KV one encoded chunk may decode to: 1 GiB (a 256-token chunk
// of a 405B-parameter Llama in f32 is 264 MB).
inline constexpr uint64_t kMaxDecodedBytes = uint64_t{1} << 30;

// The raw chunk an encoded one holds (lossy levels: the reconstruction); a
// raw chunk is given back as it is. CORRUPTION naming what is wrong with a
// stream that cannot be decoded exactly to the header's shape, or whose
// shape is over kMaxDecodedBytes.
Result<std::shared_ptr<const Chunk>> DecodeChunk(std::shared_ptr<const Chunk> chunk);

struct CodecStats {
  uint64_t encoded = 0;        // chunks encoded by Put
  uint64_t raw_bytes = 0;      // their raw payloads
  uint64_t encoded_bytes = 0;  // their encoded payloads
  uint64_t decoded = 0;        // encoded chunks decoded by Get
  uint64_t decode_errors = 0;  // encoded chunks that failed to decode (misses)
  double encode_seconds = 0;
  double decode_seconds = 0;
};

struct CodecTierOptions {
  CodecLevel level;  // what Put encodes raw chunks at (raw: they pass as they are)
  // Get decodes encoded chunks. Off where the chunks go on to another
  // process that decodes them itself (kdn-store's disk tier).
  bool decode_on_get = true;
};

// A tier seen through the codec: Put encodes raw chunks at the level before
// the inner tier stores them, Get decodes what it finds. An encoded chunk
// that fails to decode is a miss (NOT_FOUND), counted in Stats().corrupt,
// never served. name(), Contains() and the rest of the figures are the inner
// tier's.
class CodecTier final : public ChunkStore {
 public:
  CodecTier(std::unique_ptr<ChunkStore> inner, CodecTierOptions options);

  std::string name() const override { return inner_->name(); }
  Result<std::shared_ptr<const Chunk>> Get(const ChunkKey& key) override;
  bool Contains(const ChunkKey& key) override { return inner_->Contains(key); }
  std::vector<bool> ContainsMany(std::span<const ChunkKey> keys) override {
    return inner_->ContainsMany(keys);
  }
  // A chunk that cannot be encoded (out of memory), or that coding would not
  // make smaller (a tail piece of a few tokens), is stored raw.
  Status Put(std::shared_ptr<const Chunk> chunk) override;
  TierStats Stats() override;
  TierStats LocalStats() override { return inner_->LocalStats(); }
  Result<size_t> Keep(std::span<const ChunkKey> keys, std::chrono::milliseconds lease) override {
    return inner_->Keep(keys, lease);
  }

  CodecStats codec_stats() const;
  const CodecTierOptions& options() const { return options_; }
  ChunkStore& inner() { return *inner_; }

 private:
  const std::unique_ptr<ChunkStore> inner_;
  const CodecTierOptions options_;
  std::atomic<uint64_t> encoded_{0}, raw_bytes_{0}, encoded_bytes_{0}, decoded_{0},
      decode_errors_{0}, encode_ns_{0}, decode_ns_{0};
};

}  // namespace kdn::kvbus
