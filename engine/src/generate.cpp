#include "kdn/engine/generate.h"

#include <algorithm>
#include <chrono>

namespace kdn::engine {

Result<GenerateResult> Generate(Engine& model, std::span<const int32_t> prompt,
                                const GenerateOptions& options) {
  KDN_RETURN_IF_ERROR(model::ValidateSamplingParams(options.sampling));
  if (options.max_tokens < 0) return InvalidArgument("max_tokens must be >= 0");
  if (prompt.empty()) return InvalidArgument("empty prompt");
  const int64_t max_ctx = model.config().max_context;
  if (static_cast<int64_t>(prompt.size()) > max_ctx) {
    return InvalidArgument("prompt of " + std::to_string(prompt.size()) +
                           " tokens exceeds the model's context of " + std::to_string(max_ctx));
  }
  GenerateResult result;
  result.finish_reason = "length";
  if (options.max_tokens == 0) return result;

  using Clock = std::chrono::steady_clock;
  KvSequence seq = model.kv_cache().NewSequence();
  Sampler sampler(options.sampling);
  std::vector<float> logits;  // of the prompt's last token
  auto t0 = Clock::now();
  KDN_RETURN_IF_ERROR(model.Prefill(seq, prompt, PrefillOptions{}, &logits));
  auto t1 = Clock::now();
  result.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();

  int32_t token = sampler.Sample(logits);
  for (;;) {
    result.tokens.push_back(token);
    if (options.on_token && !options.on_token(token)) {
      result.finish_reason = "stop";
      break;
    }
    if (std::find(options.stop_ids.begin(), options.stop_ids.end(), token) !=
        options.stop_ids.end()) {
      result.finish_reason = "stop";
      break;
    }
    if (static_cast<int>(result.tokens.size()) >= options.max_tokens) break;
    if (seq.length() + 1 > max_ctx) {
      result.finish_reason = "context";
      break;
    }
    KvSequence* batch[1] = {&seq};
    Sampler* samplers[1] = {&sampler};
    std::vector<int32_t> next;
    KDN_RETURN_IF_ERROR(
        model.DecodeSample(batch, std::span<const int32_t>(&token, 1), samplers, &next));
    token = next[0];
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  return result;
}

Result<std::vector<int32_t>> GreedyTokens(Engine& model, KvSequence& seq, std::vector<float> logits,
                                          int max_tokens,
                                          const std::function<bool(int32_t)>& stop) {
  std::vector<int32_t> out;
  KvSequence* s = &seq;
  while (static_cast<int>(out.size()) < max_tokens) {
    out.push_back(Argmax(logits));
    if ((stop && stop(out.back())) || static_cast<int>(out.size()) == max_tokens) break;
    KDN_RETURN_IF_ERROR(
        model.DecodeStep(std::span<KvSequence* const>(&s, 1), {&out.back(), 1}, &logits));
  }
  return out;
}

}  // namespace kdn::engine
