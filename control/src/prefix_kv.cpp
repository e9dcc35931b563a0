#include "kdn/control/prefix_kv.h"

#include <algorithm>

#include "kdn/control/worker_setup.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbridge/resident.h"

namespace kdn::control {

std::vector<FetchedSpan> FetchPrefix(kvbus::ChunkStore& store, const kvbus::KeyContext& ctx,
                                     std::span<const int32_t> tokens,
                                     std::span<const kvbus::ChunkKey> prefix_keys, int64_t limit,
                                     int64_t min_tail_tokens, int64_t resident,
                                     kvbus::KvDType dtype) {
  std::vector<FetchedSpan> fetched;
  const auto spans = kvbus::MatchPrefix(
      ctx, tokens, prefix_keys, limit, min_tail_tokens, [&](const kvbus::KeyedSpan& s) {
        if (s.first + s.count <= resident) {  // attached from the pool
          fetched.emplace_back(s, nullptr);
          return true;
        }
        if (!kvbridge::WorthFetchingPast(s, resident, ctx.chunk_tokens, min_tail_tokens)) {
          return false;
        }
        auto chunk = store.Get(s.key);
        if (!chunk.ok() || !ChunkFits(**chunk, ctx.model_fingerprint, s.count, dtype)) {
          return false;
        }
        fetched.emplace_back(s, *std::move(chunk));
        return true;
      });
  // The spans accepted are the match's, in order; a tail match too short to
  // use is dropped from its end.
  fetched.resize(spans.size());
  return fetched;
}

PlacedPrefix PlacePrefix(engine::KvCache& cache, engine::KvSequence& seq,
                         std::span<const FetchedSpan> fetched, int64_t resident) {
  PlacedPrefix out;
  for (const auto& [span, chunk] : fetched) {
    if (span.first != out.tokens) break;
    if (chunk == nullptr) {
      if (span.first + span.count > resident) break;
    } else {
      // Across the end of the resident prefix: only the part past it (the
      // blocks below are shared).
      const int64_t skip = std::max<int64_t>(resident - span.first, 0);
      if (!kvbridge::ChunkToPagedKv(*chunk, cache, seq, span.first, skip).ok()) break;
      ++out.chunks;
      out.kv_bytes +=
          cache.LayerBytes(span.count - skip, kvbridge::EngineDType(chunk->info().dtype)) *
          cache.num_layers();
    }
    out.tokens += span.count;
  }
  return out;
}

PutOutcome PutMissing(kvbus::ChunkStore& store,
                      std::span<const std::shared_ptr<const kvbus::Chunk>> chunks) {
  PutOutcome out;
  // What the store holds already, in one batch (one round trip to a
  // remote tier).
  std::vector<kvbus::ChunkKey> keys;
  keys.reserve(chunks.size());
  for (const auto& c : chunks) keys.push_back(c->key());
  const std::vector<bool> held = store.ContainsMany(keys);
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (held[i]) {
      ++out.already_held;
      continue;
    }
    if (Status st = store.Put(chunks[i]); !st.ok()) {
      out.not_stored = chunks.size() - i;
      out.error = st;
      break;
    }
    ++out.stored;
  }
  return out;
}

}  // namespace kdn::control
