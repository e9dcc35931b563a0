#include "kdn/blend/emphasis.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kdn/blend/steering.h"

namespace kdn::blend {

std::vector<EmphasisHead> MiddleThirdHeads(int num_layers, int num_heads) {
  std::vector<EmphasisHead> heads;
  for (int l : MiddleThirdLayers(num_layers)) {
    for (int h = 0; h < num_heads; ++h) heads.push_back({l, h});
  }
  return heads;
}

Status CheckEmphasisHeads(std::span<const EmphasisHead> heads, int num_layers, int num_heads) {
  if (heads.empty()) return InvalidArgument("no heads to emphasize in");
  std::set<std::pair<int, int>> seen;
  for (const EmphasisHead& h : heads) {
    const std::string name = "[" + std::to_string(h.layer) + ", " + std::to_string(h.head) + "]";
    if (h.layer < 0 || h.layer >= num_layers || h.head < 0 || h.head >= num_heads) {
      return InvalidArgument("head " + name + " is not in the model (layers 0 to " +
                             std::to_string(num_layers - 1) + ", query heads 0 to " +
                             std::to_string(num_heads - 1) + ")");
    }
    if (!seen.emplace(h.layer, h.head).second) {
      return InvalidArgument("head " + name + " is named twice");
    }
  }
  return Status::Ok();
}

Status CheckEmphasisStrength(double strength) {
  if (std::isfinite(strength) && strength > 0 && strength <= kMaxEmphasisStrength) {
    return Status::Ok();
  }
  std::ostringstream s;
  s << "an emphasis strength must be in (0, " << kMaxEmphasisStrength << "], not " << strength;
  return InvalidArgument(s.str());
}

Result<double> ParseEmphasisStrength(const std::string& text) {
  double strength = 0;
  size_t used = 0;
  try {
    strength = std::stod(text, &used);
  } catch (...) {
    used = 0;
  }
  if (used == 0) return InvalidArgument("not a number: " + text);
  KDN_RETURN_IF_ERROR(CheckEmphasisStrength(strength));
  return strength;
}

Result<std::vector<EmphasisHead>> ParseEmphasisProfile(std::string_view json_text) {
  const nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgument("an emphasis profile is a JSON object with 'profiled_heads'");
  }
  const auto it = j.find("profiled_heads");
  if (it == j.end() || !it->is_array() || it->empty()) {
    return InvalidArgument("an emphasis profile's 'profiled_heads' must be a non-empty list");
  }
  std::vector<EmphasisHead> heads;
  for (size_t i = 0; i < it->size(); ++i) {
    const nlohmann::json& h = (*it)[i];
    const auto layer = h.is_object() ? h.find("layer") : h.end();
    const auto head = h.is_object() ? h.find("head") : h.end();
    const auto small = [](const nlohmann::json& n) {
      return n.is_number_integer() && n.get<int64_t>() >= INT32_MIN &&
             n.get<int64_t>() <= INT32_MAX;
    };
    if (layer == h.end() || head == h.end() || !small(*layer) || !small(*head)) {
      return InvalidArgument("an emphasis profile's profiled_heads[" + std::to_string(i) +
                             "] must be {\"layer\": L, \"head\": H} with integers");
    }
    heads.push_back({layer->get<int>(), head->get<int>()});
  }
  return heads;
}

Result<std::vector<EmphasisHead>> LoadEmphasisProfile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("cannot read the emphasis profile " + path);
  std::ostringstream text;
  text << in.rdbuf();
  auto heads = ParseEmphasisProfile(text.str());
  if (!heads.ok()) return InvalidArgument(path + ": " + heads.status().message());
  return heads;
}

std::vector<std::pair<int64_t, int64_t>> MergeSpans(
    std::vector<std::pair<int64_t, int64_t>> spans) {
  std::erase_if(spans, [](const auto& s) { return s.second <= s.first; });
  std::sort(spans.begin(), spans.end());
  std::vector<std::pair<int64_t, int64_t>> merged;
  for (const auto& s : spans) {
    if (!merged.empty() && s.first <= merged.back().second) {
      merged.back().second = std::max(merged.back().second, s.second);
    } else {
      merged.push_back(s);
    }
  }
  return merged;
}

Emphasis MakeEmphasis(std::vector<std::pair<int64_t, int64_t>> spans,
                      std::span<const EmphasisHead> heads, double strength, int num_layers,
                      int num_heads) {
  Emphasis e;
  e.spans = MergeSpans(std::move(spans));
  e.heads = num_heads;
  e.bias.assign(static_cast<size_t>(num_layers) * num_heads, 0.0f);
  for (const EmphasisHead& h : heads) {
    e.bias[static_cast<size_t>(h.layer) * num_heads + h.head] = static_cast<float>(strength);
  }
  return e;
}

}  // namespace kdn::blend
