#include "kdn/kvbus/key.h"

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <memory>

namespace kdn::kvbus {

namespace {

ChunkKey FromXxh(XXH128_hash_t h) { return ChunkKey{h.high64, h.low64}; }

void PutU32(XXH3_state_t* st, uint32_t v) {
  uint8_t b[4];
  for (int i = 0; i < 4; ++i) b[i] = static_cast<uint8_t>(v >> (8 * i));
  XXH3_128bits_update(st, b, 4);
}

void PutKey(XXH3_state_t* st, const ChunkKey& k) {
  uint8_t b[16];
  k.ToBytes(b);
  XXH3_128bits_update(st, b, 16);
}

// The namespace, length-prefixed so that ("ab", tokens) and ("a", "b"...)
// can never produce the same byte stream.
void PutNamespace(XXH3_state_t* st, const std::string& ns) {
  PutU32(st, static_cast<uint32_t>(ns.size()));
  XXH3_128bits_update(st, ns.data(), ns.size());
}

void PutTokens(XXH3_state_t* st, std::span<const int32_t> tokens) {
  // Little-endian u32 regardless of the host, in pieces to bound the buffer.
  uint8_t buf[1024];
  size_t n = 0;
  for (int32_t t : tokens) {
    const auto u = static_cast<uint32_t>(t);
    for (int i = 0; i < 4; ++i) buf[n++] = static_cast<uint8_t>(u >> (8 * i));
    if (n == sizeof(buf)) {
      XXH3_128bits_update(st, buf, n);
      n = 0;
    }
  }
  XXH3_128bits_update(st, buf, n);
}

struct StateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};
using State = std::unique_ptr<XXH3_state_t, StateDeleter>;

State NewState() {
  State st(XXH3_createState());
  XXH3_128bits_reset_withSeed(st.get(), kChunkKeyVersion);
  return st;
}

}  // namespace

std::string ChunkKey::ToHex() const {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return buf;
}

Result<ChunkKey> ChunkKey::FromHex(std::string_view hex) {
  if (hex.size() != 32)
    return InvalidArgument("chunk key must be 32 hex digits, got \"" + std::string(hex) + "\"");
  ChunkKey k;
  for (size_t i = 0; i < 32; ++i) {
    const char c = hex[i];
    int v;
    if (c >= '0' && c <= '9')
      v = c - '0';
    else if (c >= 'a' && c <= 'f')
      v = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F')
      v = c - 'A' + 10;
    else
      return InvalidArgument("chunk key \"" + std::string(hex) + "\" is not hex");
    uint64_t& half = i < 16 ? k.hi : k.lo;
    half = (half << 4) | static_cast<uint64_t>(v);
  }
  return k;
}

void ChunkKey::ToBytes(uint8_t out[16]) const {
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<uint8_t>(hi >> (56 - 8 * i));
    out[8 + i] = static_cast<uint8_t>(lo >> (56 - 8 * i));
  }
}

ChunkKey ChunkKey::FromBytes(const uint8_t in[16]) {
  ChunkKey k;
  for (int i = 0; i < 8; ++i) {
    k.hi = (k.hi << 8) | in[i];
    k.lo = (k.lo << 8) | in[8 + i];
  }
  return k;
}

std::vector<ChunkKey> PrefixKeys(const KeyContext& ctx, std::span<const int32_t> tokens) {
  std::vector<ChunkKey> keys;
  if (ctx.chunk_tokens <= 0) return keys;
  const size_t n = tokens.size() / static_cast<size_t>(ctx.chunk_tokens);
  keys.reserve(n);
  ChunkKey parent;  // all zeros for the first chunk
  for (size_t i = 0; i < n; ++i) {
    State st = NewState();
    PutKey(st.get(), parent);
    PutKey(st.get(), ctx.model_fingerprint);
    PutNamespace(st.get(), ctx.ns);
    PutTokens(st.get(), tokens.subspan(i * ctx.chunk_tokens, ctx.chunk_tokens));
    parent = FromXxh(XXH3_128bits_digest(st.get()));
    keys.push_back(parent);
  }
  return keys;
}

ChunkKey TailKey(const KeyContext& ctx, const ChunkKey& parent, std::span<const int32_t> tokens) {
  State st = NewState();
  XXH3_128bits_update(st.get(), "tail", 4);
  PutKey(st.get(), parent);
  PutKey(st.get(), ctx.model_fingerprint);
  PutNamespace(st.get(), ctx.ns);
  PutU32(st.get(), static_cast<uint32_t>(tokens.size()));
  PutTokens(st.get(), tokens);
  return FromXxh(XXH3_128bits_digest(st.get()));
}

namespace {

// The largest piece a tail may have after its anchor: the highest power of
// two below chunk_tokens - 1 (a tail has at most chunk_tokens - 1 tokens).
int64_t LargestPiece(int chunk_tokens) {
  const auto rest = static_cast<uint64_t>(std::max(chunk_tokens - 2, 1));
  return static_cast<int64_t>(std::bit_floor(rest));
}

}  // namespace

std::vector<KeyedSpan> TailSpans(const KeyContext& ctx, std::span<const int32_t> tokens,
                                 std::span<const ChunkKey> prefix_keys) {
  std::vector<KeyedSpan> spans;
  if (ctx.chunk_tokens <= 1) return spans;
  const auto full = static_cast<int64_t>(tokens.size()) / ctx.chunk_tokens;
  int64_t pos = full * ctx.chunk_tokens;
  const auto end = static_cast<int64_t>(tokens.size());
  if (pos == end) return spans;
  ChunkKey parent = full > 0 ? prefix_keys[full - 1] : ChunkKey{};
  int64_t size = 1;  // the anchor, then the binary digits of the rest
  while (pos < end) {
    parent = TailKey(ctx, parent, tokens.subspan(pos, size));
    spans.push_back({parent, pos, size});
    pos += size;
    if (pos < end) size = static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(end - pos)));
  }
  return spans;
}

