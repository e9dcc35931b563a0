#pragma once
// Token sampling from logits: greedy, temperature, top-k, top-p, seeded.
// A Sampler owns its random stream, so a seed reproduces a sequence exactly,
// on any machine (the generator is xoshiro256**, not the standard library's
// implementation-defined distributions). Not thread-safe; one per sequence.

#include <cstdint>
#include <span>

#include "kdn/common/status.h"

namespace kdn::engine {

struct SamplingParams {
  float temperature = 1.0f;  // <= 0: greedy (argmax)
  int top_k = 0;             // 0: no limit
  float top_p = 1.0f;        // (0, 1]; 1: no limit
  uint64_t seed = 0;
};

// InvalidArgument for temperature NaN, top_k < 0, top_p outside (0, 1].
Status ValidateSamplingParams(const SamplingParams& p);

// Index of the largest logit (the first one on ties).
int32_t Argmax(std::span<const float> logits);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  int32_t Sample(std::span<const float> logits);
  const SamplingParams& params() const { return params_; }
  // Moves the random stream on as `samples` calls of Sample would have, so
  // that a sequence sampled partly in one process (the first token, by a
  // prefill worker) continues in another exactly as in one.
  void Advance(int samples);
  // The uniform draw Sample would make for its next token, moving the stream
  // on as Sample does, or a negative value (the stream unmoved) where Sample
  // is an argmax: for sampling on a device with the request's own stream
  // (cuda::DeviceSampler).
  double NextDraw();

 private:
  double NextUniform();  // [0, 1)
  SamplingParams params_;
  uint64_t s_[4];
};

}  // namespace kdn::engine
