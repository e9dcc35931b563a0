#include "kdn/kvbus/transfer_plan.h"

#include <algorithm>
#include <string>

namespace kdn::kvbus {

ChunkKey TransferRegionKey(std::string_view transfer_id, int64_t first) {
  std::string id(transfer_id);
  for (int i = 0; i < 8; ++i) id += static_cast<char>(static_cast<uint64_t>(first) >> (8 * i));
  return TransferKey({reinterpret_cast<const uint8_t*>(id.data()), id.size()});
}

std::vector<KvRegion> TransferRegions(int64_t full_chunks, int64_t prompt_tokens, int chunk_tokens,
                                      int64_t held_tokens, std::string_view transfer_id) {
  std::vector<KvRegion> regions;
  const int64_t C = chunk_tokens;
  const int64_t full = std::max<int64_t>(full_chunks, 0);
  const auto add = [&](int64_t first, int64_t count) {
    regions.push_back({TransferRegionKey(transfer_id, first), first, count});
  };
  int64_t pos = std::clamp<int64_t>(held_tokens, 0, prompt_tokens);
  if (pos < full * C && pos % C != 0) {  // the gap to the next chunk boundary
    const int64_t end = (pos / C + 1) * C;
    add(pos, end - pos);
    pos = end;
  }
  for (int64_t i = pos / C; i < full; ++i) add(i * C, C);
  pos = std::max(pos, full * C);
  if (prompt_tokens > pos) add(pos, prompt_tokens - pos);
  return regions;
}

}  // namespace kdn::kvbus
