#include "kdn/kvbus/chunk.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "kdn/kvbus/buffer_pool.h"

namespace kdn::kvbus {

namespace {

constexpr char kMagic[8] = {'K', 'D', 'N', 'C', 'H', 'U', 'N', 'K'};
// Header offsets (docs/kvbus.md, "KV chunk object").
constexpr size_t kOffVersion = 8, kOffDType = 12, kOffKey = 16, kOffModel = 32, kOffLayers = 48,
                 kOffKvHeads = 52, kOffHeadDim = 56, kOffTokens = 60, kOffPosition = 64,
                 kOffPayloadBytes = 72, kOffPayloadSum = 80, kOffCodec = 88, kOffCodecLevel = 92,
                 kOffRawBytes = 96, kOffLogical = 104, kOffKeptKind = 108, kOffFlags = 112,
                 kOffSteeringBytes = 116, kOffHeaderSum = 120;
// How a pruned chunk's kept positions are stored: one u32 offset per token,
// or per head (a count per layer and KV head, then each head's offsets).
constexpr uint32_t kKeptOffsets = 1, kKeptPerHead = 2;
// Version 4's flags: which optional parts the chunk has.
constexpr uint32_t kFlagEncoded = 1u << 0, kFlagPruned = 1u << 1, kFlagSteering = 1u << 2,
                   kFlagPerHead = 1u << 3;
constexpr uint32_t kKnownFlags = kFlagEncoded | kFlagPruned | kFlagSteering | kFlagPerHead;

void Put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void Put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t Get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t Get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// A per-head info's counts and positions: one count per layer and KV head,
// the largest `tokens`, their sum head_slots, each head's positions
// ascending inside the text.
Status CheckHeadKept(const ChunkInfo& info) {
  const std::string what = "chunk " + info.key.ToHex();
  if (!info.pruned()) return InvalidArgument(what + ": per-head kept tokens without pruning");
  if (info.head_counts.size() != size_t{info.layers} * info.kv_heads) {
    return InvalidArgument(what + ": " + std::to_string(info.head_counts.size()) +
                           " head counts for " + std::to_string(info.layers) + " layers x " +
                           std::to_string(info.kv_heads) + " KV heads");
  }
  uint64_t sum = 0;
  uint32_t most = 0;
  for (uint32_t n : info.head_counts) {
    sum += n;
    most = std::max(most, n);
  }
  if (sum != info.head_slots || sum != info.kept.size() || most != info.tokens ||
      info.logical_tokens < info.tokens) {
    return InvalidArgument(what + ": head counts of " + std::to_string(sum) + " kept (the most " +
                           std::to_string(most) + ") for " + std::to_string(info.kept.size()) +
                           " positions, " + std::to_string(info.tokens) + " slots and " +
                           std::to_string(info.logical_tokens) + " tokens of text");
  }
  const uint32_t* p = info.kept.data();
  for (uint32_t n : info.head_counts) {
    for (uint32_t j = 0; j < n; ++j) {
      if (p[j] >= info.logical_tokens || (j > 0 && p[j] <= p[j - 1])) {
        return InvalidArgument(what + ": a head's kept positions not ascending inside the text");
      }
    }
    p += n;
  }
  return Status::Ok();
}

// A pruned info's kept positions: one per token, ascending, inside the text
// (per head: CheckHeadKept).
Status CheckKept(const ChunkInfo& info) {
  if (!info.pruned()) {
    return info.kept.empty() && !info.per_head() && info.head_counts.empty()
               ? Status::Ok()
               : InvalidArgument("chunk " + info.key.ToHex() +
                                 ": kept positions without a logical length");
  }
  if (info.codec != KvCodec::kRaw) {
    return InvalidArgument("chunk " + info.key.ToHex() + ": a pruned chunk is raw");
  }
  if (info.per_head() || !info.head_counts.empty()) return CheckHeadKept(info);
  if (info.kept.size() != info.tokens || info.logical_tokens < info.tokens) {
    return InvalidArgument("chunk " + info.key.ToHex() + ": " + std::to_string(info.kept.size()) +
                           " kept positions for " + std::to_string(info.tokens) + " tokens of " +
                           std::to_string(info.logical_tokens));
  }
  for (size_t j = 0; j < info.kept.size(); ++j) {
    if (info.kept[j] >= info.logical_tokens || (j > 0 && info.kept[j] <= info.kept[j - 1])) {
      return InvalidArgument("chunk " + info.key.ToHex() +
                             ": kept positions not ascending inside the text");
    }
  }
  return Status::Ok();
}

// A steering chunk's description: all of it, and a raw chunk not pruned.
Status CheckSteering(const ChunkInfo& info) {
  if (info.steering.size() != info.steering_bytes) {
    return InvalidArgument("chunk " + info.key.ToHex() + ": a steering description of " +
                           std::to_string(info.steering.size()) + " bytes, the info says " +
                           std::to_string(info.steering_bytes));
  }
  if (info.is_steering() && (info.codec != KvCodec::kRaw || info.pruned())) {
    return InvalidArgument("chunk " + info.key.ToHex() +
                           ": a steering chunk is raw and not pruned");
  }
  return Status::Ok();
}

}  // namespace

void ChunkInfo::SetHeadKept(std::vector<uint32_t> counts, std::vector<uint32_t> positions) {
  head_slots = 0;
  tokens = 0;
  for (uint32_t n : counts) {
    head_slots += n;
    tokens = std::max(tokens, n);
  }
  head_counts = std::move(counts);
  kept = std::move(positions);
}

void Chunk::SealHeader(uint8_t* h) {
  const size_t payload = size_ - kHeaderBytes;
  SealHeaderOf(info_, payload, XXH3_64bits(h + kHeaderBytes, payload), h);
}

Result<std::array<uint8_t, Chunk::kHeaderBytes>> Chunk::SealedHeader(const ChunkInfo& info,
                                                                     uint64_t payload_checksum) {
  if (info.codec != KvCodec::kRaw || info.pruned() || info.is_steering()) {
    return InvalidArgument("chunk " + info.key.ToHex() +
                           ": a header sealed in place is raw KV, not pruned");
  }
  std::array<uint8_t, kHeaderBytes> h;
  SealHeaderOf(info, info.payload_bytes(), payload_checksum, h.data());
  return h;
}

void Chunk::SealHeaderOf(const ChunkInfo& info, uint64_t payload, uint64_t payload_checksum,
                         uint8_t* h) {
  std::memset(h, 0, kHeaderBytes);
  std::memcpy(h, kMagic, 8);
  const bool encoded = info.codec != KvCodec::kRaw;
  Put32(h + kOffVersion, kChunkFormatVersion);
  Put32(h + kOffFlags, (encoded ? kFlagEncoded : 0) | (info.pruned() ? kFlagPruned : 0) |
                           (info.is_steering() ? kFlagSteering : 0) |
                           (info.per_head() ? kFlagPerHead : 0));
  Put32(h + kOffSteeringBytes, info.steering_bytes);
  Put32(h + kOffDType, static_cast<uint32_t>(info.dtype));
  info.key.ToBytes(h + kOffKey);
  info.model_fingerprint.ToBytes(h + kOffModel);
  Put32(h + kOffLayers, info.layers);
  Put32(h + kOffKvHeads, info.kv_heads);
  Put32(h + kOffHeadDim, info.head_dim);
  Put32(h + kOffTokens, info.tokens);
  Put64(h + kOffPosition, static_cast<uint64_t>(info.position));
  Put64(h + kOffPayloadBytes, payload);
  Put64(h + kOffPayloadSum, payload_checksum);
  if (encoded) {
    Put32(h + kOffCodec, static_cast<uint32_t>(info.codec));
    Put32(h + kOffCodecLevel, info.codec_level);
    Put64(h + kOffRawBytes, info.payload_bytes());
  }
  if (info.pruned()) {
    Put32(h + kOffLogical, info.logical_tokens);
    Put32(h + kOffKeptKind, info.per_head() ? kKeptPerHead : kKeptOffsets);
  }
  // The KV's raw size, which a per-head chunk's shape does not imply.
  if (info.per_head()) Put64(h + kOffRawBytes, info.payload_bytes());
  Put64(h + kOffHeaderSum, XXH3_64bits(h, kOffHeaderSum));
}

Result<std::shared_ptr<const Chunk>> Chunk::Build(const ChunkInfo& info,
                                                  const std::function<void(uint8_t*)>& fill) {
  if (info.codec != KvCodec::kRaw) {
    return InvalidArgument("chunk " + info.key.ToHex() + ": Build makes raw chunks only");
  }
  KDN_RETURN_IF_ERROR(CheckKept(info));
  KDN_RETURN_IF_ERROR(CheckSteering(info));
  const size_t size = kHeaderBytes + info.annex_bytes() + info.payload_bytes();
  KDN_ASSIGN_OR_RETURN(std::shared_ptr<uint8_t> data, BufferPool::Default().Acquire(size));
  std::shared_ptr<Chunk> c(new Chunk());
  c->info_ = info;
  c->size_ = size;
  uint8_t* annex = data.get() + kHeaderBytes;
  for (uint32_t n : info.head_counts) annex = (Put32(annex, n), annex + 4);
  for (uint32_t k : info.kept) annex = (Put32(annex, k), annex + 4);
  if (!info.steering.empty()) {
    std::memcpy(data.get() + kHeaderBytes + info.kept_bytes(), info.steering.data(),
                info.steering.size());
  }
  fill(data.get() + kHeaderBytes + info.annex_bytes());
  c->SealHeader(data.get());
  c->data_ = std::move(data);
  return std::shared_ptr<const Chunk>(std::move(c));
}

Result<std::shared_ptr<const Chunk>> Chunk::Make(const ChunkInfo& info,
                                                 std::vector<uint8_t> payload) {
  if (payload.size() != info.payload_bytes()) {
    return InvalidArgument("chunk " + info.key.ToHex() + ": payload of " +
                           std::to_string(payload.size()) + " bytes, expected " +
                           std::to_string(info.payload_bytes()));
  }
  // An empty payload's data() may be null, which memcpy must not get.
  return Build(info, [&](uint8_t* out) {
    if (!payload.empty()) std::memcpy(out, payload.data(), payload.size());
  });
}

Result<std::shared_ptr<const Chunk>> Chunk::FromEncoded(const ChunkInfo& info,
                                                        std::vector<uint8_t> bytes) {
  if (info.codec == KvCodec::kRaw || info.pruned() || info.is_steering() ||
      bytes.size() < kHeaderBytes) {
    return InvalidArgument("chunk " + info.key.ToHex() +
                           ": FromEncoded needs a codec, room for the header, no pruning and "
                           "no steering");
  }
  auto owner = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  std::shared_ptr<Chunk> c(new Chunk());
  c->info_ = info;
  c->size_ = owner->size();
  c->SealHeader(owner->data());
  c->data_ = std::shared_ptr<const uint8_t>(owner, owner->data());
  return std::shared_ptr<const Chunk>(std::move(c));
}

Result<std::shared_ptr<const Chunk>> Chunk::Parse(std::vector<uint8_t> bytes) {
  const size_t size = bytes.size();
  auto owner = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
  return Parse(std::shared_ptr<const uint8_t>(owner, owner->data()), size);
}

uint64_t PayloadChecksum(const uint8_t* base, std::span<const Extent> extents) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (const Extent& e : extents) XXH3_64bits_update(&state, base + e.offset, e.bytes);
  return XXH3_64bits_digest(&state);
}

