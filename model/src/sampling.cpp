#include "kdn/model/sampling.h"

#include <cmath>
#include <string>

namespace kdn::model {

Status ValidateSamplingParams(const SamplingParams& p) {
  if (std::isnan(p.temperature)) return InvalidArgument("temperature is NaN");
  if (p.top_k < 0) return InvalidArgument("top_k must be >= 0, got " + std::to_string(p.top_k));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return InvalidArgument("top_p must be in (0, 1], got " + std::to_string(p.top_p));
  }
  return Status::Ok();
}

}  // namespace kdn::model