std::vector<KeyedSpan> StoredSpans(const KeyContext& ctx, std::span<const int32_t> tokens,
                                   std::span<const ChunkKey> prefix_keys) {
  std::vector<KeyedSpan> spans;
  for (size_t i = 0; i < prefix_keys.size(); ++i) {
    spans.push_back({prefix_keys[i], static_cast<int64_t>(i) * ctx.chunk_tokens, ctx.chunk_tokens});
  }
  for (const KeyedSpan& s : TailSpans(ctx, tokens, prefix_keys)) spans.push_back(s);
  return spans;
}

std::vector<KeyedSpan> MatchTail(const KeyContext& ctx, std::span<const int32_t> tokens,
                                 std::span<const ChunkKey> prefix_keys, int64_t full_chunks,
                                 int64_t limit, const std::function<bool(const KeyedSpan&)>& held) {
  std::vector<KeyedSpan> spans;
  const int64_t first = full_chunks * ctx.chunk_tokens;
  limit =
      std::min<int64_t>({limit, ctx.chunk_tokens - 1, static_cast<int64_t>(tokens.size()) - first});
  if (ctx.chunk_tokens <= 1 || full_chunks < 0 ||
      full_chunks > static_cast<int64_t>(prefix_keys.size()) || limit < 1) {
    return spans;
  }
  ChunkKey parent = full_chunks > 0 ? prefix_keys[full_chunks - 1] : ChunkKey{};
  int64_t pos = first;
  const auto probe = [&](int64_t size) {
    KeyedSpan s{TailKey(ctx, parent, tokens.subspan(pos, size)), pos, size};
    if (!held(s)) return false;
    spans.push_back(s);
    parent = s.key;
    pos += size;
    return true;
  };
  if (!probe(1)) return spans;  // no tail stored here: one probe
  for (int64_t size = LargestPiece(ctx.chunk_tokens); size >= 1; size >>= 1) {
    if (pos + size - first <= limit) (void)probe(size);
  }
  return spans;
}

std::vector<KeyedSpan> MatchPrefix(const KeyContext& ctx, std::span<const int32_t> tokens,
                                   std::span<const ChunkKey> prefix_keys, int64_t limit,
                                   int64_t min_tail_tokens,
                                   const std::function<bool(const KeyedSpan&)>& held) {
  std::vector<KeyedSpan> spans;
  const int64_t C = ctx.chunk_tokens;
  if (C <= 0) return spans;
  int64_t full = 0;
  for (; full < static_cast<int64_t>(prefix_keys.size()) && (full + 1) * C <= limit; ++full) {
    const KeyedSpan s{prefix_keys[full], full * C, C};
    if (!held(s)) break;
    spans.push_back(s);
  }
  const std::vector<KeyedSpan> tail =
      MatchTail(ctx, tokens, prefix_keys, full, limit - full * C, held);
  if (!tail.empty() && SpannedTokens(tail) - full * C >= min_tail_tokens) {
    spans.insert(spans.end(), tail.begin(), tail.end());
  }
  return spans;
}

ChunkKey SegmentKey(const KeyContext& ctx, std::span<const int32_t> tokens) {
  State st = NewState();
  XXH3_128bits_update(st.get(), "seg", 3);
  PutKey(st.get(), ctx.model_fingerprint);
  PutNamespace(st.get(), ctx.ns);
  PutTokens(st.get(), tokens);
  return FromXxh(XXH3_128bits_digest(st.get()));
}

ChunkKey SteeringVectorKey(const KeyContext& ctx, const std::string& name) {
  State st = NewState();
  XXH3_128bits_update(st.get(), "steer-vec", 9);
  PutKey(st.get(), ctx.model_fingerprint);
  PutNamespace(st.get(), ctx.ns);
  PutNamespace(st.get(), name);  // length-prefixed as the namespace is
  return FromXxh(XXH3_128bits_digest(st.get()));
}

ChunkKey SteeredKey(const ChunkKey& document, const ChunkKey& vector, float strength) {
  State st = NewState();
  XXH3_128bits_update(st.get(), "steered", 7);
  PutKey(st.get(), document);
  PutKey(st.get(), vector);
  PutU32(st.get(), std::bit_cast<uint32_t>(strength));
  return FromXxh(XXH3_128bits_digest(st.get()));
}

}  // namespace kdn::kvbus

namespace kdn::kvbus {

ChunkKey TransferKey(std::span<const uint8_t> transfer_id) {
  State st = NewState();
  XXH3_128bits_update(st.get(), "xfer", 4);
  PutU32(st.get(), static_cast<uint32_t>(transfer_id.size()));
  XXH3_128bits_update(st.get(), transfer_id.data(), transfer_id.size());
  return FromXxh(XXH3_128bits_digest(st.get()));
}

ChunkKey LayerSliceKey(const ChunkKey& parent, int layer) {
  State st = NewState();
  XXH3_128bits_update(st.get(), "slice", 5);
  PutKey(st.get(), parent);
  PutU32(st.get(), static_cast<uint32_t>(layer));
  return FromXxh(XXH3_128bits_digest(st.get()));
}

}  // namespace kdn::kvbus
