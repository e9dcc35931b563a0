#pragma once
// A prompt's KV from a worker's lower KDN tiers into its KV pool, as both
// workers place it: the spans kvbus::FetchPrefix fetched past what the pool
// holds resident (kvbridge/resident.h) go into the request's sequence.
// Fetching and putting (kdn/kvbus/prefix_io.h) touch only the store, so that
// the decode worker runs them on its store I/O thread; placing touches the
// cache, on the engine's thread.

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/kv_cache.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/key.h"

namespace kdn::kvbridge {

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
                         std::span<const kvbus::FetchedSpan> fetched, int64_t resident);

}  // namespace kdn::kvbridge
