#include "kdn/kvbus/prefix_io.h"

#include <algorithm>

namespace kdn::kvbus {

bool SegmentChunkFits(const Chunk& chunk, const ChunkKey& fingerprint, int64_t tokens,
                      DType dtype) {
  const ChunkInfo& info = chunk.info();
  return info.logical() == static_cast<uint32_t>(tokens) && info.model_fingerprint == fingerprint &&
         info.dtype == dtype && !chunk.encoded() && !info.is_steering();
}

bool ChunkFits(const Chunk& chunk, const ChunkKey& fingerprint, int64_t tokens, DType dtype) {
  return !chunk.info().pruned() && SegmentChunkFits(chunk, fingerprint, tokens, dtype);
}

std::vector<FetchedSpan> FetchPrefix(ChunkStore& store, const KeyContext& ctx,
                                     std::span<const int32_t> tokens,
                                     std::span<const ChunkKey> prefix_keys, int64_t limit,
                                     int64_t min_tail_tokens, int64_t resident, DType dtype) {
  std::vector<FetchedSpan> fetched;
  const auto spans =
      MatchPrefix(ctx, tokens, prefix_keys, limit, min_tail_tokens, [&](const KeyedSpan& s) {
        if (s.first + s.count <= resident) {  // attached from the pool
          fetched.emplace_back(s, nullptr);
          return true;
        }
        if (!WorthFetchingPast(s, resident, ctx.chunk_tokens, min_tail_tokens)) {
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

int64_t StoredPrefixTokens(ChunkStore& store, const KeyContext& ctx,
                           std::span<const int32_t> tokens, std::span<const ChunkKey> prefix_keys,
                           int64_t limit, int64_t min_tail_tokens, int64_t resident) {
  const int64_t C = ctx.chunk_tokens;
  const size_t full_max =
      C <= 0 ? 0
             : std::min(prefix_keys.size(), static_cast<size_t>(std::max<int64_t>(limit, 0) / C));
  const size_t skip = C <= 0 ? 0 : std::min(full_max, static_cast<size_t>(resident / C));
  const std::vector<bool> full_held =
      store.ContainsMany(prefix_keys.subspan(skip, full_max - skip));
  const auto held =
      MatchPrefix(ctx, tokens, prefix_keys, limit, min_tail_tokens, [&](const KeyedSpan& s) {
        if (s.first + s.count <= resident) return true;
        const size_t i = static_cast<size_t>(s.first / C);
        if (s.count == C && s.first % C == 0 && i >= skip && i < full_max &&
            s.key == prefix_keys[i]) {
          return static_cast<bool>(full_held[i - skip]);
        }
        return store.Contains(s.key);
      });
  return SpannedTokens(held);
}

PutOutcome PutMissing(ChunkStore& store, std::span<const std::shared_ptr<const Chunk>> chunks) {
  PutOutcome out;
  // What the store holds already, in one batch (one round trip to a
  // remote tier).
  std::vector<ChunkKey> keys;
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

}  // namespace kdn::kvbus
