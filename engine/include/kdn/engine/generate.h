#pragma once
// One sequence, start to end, on one Engine: prefill the prompt, then decode
// until max_tokens, a stop id, or the context is full. What kdn-generate and
// the tests run; workers split the same steps across processes.

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/engine.h"
#include "kdn/engine/sampler.h"

namespace kdn::engine {

struct GenerateOptions {
  int max_tokens = 64;
  model::SamplingParams sampling;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one (it is kept)
  // Called with each new token; returning false stops generation.
  std::function<bool(int32_t)> on_token;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated, not the prompt
  std::string finish_reason;    // "length", "stop" or "context"
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;  // all steps after the first token
};

Result<GenerateResult> Generate(Engine& model, std::span<const int32_t> prompt,
                                const GenerateOptions& options);

// Greedy tokens continuing `seq`, whose prompt gave `logits` (a prefill or
// a blend already run on it): at most max_tokens, ending with the first one
// for which stop (if given) is true.
Result<std::vector<int32_t>> GreedyTokens(Engine& model, KvSequence& seq, std::vector<float> logits,
                                          int max_tokens,
                                          const std::function<bool(int32_t)>& stop = nullptr);

}  // namespace kdn::engine