Result<ChunkHeaderFields> Chunk::ParseHeader(std::span<const uint8_t> header) {
  if (header.size() < kHeaderBytes) {
    return Corruption("chunk: " + std::to_string(header.size()) +
                      " bytes, shorter than its header");
  }
  const uint8_t* h = header.data();
  if (std::memcmp(h, kMagic, 8) != 0) return Corruption("chunk: bad magic");
  if (Get64(h + kOffHeaderSum) != XXH3_64bits(h, kOffHeaderSum)) {
    return Corruption("chunk: header checksum mismatch");
  }
  const uint32_t version = Get32(h + kOffVersion);
  // A whole header of a version, flag, codec or (from version 4) dtype this
  // build does not know is another kdn's chunk (UNIMPLEMENTED), not damage.
  if (version < kRawChunkFormatVersion || version > kChunkFormatVersion) {
    return Unimplemented("chunk: format version " + std::to_string(version) + ", this kdn reads " +
                         std::to_string(kRawChunkFormatVersion) + " to " +
                         std::to_string(kChunkFormatVersion));
  }
  // Versions 1-3 name one variant each; version 4 carries flags instead.
  const uint32_t flags = version == kChunkFormatVersion          ? Get32(h + kOffFlags)
                         : version == kEncodedChunkFormatVersion ? kFlagEncoded
                         : version == kPrunedChunkFormatVersion  ? kFlagPruned
                                                                 : 0;
  if ((flags & ~kKnownFlags) != 0) {
    return Unimplemented("chunk: unknown flags " + std::to_string(flags & ~kKnownFlags) +
                         " in a version " + std::to_string(version) + " chunk");
  }
  if ((flags & kFlagEncoded) != 0 && (flags & kFlagPruned) != 0) {
    return Unimplemented("chunk: this kdn does not read chunks both encoded and pruned");
  }
  if ((flags & kFlagSteering) != 0 && flags != kFlagSteering) {
    return Unimplemented("chunk: this kdn reads steering chunks raw and not pruned");
  }
  if ((flags & kFlagPerHead) != 0 && (flags & kFlagPruned) == 0) {
    return Unimplemented("chunk: per-head kept tokens on a chunk not pruned");
  }
  if (version != kChunkFormatVersion && Get32(h + kOffFlags) != 0) {
    return Corruption("chunk: flags in a version " + std::to_string(version) + " chunk");
  }
  const uint32_t codec = Get32(h + kOffCodec);
  const auto kvc = static_cast<uint32_t>(KvCodec::kKvc);
  if (codec != 0 && codec != kvc) {
    return Unimplemented("chunk: unknown codec " + std::to_string(codec) + " in a version " +
                         std::to_string(version) + " chunk");
  }
  const bool encoded = (flags & kFlagEncoded) != 0, pruned = (flags & kFlagPruned) != 0,
             steering = (flags & kFlagSteering) != 0, per_head = (flags & kFlagPerHead) != 0;
  // The fields of a part the chunk does not have are zero (raw_bytes is a
  // per-head chunk's too).
  if ((!encoded && Get32(h + kOffCodecLevel) != 0) ||
      (!encoded && !per_head && Get64(h + kOffRawBytes) != 0) ||
      (!pruned && (Get32(h + kOffLogical) != 0 || Get32(h + kOffKeptKind) != 0)) ||
      (!steering && Get32(h + kOffSteeringBytes) != 0)) {
    return Corruption("chunk: fields set for a part the version " + std::to_string(version) +
                      " chunk does not have");
  }
  if (encoded != (codec == kvc)) {
    return Corruption("chunk: codec " + std::to_string(codec) + " in a version " +
                      std::to_string(version) + " chunk " +
                      (encoded ? "marked encoded" : "not marked encoded"));
  }
  const uint32_t dtype_value = Get32(h + kOffDType);
  const std::optional<DType> dtype = DTypeFromValue(dtype_value);
  if (!dtype) {
    const std::string what = "chunk: unknown dtype " + std::to_string(dtype_value);
    // Version 4 names any dtype; versions 1-3 were written with these three.
    return version == kChunkFormatVersion ? Unimplemented(what) : Corruption(what);
  }
  ChunkHeaderFields f;
  ChunkInfo& info = f.info;
  info.key = ChunkKey::FromBytes(h + kOffKey);
  info.model_fingerprint = ChunkKey::FromBytes(h + kOffModel);
  info.dtype = *dtype;
  info.layers = Get32(h + kOffLayers);
  info.kv_heads = Get32(h + kOffKvHeads);
  info.head_dim = Get32(h + kOffHeadDim);
  info.tokens = Get32(h + kOffTokens);
  info.position = static_cast<int64_t>(Get64(h + kOffPosition));
  info.codec = static_cast<KvCodec>(codec);
  info.codec_level = info.codec == KvCodec::kRaw ? 0 : Get32(h + kOffCodecLevel);
  const std::string what = "chunk " + info.key.ToHex();
  // Shapes whose byte count would not fit in 64 bits are forged or damaged;
  // each field is a u32, so bounding the product by 2^62 in doubles is exact
  // enough to reject them before payload_bytes() could wrap.
  if (static_cast<double>(info.layers) * 2 * info.tokens * info.kv_heads * info.head_dim * 4 >
      0x1p62) {
    return Corruption(what + ": impossible shape");
  }
  if (pruned) {
    info.logical_tokens = Get32(h + kOffLogical);
    if (Get32(h + kOffKeptKind) != (per_head ? kKeptPerHead : kKeptOffsets) ||
        info.logical_tokens < info.tokens || info.logical_tokens == 0) {
      return Corruption(what + ": a pruned chunk of " + std::to_string(info.tokens) +
                        " tokens for " + std::to_string(info.logical_tokens) +
                        ", kept positions of kind " + std::to_string(Get32(h + kOffKeptKind)));
    }
  }
  if (per_head) {
    // raw_bytes holds the kept (head, token) pairs' K and V: at least one
    // slot of the fullest head, at most every slot of every head.
    const uint64_t raw = Get64(h + kOffRawBytes),
                   pair = uint64_t{2} * info.head_dim * DTypeSize(info.dtype);
    if (pair == 0 || raw % pair != 0 || info.tokens == 0 || raw / pair < info.tokens ||
        raw / pair > uint64_t{info.layers} * info.kv_heads * info.tokens) {
      return Corruption(what + ": a per-head chunk's KV of " + std::to_string(raw) + " bytes for " +
                        std::to_string(info.tokens) + " slots");
    }
    info.head_slots = raw / pair;
  }
  if (steering) {
    info.steering_bytes = Get32(h + kOffSteeringBytes);
    if (info.steering_bytes == 0)
      return Corruption(what + ": a steering chunk with no description");
  }
  f.payload_bytes = Get64(h + kOffPayloadBytes);
  f.payload_checksum = Get64(h + kOffPayloadSum);
  // An encoded chunk names the raw size its stream decodes to (checked again
  // by the decoder); its stored payload may be any size.
  if (info.codec != KvCodec::kRaw && Get64(h + kOffRawBytes) != info.payload_bytes()) {
    return Corruption(what + ": header says it decodes to " +
                      std::to_string(Get64(h + kOffRawBytes)) + " bytes, shape implies " +
                      std::to_string(info.payload_bytes()));
  }
  if (info.codec == KvCodec::kRaw && f.payload_bytes != info.annex_bytes() + info.payload_bytes()) {
    return Corruption(what + ": header says " + std::to_string(f.payload_bytes) +
                      " payload bytes, shape implies " +
                      std::to_string(info.annex_bytes() + info.payload_bytes()));
  }
  return f;
}

