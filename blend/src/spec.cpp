#include "kdn/blend/spec.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>

namespace kdn::blend {

Result<BlendSelection> ParseBlendSelection(std::string_view text) {
  BlendSelection s;
  std::string_view name = text, k;
  if (const size_t colon = text.find(':'); colon != std::string_view::npos) {
    name = text.substr(0, colon);
    k = text.substr(colon + 1);
  }
  if (name == "deviation") {
    s.kind = BlendSelection::Kind::kDeviation;
  } else if (name == "random") {
    s.kind = BlendSelection::Kind::kRandom;
  } else if (name == "boundary") {
    s.kind = BlendSelection::Kind::kBoundary;
  } else if (name == "boundary+deviation") {
    s.kind = BlendSelection::Kind::kBoundaryDeviation;
  } else if (name == "query") {
    s.kind = BlendSelection::Kind::kQuery;
  } else if (name == "query+boundary") {
    s.kind = BlendSelection::Kind::kQueryBoundary;
  } else {
    return InvalidArgument("blend selection '" + std::string(text) +
                           "' is none of deviation, random, boundary:K, boundary+deviation[:K], "
                           "query, query+boundary[:K]");
  }
  const bool boundary = s.kind == BlendSelection::Kind::kBoundary ||
                        s.kind == BlendSelection::Kind::kBoundaryDeviation ||
                        s.kind == BlendSelection::Kind::kQueryBoundary;
  if (!boundary) {
    if (!k.empty() || text.find(':') != std::string_view::npos) {
      return InvalidArgument("blend selection '" + std::string(text) + "' takes no :K");
    }
    return s;
  }
  s.boundary_tokens = kDefaultBoundaryTokens;
  if (text.find(':') != std::string_view::npos) {
    int v = 0;
    size_t i = 0;
    for (; i < k.size() && k[i] >= '0' && k[i] <= '9' && v <= kMaxBoundaryTokens; ++i) {
      v = v * 10 + (k[i] - '0');
    }
    if (k.empty() || i != k.size() || v < 1 || v > kMaxBoundaryTokens) {
      return InvalidArgument("blend selection '" + std::string(text) + "': K must be 1 to " +
                             std::to_string(kMaxBoundaryTokens));
    }
    s.boundary_tokens = v;
  }
  return s;
}

std::string BlendSelectionName(const BlendSelection& s) {
  switch (s.kind) {
    case BlendSelection::Kind::kDeviation: return "deviation";
    case BlendSelection::Kind::kRandom: return "random";
    case BlendSelection::Kind::kBoundary: return "boundary:" + std::to_string(s.boundary_tokens);
    case BlendSelection::Kind::kBoundaryDeviation:
      return "boundary+deviation:" + std::to_string(s.boundary_tokens);
    case BlendSelection::Kind::kQuery: return "query";
    case BlendSelection::Kind::kQueryBoundary:
      return "query+boundary:" + std::to_string(s.boundary_tokens);
  }
  return "deviation";
}

std::vector<int> ResolveCheckLayers(int check_layer, std::span<const int> check_layers,
                                    bool ratios_named, int num_layers) {
  std::vector<int> out(check_layers.begin(), check_layers.end());
  if (!out.empty()) return out;
  for (int l = check_layer; l < check_layer + 3 && l < num_layers; ++l) out.push_back(l);
  if (out.size() < 2 || ratios_named) out.clear();
  return out;
}

std::vector<double> DefaultCheckRatios(double ratio, size_t checks) {
  std::vector<double> out(checks, ratio);
  if (checks < 2) return out;
  const double first = std::min(1.0, 2 * ratio);
  for (size_t i = 0; i + 1 < checks; ++i) {
    const double f = static_cast<double>(checks - 1 - i) / static_cast<double>(checks - 1);
    out[i] = ratio + (first - ratio) * f;
  }
  return out;
}

Result<std::vector<CheckStep>> CheckSchedule(double recompute_ratio, int check_layer,
                                             std::span<const int> check_layers,
                                             std::span<const double> check_ratios, int num_layers) {
  const std::string layers_range = "[0, " + std::to_string(num_layers) + ")";
  if (!(recompute_ratio >= 0 && recompute_ratio <= 1)) {
    return InvalidArgument("recompute_ratio must be in [0, 1]");
  }
  if (check_layers.empty()) {
    if (!check_ratios.empty()) return InvalidArgument("check_ratios need check_layers");
    if (check_layer < 0 || check_layer >= num_layers) {
      return InvalidArgument("check_layer must be in " + layers_range);
    }
    return std::vector<CheckStep>{{check_layer, recompute_ratio}};
  }
  std::vector<double> ratios(check_ratios.begin(), check_ratios.end());
  if (ratios.empty()) ratios = DefaultCheckRatios(recompute_ratio, check_layers.size());
  if (ratios.size() != check_layers.size()) {
    return InvalidArgument("check_ratios must give one ratio per check layer");
  }
  std::vector<CheckStep> out;
  for (size_t i = 0; i < check_layers.size(); ++i) {
    if (check_layers[i] < 0 || check_layers[i] >= num_layers) {
      return InvalidArgument("check_layers must be in " + layers_range);
    }
    if (i > 0 && check_layers[i] <= check_layers[i - 1]) {
      return InvalidArgument("check_layers must be ascending");
    }
    if (!(ratios[i] >= 0 && ratios[i] <= 1)) {
      return InvalidArgument("check_ratios must be in [0, 1]");
    }
    if (i > 0 && ratios[i] > ratios[i - 1]) {
      return InvalidArgument("check_ratios must not increase");
    }
    out.push_back({check_layers[i], ratios[i]});
  }
  if (std::abs(ratios.back() - recompute_ratio) > 1e-9) {
    return InvalidArgument("the last of check_ratios must equal recompute_ratio");
  }
  return out;
}

}  // namespace kdn::blend
