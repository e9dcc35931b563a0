#include "kdn/control/transfer_plan.h"

#include <algorithm>

namespace kdn::control {

std::vector<KvRegion> TransferRegions(std::span<const kvbus::ChunkKey> prefix_keys,
                                      int64_t prompt_tokens, int chunk_tokens, int held_chunks,
                                      std::string_view transfer_id) {
  std::vector<KvRegion> regions;
  const auto full = static_cast<int64_t>(prefix_keys.size());
  const int64_t held = std::clamp<int64_t>(held_chunks, 0, full);
  for (int64_t i = held; i < full; ++i) {
    regions.push_back({prefix_keys[i], i * chunk_tokens, chunk_tokens, false});
  }
  if (prompt_tokens > full * chunk_tokens) {
    const auto* id = reinterpret_cast<const uint8_t*>(transfer_id.data());
    regions.push_back({kvbus::TransferKey({id, transfer_id.size()}), full * chunk_tokens,
                       prompt_tokens - full * chunk_tokens, true});
  }
  return regions;
}

}  // namespace kdn::control
