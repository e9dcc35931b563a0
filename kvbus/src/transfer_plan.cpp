#include "kdn/kvbus/transfer_plan.h"

#include <algorithm>
#include <string>

namespace kdn::kvbus {

namespace {

ChunkKey TransferKeyOf(std::string_view id) {
  return TransferKey({reinterpret_cast<const uint8_t*>(id.data()), id.size()});
}

}  // namespace

std::vector<KvRegion> TransferRegions(std::span<const ChunkKey> prefix_keys, int64_t prompt_tokens,
                                      int chunk_tokens, int64_t held_tokens,
                                      std::string_view transfer_id) {
  std::vector<KvRegion> regions;
  const int64_t C = chunk_tokens;
  const auto full = static_cast<int64_t>(prefix_keys.size());
  int64_t pos = std::clamp<int64_t>(held_tokens, 0, prompt_tokens);
  if (pos < full * C && pos % C != 0) {
    std::string gap(transfer_id);
    for (int i = 0; i < 8; ++i) gap += static_cast<char>(static_cast<uint64_t>(pos) >> (8 * i));
    const int64_t end = (pos / C + 1) * C;
    regions.push_back({TransferKeyOf(gap), pos, end - pos, true});
    pos = end;
  }
  for (int64_t i = pos / C; i < full; ++i) {
    regions.push_back({prefix_keys[i], i * C, C, false});
  }
  pos = std::max(pos, full * C);
  if (prompt_tokens > pos) {
    regions.push_back({TransferKeyOf(transfer_id), pos, prompt_tokens - pos, true});
  }
  return regions;
}

}  // namespace kdn::kvbus
