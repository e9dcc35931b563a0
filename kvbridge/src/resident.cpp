#include "kdn/kvbridge/resident.h"

#include <vector>

namespace kdn::kvbridge {

void PublishSpans(engine::KvCache& cache, const engine::KvSequence& seq,
                  std::span<const kvbus::KeyedSpan> spans) {
  for (auto s = spans.rbegin(); s != spans.rend(); ++s) {
    const int64_t end = s->first + s->count;
    if (s->count > 0 && end <= seq.length()) cache.Publish(seq, ResidentKey(s->key), end);
  }
}

namespace {

std::vector<kvbus::KeyedSpan> MatchResident(const engine::KvCache& cache,
                                            const kvbus::KeyContext& ctx,
                                            std::span<const int32_t> tokens,
                                            std::span<const kvbus::ChunkKey> prefix_keys,
                                            int64_t limit, int64_t min_tail_tokens) {
  return kvbus::MatchPrefix(
      ctx, tokens, prefix_keys, limit, min_tail_tokens,
      [&](const kvbus::KeyedSpan& s) { return cache.IsResident(ResidentKey(s.key)); });
}

}  // namespace

Result<int64_t> AttachResidentPrefix(engine::KvCache& cache, engine::KvSequence& seq,
                                     const kvbus::KeyContext& ctx, std::span<const int32_t> tokens,
                                     std::span<const kvbus::ChunkKey> prefix_keys, int64_t limit,
                                     int64_t min_tail_tokens) {
  const std::vector<kvbus::KeyedSpan> spans =
      MatchResident(cache, ctx, tokens, prefix_keys, limit, min_tail_tokens);
  if (spans.empty()) return int64_t{0};
  std::vector<engine::KvKey> chain;
  chain.reserve(spans.size());
  for (const kvbus::KeyedSpan& s : spans) chain.push_back(ResidentKey(s.key));
  KDN_RETURN_IF_ERROR(cache.Attach(seq, chain));
  const int64_t want = kvbus::SpannedTokens(spans);
  if (seq.length() != want) {
    // An entry ends where its span does; anything else is a bug.
    const int64_t got = seq.length();
    seq.Reset();
    return Internal("resident KV: an entry of " + std::to_string(got) +
                    " tokens under a key that spans " + std::to_string(want));
  }
  return want;
}

int64_t ResidentPrefixTokens(const engine::KvCache& cache, const kvbus::KeyContext& ctx,
                             std::span<const int32_t> tokens,
                             std::span<const kvbus::ChunkKey> prefix_keys, int64_t limit,
                             int64_t min_tail_tokens) {
  return kvbus::SpannedTokens(
      MatchResident(cache, ctx, tokens, prefix_keys, limit, min_tail_tokens));
}

size_t KeepResident(engine::KvCache& cache, std::span<const kvbus::ChunkKey> keys,
                    std::chrono::milliseconds lease) {
  std::vector<engine::KvKey> resident;
  resident.reserve(keys.size());
  for (const kvbus::ChunkKey& k : keys) resident.push_back(ResidentKey(k));
  return cache.Keep(resident, lease, std::chrono::steady_clock::now());
}

}  // namespace kdn::kvbridge
