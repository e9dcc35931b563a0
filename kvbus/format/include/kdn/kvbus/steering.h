#pragma once
// A value steering vector (docs/kvbus.md, "Editing stored KV") and the chunk
// the KDN stores it as ("Steering vector chunks"): what kvbridge/steer.h
// makes and applies, and what libkdn_client reads, with no engine.
//
// Values; pure functions.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"

namespace kdn::kvbus {

struct SteeringVector {
  std::string name;
  std::vector<int> layers;  // ascending, distinct
  int kv_heads = 0;
  int head_dim = 0;
  // Per layer of `layers`: kv_heads * head_dim values, a value row's shape.
  std::vector<float> values;
  // The pairs it was made from (token ids), positive then negative.
  std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> pairs;

  size_t row() const { return static_cast<size_t>(kv_heads) * head_dim; }
};

// A vector as the KDN stores it under `key` (SteeringVectorKey;
// docs/kvbus.md, "Steering vector chunks"): a chunk of one f32 token, of the
// model's `model_layers` layers, whose values at the vector's layers are the
// vector (keys and the other layers zero), with the name, the layers and the
// pairs as its description. INVALID_ARGUMENT for a vector of no layers, of
// layers past the model's, or of values not of its shape.
Result<std::shared_ptr<const Chunk>> SteeringChunk(const SteeringVector& vector, int model_layers,
                                                   const ChunkKey& key,
                                                   const ChunkKey& model_fingerprint);
// The vector a steering chunk holds. INVALID_ARGUMENT for a chunk that is not
// a steering vector's; CORRUPTION for a description that does not parse or
// does not fit the chunk (a writer's bug: the checksums passed).
Result<SteeringVector> SteeringFromChunk(const Chunk& chunk);
// What a steered version's key names the vector by (SteeredKey): a hash of
// the chunk's description and values, so that a name made again from other
// pairs (after its vector left the KDN) never finds versions of the old one.
ChunkKey SteeringVectorId(const Chunk& chunk);

}  // namespace kdn::kvbus
