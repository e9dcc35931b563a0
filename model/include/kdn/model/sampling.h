#pragma once
// SamplingParams: how a request draws its tokens from the model's logits
// (greedy, temperature, top-k, top-p, seeded), as the router validates them
// and the wire carries them. The engine's Sampler (kdn/engine/sampler.h)
// draws by them. Thread-safe (values and functions over values).

#include <cstdint>

#include "kdn/common/status.h"

namespace kdn::model {

struct SamplingParams {
  float temperature = 1.0f;  // <= 0: greedy (argmax)
  int top_k = 0;             // 0: no limit
  float top_p = 1.0f;        // (0, 1]; 1: no limit
  uint64_t seed = 0;
};

// InvalidArgument for temperature NaN, top_k < 0, top_p outside (0, 1].
Status ValidateSamplingParams(const SamplingParams& p);

}  // namespace kdn::model
