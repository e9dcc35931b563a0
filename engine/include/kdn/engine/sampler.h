#pragma once
// Token sampling from logits by a request's model::SamplingParams: greedy,
// temperature, top-k, top-p, seeded.
// A Sampler owns its random stream, so a seed reproduces a sequence exactly,
// on any machine (the generator is xoshiro256**, not the standard library's
// implementation-defined distributions). Not thread-safe; one per sequence.

#include <cstdint>
#include <span>

#include "kdn/common/status.h"
#include "kdn/model/sampling.h"

namespace kdn::engine {

// Index of the largest logit (the first one on ties).
int32_t Argmax(std::span<const float> logits);

class Sampler {
 public:
  explicit Sampler(const model::SamplingParams& params);
  int32_t Sample(std::span<const float> logits);
  const model::SamplingParams& params() const { return params_; }
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
  model::SamplingParams params_;
  uint64_t s_[4];
};

}  // namespace kdn::engine
