#pragma once
// Value steering of stored KV (docs/kvbus.md, "Editing stored KV"): a
// steering vector is the mean difference of the value rows that contrastive
// prompt pairs leave at their last token, at chosen layers (KV cache
// steering, arXiv 2507.08799; values in the middle layers, as "Knowledge
// Packs", arXiv 2604.03270, found that keys do not steer); a steered chunk
// is a stored chunk with that vector, times a strength, added to the values
// of some of its tokens. Keys are never changed.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/engine.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/steering.h"

namespace kdn::kvbridge {

using kvbus::SteeringVector;

// The mean over `pairs` of (value row of the positive prompt's last token)
// minus (the negative's), at `layers`, each prompt prefilled alone from
// position 0. INVALID_ARGUMENT for no pairs, an empty prompt, or layers out
// of the model's or not ascending.
Result<SteeringVector> ValueSteeringVector(
    engine::Engine& model, std::string name,
    std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> pairs,
    std::vector<int> layers);

// A copy of `chunk` under `key` with strength * the vector added to the
// value rows of its stored tokens [first, first + count) at the vector's
// layers; keys and every other value unchanged, bf16/f16 values rounded
// back to their type. INVALID_ARGUMENT when the vector's shape or layers do
// not fit the chunk, the tokens are not in it, or it is encoded.
Result<std::shared_ptr<const kvbus::Chunk>> SteerChunkValues(const kvbus::Chunk& chunk,
                                                             const SteeringVector& vector,
                                                             float strength, int64_t first,
                                                             int64_t count,
                                                             const kvbus::ChunkKey& key);

}  // namespace kdn::kvbridge
