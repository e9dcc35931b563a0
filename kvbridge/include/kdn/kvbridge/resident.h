#pragma once
// Resident KV by kdn's content keys (docs/engine.md, "Resident KV"): the
// engine's KV pool as the KDN's first tier. A worker publishes the spans of
// a prompt or a conversation (prefix chunks and tail pieces, under the keys
// kvbus gives them) into its cache's index when it is done with them, and a
// later request whose prefix they cover attaches those blocks by reference
// instead of loading its KV from the host tier, the disk tier or kdn-store.
// Called on the engine's thread (the cache's owner), except
// ResidentPrefixTokens, which reads only what KvCache::IsResident reads, and
// KeepResident, which KvCache::Keep makes safe on any thread.

#include <chrono>
#include <cstdint>
#include <span>

#include "kdn/common/status.h"
#include "kdn/engine/kv_cache.h"
#include "kdn/kvbus/key.h"

namespace kdn::kvbridge {

inline engine::KvKey ResidentKey(const kvbus::ChunkKey& key) { return {key.hi, key.lo}; }

// Publishes every span of `spans` (in position order, from position 0, as
// kvbus::StoredSpans gives them) that `seq` holds, the deepest first, so that
// eviction drops a chain's deepest entries before the ones they extend.
void PublishSpans(engine::KvCache& cache, const engine::KvSequence& seq,
                  std::span<const kvbus::KeyedSpan> spans);

// The longest prefix of `tokens`, at most `limit` tokens, that the cache
// holds resident (kvbus::MatchPrefix over KvCache::IsResident), attached to
// the empty sequence `seq` by reference. Returns the tokens attached (0 for
// none: `seq` stays empty).
Result<int64_t> AttachResidentPrefix(engine::KvCache& cache, engine::KvSequence& seq,
                                     const kvbus::KeyContext& ctx, std::span<const int32_t> tokens,
                                     std::span<const kvbus::ChunkKey> prefix_keys, int64_t limit,
                                     int64_t min_tail_tokens);

// What AttachResidentPrefix would attach, without attaching: for lookups,
// from any thread.
int64_t ResidentPrefixTokens(const engine::KvCache& cache, const kvbus::KeyContext& ctx,
                             std::span<const int32_t> tokens,
                             std::span<const kvbus::ChunkKey> prefix_keys, int64_t limit,
                             int64_t min_tail_tokens);

// Keeps the resident entries under `keys` (a pinned prefix's chunk keys)
// for `lease` from now, or lets them go with a zero lease: KvCache::Keep,
// which the engine's thread applies. Returns the keys taken.
size_t KeepResident(engine::KvCache& cache, std::span<const kvbus::ChunkKey> keys,
                    std::chrono::milliseconds lease);

}  // namespace kdn::kvbridge
