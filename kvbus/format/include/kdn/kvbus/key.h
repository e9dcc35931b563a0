#pragma once
// Chunk keys: the content addresses of KV chunks (spec: docs/kvbus.md).
//
// A prompt is cut into chunks of `chunk_tokens` tokens. The key of chunk i is
// a 128-bit XXH3 hash chained over the previous chunk's key, the model
// fingerprint, the tenant namespace and the chunk's tokens, so equal keys
// mean equal prefixes (prefix keys); a segment key hashes one run of tokens
// alone, wherever it sits (position-independent, for blend). Keys are the
// same in every process and on every machine: no per-process randomness.
// Thread-safe: pure functions over values.

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::kvbus {

// The key format version; it is the XXH3 seed, so a new version never
// collides with keys of an old one.
inline constexpr uint64_t kChunkKeyVersion = 1;
inline constexpr int kDefaultChunkTokens = 256;

struct ChunkKey {
  uint64_t hi = 0;
  uint64_t lo = 0;

  friend bool operator==(const ChunkKey&, const ChunkKey&) = default;
  friend auto operator<=>(const ChunkKey&, const ChunkKey&) = default;
  bool is_zero() const { return hi == 0 && lo == 0; }
  // 32 lowercase hex digits, hi first (XXH128's canonical big-endian order).
  std::string ToHex() const;
  static Result<ChunkKey> FromHex(std::string_view hex);
  // The 16 canonical bytes (big-endian hi, then lo), as hashed and stored.
  void ToBytes(uint8_t out[16]) const;
  static ChunkKey FromBytes(const uint8_t in[16]);
};

struct ChunkKeyHash {
  size_t operator()(const ChunkKey& k) const {
    return static_cast<size_t>(k.lo ^ (k.hi * 0x9e3779b97f4a7c15ull));
  }
};

// What, besides the tokens, keys depend on. The model fingerprint comes from
// kvbridge::ModelFingerprint (kdn/kvbridge/fingerprint.h).
struct KeyContext {
  ChunkKey model_fingerprint;
  std::string ns;  // the tenant's cache salt; empty by default
  int chunk_tokens = kDefaultChunkTokens;
};

// The prefix keys of the full chunks of `tokens`; a partial last chunk has no
// key. keys[i] covers tokens [0, (i+1) * chunk_tokens).
std::vector<ChunkKey> PrefixKeys(const KeyContext& ctx, std::span<const int32_t> tokens);

// The tail of a prompt or conversation: the tokens past its last full chunk
// (docs/kvbus.md, "Tail keys"). A tail of L tokens (0 < L < chunk_tokens) is
// keyed as pieces: one token first (the anchor), then the other L - 1 tokens
// in pieces whose sizes are the binary digits of L - 1, largest first. Each
// piece's key chains over the key before it (the last full chunk's prefix
// key for the anchor; the zero key when there is no full chunk), so a
// piece's key names its whole prefix. A lookup probes the anchor, and only
// when it is held the piece sizes from the largest down: at most
// 1 + bit_width(chunk_tokens - 2) probes, one for a prompt whose tail was
// never stored.
struct KeyedSpan {
  ChunkKey key;
  int64_t first = 0;  // first token position
  int64_t count = 0;
  friend bool operator==(const KeyedSpan&, const KeyedSpan&) = default;
};

// The key of one tail piece `tokens`, after `parent`.
ChunkKey TailKey(const KeyContext& ctx, const ChunkKey& parent, std::span<const int32_t> tokens);

// The pieces of the tail of `tokens` (the tokens past its last full chunk),
// as they are stored; none when the tail is empty. `prefix_keys` are
// PrefixKeys(ctx, tokens).
std::vector<KeyedSpan> TailSpans(const KeyContext& ctx, std::span<const int32_t> tokens,
                                 std::span<const ChunkKey> prefix_keys);

// Every span of `tokens` as it is stored: its full chunks under their prefix
// keys (`prefix_keys`), then its tail pieces (TailSpans).
std::vector<KeyedSpan> StoredSpans(const KeyContext& ctx, std::span<const int32_t> tokens,
                                   std::span<const ChunkKey> prefix_keys);

// The longest chain of stored tail pieces that `tokens` continues after its
// first `full_chunks` full chunks (whose prefix keys are `prefix_keys`),
// covering at most `limit` tokens: the last step of a prefix match. `held`
// says whether a piece is held (a lookup's Contains, or a load's Get that
// keeps what it finds and refuses what it cannot use); it is called at most
// 1 + bit_width(chunk_tokens - 2) times, in position order.
std::vector<KeyedSpan> MatchTail(const KeyContext& ctx, std::span<const int32_t> tokens,
                                 std::span<const ChunkKey> prefix_keys, int64_t full_chunks,
                                 int64_t limit, const std::function<bool(const KeyedSpan&)>& held);

// A tail match shorter than this is not used: every prompt that starts with
// a BOS token finds that token's anchor, and a few tokens of KV cost less to
// compute than to fetch (docs/kvbus.md, "Tail keys").
inline constexpr int64_t kMinTailTokens = 16;

// The longest prefix of `tokens` whose KV `held` finds, at most `limit`
// tokens: its full chunks by prefix key (`prefix_keys`, stopping at the
// first that is not held), then MatchTail, whose match is dropped when it
// covers fewer than `min_tail_tokens`. Spans in position order: a prefix of
// those `held` accepted.
std::vector<KeyedSpan> MatchPrefix(const KeyContext& ctx, std::span<const int32_t> tokens,
                                   std::span<const ChunkKey> prefix_keys, int64_t limit,
                                   int64_t min_tail_tokens,
                                   const std::function<bool(const KeyedSpan&)>& held);

// The tokens a run of spans from position 0 covers (0 for none).
inline int64_t SpannedTokens(std::span<const KeyedSpan> spans) {
  return spans.empty() ? 0 : spans.back().first + spans.back().count;
}

// The position-independent key of one segment (a document) of any length.
ChunkKey SegmentKey(const KeyContext& ctx, std::span<const int32_t> tokens);

// The key of the steering vector named `name` (docs/kvbus.md, "Steering
// vector chunks"): one vector per name, model and namespace.
ChunkKey SteeringVectorKey(const KeyContext& ctx, const std::string& name);
// The key of a document's steered version: its segment key (`document`)
// with the vector whose id is `vector` (kvbus::SteeringVectorId, a hash of
// the vector's content) added at `strength` (its binary32 bits).
ChunkKey SteeredKey(const ChunkKey& document, const ChunkKey& vector, float strength);

// Keys of the KV that moves between a prefill and a decode worker one layer
// at a time (docs/kvbus.md, "Layer slices"). A transfer key names the part of
// one request's KV that has no content key (the tokens past its last full
// chunk), from an id unique to the request; a layer slice key names one
// layer of the KV that `parent` (a prefix key or a transfer key) names.
ChunkKey TransferKey(std::span<const uint8_t> transfer_id);
ChunkKey LayerSliceKey(const ChunkKey& parent, int layer);

}  // namespace kdn::kvbus

template <>
struct std::hash<kdn::kvbus::ChunkKey> : kdn::kvbus::ChunkKeyHash {};
