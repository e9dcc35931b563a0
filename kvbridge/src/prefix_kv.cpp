#include "kdn/kvbridge/prefix_kv.h"

#include <algorithm>

#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbridge/resident.h"

namespace kdn::kvbridge {

PlacedPrefix PlacePrefix(engine::KvCache& cache, engine::KvSequence& seq,
                         std::span<const kvbus::FetchedSpan> fetched, int64_t resident) {
  PlacedPrefix out;
  for (const auto& [span, chunk] : fetched) {
    if (span.first != out.tokens) break;
    // A chunk read for tokens the pool holds resident by now (a prefetch
    // that read before it did) is not placed either.
    if (chunk == nullptr || span.first + span.count <= resident) {
      if (span.first + span.count > resident) break;
    } else {
      // Across the end of the resident prefix: only the part past it (the
      // blocks below are shared).
      const int64_t skip = std::max<int64_t>(resident - span.first, 0);
      if (!kvbridge::ChunkToPagedKv(*chunk, cache, seq, span.first, skip).ok()) break;
      ++out.chunks;
      out.kv_bytes += cache.LayerBytes(span.count - skip, chunk->info().dtype) * cache.num_layers();
    }
    out.tokens += span.count;
  }
  return out;
}

}  // namespace kdn::kvbridge
