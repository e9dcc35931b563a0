#pragma once
// A prompt's KV between a KDN store and whoever holds the prompt (a kdn
// worker, or another engine through the client library): fetch the longest
// prefix the store holds past what the caller holds already, and put a
// finished prompt's or conversation's new chunks. They touch only the
// store, never an engine. Thread-safe if the store is.

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/key.h"

namespace kdn::kvbus {

// Whether a chunk from the KDN can be written into a caller's KV as
// `tokens` tokens: that many, computed by this model (`fingerprint`, which
// covers the engine's KV element type) and decoded to `dtype`. Another
// chunking, model or precision is recomputed rather than guessed at. A
// pruned chunk never fits: a prefix's KV is every token's; nor does a
// steering vector's chunk, which is not KV.
bool ChunkFits(const Chunk& chunk, const ChunkKey& fingerprint, int64_t tokens, DType dtype);
// The same for a document's chunk under its segment key, which a blend
// takes pruned too (per head as well): KV standing for `tokens` tokens of
// text.
bool SegmentChunkFits(const Chunk& chunk, const ChunkKey& fingerprint, int64_t tokens, DType dtype);

// Whether a lower tier's span `s` is worth fetching past a prefix of
// `resident` tokens the caller holds already: one wholly past it is; one
// across its end is written from there on only, and a whole chunk of which
// fewer than `min_tail_tokens` lie past it is not (a chunk fetched from a
// remote store for a token or two of it costs more than computing them: the
// next turn of a chat whose prompt is resident and whose conversation the
// decode worker stored).
inline bool WorthFetchingPast(const KeyedSpan& s, int64_t resident, int chunk_tokens,
                              int64_t min_tail_tokens) {
  if (s.first >= resident) return true;
  return s.count < chunk_tokens || s.first + s.count - resident >= min_tail_tokens;
}

// The prompt's leading spans (MatchPrefix, at most `limit` tokens): those
// within the first `resident` tokens without a chunk (the caller holds
// them), then those `store` gives that fit the model (`ctx`'s fingerprint,
// `dtype`: ChunkFits) and are worth fetching past the resident prefix
// (WorthFetchingPast). A miss or an unreachable store ends them.
std::vector<FetchedSpan> FetchPrefix(ChunkStore& store, const KeyContext& ctx,
                                     std::span<const int32_t> tokens,
                                     std::span<const ChunkKey> prefix_keys, int64_t limit,
                                     int64_t min_tail_tokens, int64_t resident, DType dtype);

// How many leading tokens of the prompt the caller (its first `resident`
// tokens) and `store` hold together: MatchPrefix's reach, at most `limit`
// tokens, without reading a chunk. The full chunks past the resident prefix
// are asked about in one ContainsMany (one round trip to a remote tier);
// tail pieces, each asked only if the one before it is held, one by one.
int64_t StoredPrefixTokens(ChunkStore& store, const KeyContext& ctx,
                           std::span<const int32_t> tokens, std::span<const ChunkKey> prefix_keys,
                           int64_t limit, int64_t min_tail_tokens, int64_t resident);

struct PutOutcome {
  uint64_t stored = 0;
  uint64_t already_held = 0;
  uint64_t not_stored = 0;  // after a failed Put: that chunk and the rest
  Status error;             // the failed Put's
};

// Puts each chunk that `store` lacks (asked in one ContainsMany), in order;
// a failed Put ends it (prefix keys: the chunks past it are never reached
// without it).
PutOutcome PutMissing(ChunkStore& store, std::span<const std::shared_ptr<const Chunk>> chunks);

}  // namespace kdn::kvbus
