#pragma once
// A prompt's KV between a worker's KV pool and its lower KDN tiers (host,
// disk, kdn-store), as both workers move it: fetch the longest prefix the
// tiers hold past what the pool holds resident (kvbridge/resident.h), place
// it in the request's sequence, and put a finished prompt's or
// conversation's new chunks. Fetching and putting touch only the store, so
// that the decode worker runs them on its store I/O thread; placing touches
// the cache, on the engine's thread.

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/kv_cache.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/key.h"

namespace kdn::control {

// A span of the prompt and its chunk; no chunk for a span the pool holds.
using FetchedSpan = std::pair<kvbus::KeyedSpan, std::shared_ptr<const kvbus::Chunk>>;

// The prompt's leading spans (kvbus::MatchPrefix, at most `limit` tokens):
// those within the first `resident` tokens without a chunk (attached from
// the pool), then those `store` gives that fit the model (`ctx`'s
// fingerprint, `dtype`) and are worth fetching past the resident prefix
// (kvbridge::WorthFetchingPast). A miss or an unreachable store ends them.
std::vector<FetchedSpan> FetchPrefix(kvbus::ChunkStore& store, const kvbus::KeyContext& ctx,
                                     std::span<const int32_t> tokens,
                                     std::span<const kvbus::ChunkKey> prefix_keys, int64_t limit,
                                     int64_t min_tail_tokens, int64_t resident,
                                     kvbus::KvDType dtype);

struct PlacedPrefix {
  int64_t tokens = 0;     // leading tokens the sequence holds, the resident ones counted
  uint64_t chunks = 0;    // chunks and tail pieces written
  uint64_t kv_bytes = 0;  // their KV, in the cache's element type
};

// Writes FetchPrefix's chunks into `seq` (which holds the first `resident`
// tokens by reference and has room for the rest), in order, up to the first
// that does not go in; a chunk across the end of the resident prefix from
// there on only.
PlacedPrefix PlacePrefix(engine::KvCache& cache, engine::KvSequence& seq,
                         std::span<const FetchedSpan> fetched, int64_t resident);

struct PutOutcome {
  uint64_t stored = 0;
  uint64_t already_held = 0;
  uint64_t not_stored = 0;  // after a failed Put: that chunk and the rest
  Status error;             // the failed Put's
};

// Puts each chunk that `store` lacks, in order; a failed Put ends it (prefix
// keys: the chunks past it are never reached without it).
PutOutcome PutMissing(kvbus::ChunkStore& store,
                      std::span<const std::shared_ptr<const kvbus::Chunk>> chunks);

}  // namespace kdn::control
