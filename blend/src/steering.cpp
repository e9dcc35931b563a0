#include "kdn/blend/steering.h"

#include <algorithm>
#include <cmath>

namespace kdn::blend {

Status CheckSteerStrength(double strength) {
  if (!std::isfinite(strength) || strength == 0 || std::abs(strength) > kMaxSteerStrength) {
    return InvalidArgument("a steering strength must be a number, not 0, of magnitude at most " +
                           std::to_string(static_cast<int>(kMaxSteerStrength)));
  }
  return Status::Ok();
}

Status CheckSteeringName(std::string_view name) {
  const bool chars_ok = std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
  if (name.empty() || name.size() > kMaxSteeringNameBytes || !chars_ok) {
    return InvalidArgument("a steering vector's name is 1 to " +
                           std::to_string(kMaxSteeringNameBytes) +
                           " letters, digits, '.', '_' or '-'");
  }
  return Status::Ok();
}

Status CheckSteeringVectorSpec(const SteeringVectorSpec& spec, int num_layers,
                               int64_t max_context) {
  KDN_RETURN_IF_ERROR(CheckSteeringName(spec.name));
  if (spec.pairs.empty() || spec.pairs.size() > kMaxSteeringPairs) {
    return InvalidArgument("a steering vector is made from 1 to " +
                           std::to_string(kMaxSteeringPairs) + " prompt pairs, not " +
                           std::to_string(spec.pairs.size()));
  }
  for (size_t i = 0; i < spec.pairs.size(); ++i) {
    for (const auto* prompt : {&spec.pairs[i].first, &spec.pairs[i].second}) {
      if (prompt->empty() || static_cast<int64_t>(prompt->size()) > max_context) {
        return InvalidArgument(
            "pair " + std::to_string(i) + " has a prompt of " + std::to_string(prompt->size()) +
            " tokens; each has 1 to the model's context of " + std::to_string(max_context));
      }
    }
  }
  if (spec.layers.empty()) return InvalidArgument("a steering vector needs at least one layer");
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    if (spec.layers[i] < 0 || spec.layers[i] >= num_layers ||
        (i > 0 && spec.layers[i] <= spec.layers[i - 1])) {
      return InvalidArgument("layers must be ascending and distinct, in [0, " +
                             std::to_string(num_layers) + ")");
    }
  }
  return Status::Ok();
}

std::vector<int> MiddleThirdLayers(int num_layers) {
  std::vector<int> layers;
  const int first = num_layers / 3, end = std::max(2 * num_layers / 3, first + 1);
  for (int l = first; l < std::min(end, num_layers); ++l) layers.push_back(l);
  return layers;
}

}  // namespace kdn::blend