Result<std::shared_ptr<const Chunk>> Chunk::Parse(std::shared_ptr<const uint8_t> data,
                                                  size_t size) {
  KDN_ASSIGN_OR_RETURN(ChunkHeaderFields f, ParseHeader({data.get(), size}));
  const uint8_t* h = data.get();
  if (f.payload_bytes != size - kHeaderBytes) {
    return Corruption("chunk " + f.info.key.ToHex() + ": header says " +
                      std::to_string(f.payload_bytes) + " payload bytes, shape implies " +
                      std::to_string(f.info.payload_bytes()) + ", " +
                      std::to_string(size - kHeaderBytes) + " present");
  }
  if (f.payload_checksum != XXH3_64bits(h + kHeaderBytes, f.payload_bytes)) {
    return Corruption("chunk " + f.info.key.ToHex() + ": payload checksum mismatch");
  }
  if (f.info.pruned()) {
    const uint8_t* annex = h + kHeaderBytes;
    if (f.info.per_head()) {
      f.info.head_counts.resize(size_t{f.info.layers} * f.info.kv_heads);
      for (uint32_t& n : f.info.head_counts) n = Get32(annex), annex += 4;
    }
    f.info.kept.resize(f.info.per_head() ? f.info.head_slots : f.info.tokens);
    for (uint32_t& k : f.info.kept) k = Get32(annex), annex += 4;
    if (Status st = CheckKept(f.info); !st.ok()) return Corruption(st.message());
  }
  if (f.info.is_steering()) {
    const uint8_t* d = h + kHeaderBytes + f.info.kept_bytes();
    f.info.steering.assign(d, d + f.info.steering_bytes);
  }
  std::shared_ptr<Chunk> c(new Chunk());
  c->info_ = std::move(f.info);
  c->data_ = std::move(data);
  c->size_ = size;
  return std::shared_ptr<const Chunk>(std::move(c));
}

}  // namespace kdn::kvbus
