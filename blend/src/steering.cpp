#include "kdn/blend/steering.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

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

Result<SteeringVectorSpec> ParseSteeringBody(
    const nlohmann::json& body,
    const std::function<std::vector<int32_t>(const std::string&)>& encode, int num_layers,
    int64_t max_context, std::string* param) {
  using nlohmann::json;
  const auto bad = [&](std::string message, std::string field) {
    *param = std::move(field);
    return InvalidArgument(std::move(message));
  };
  // A field that is absent or null is not set.
  const auto set = [&](const char* name) {
    return body.is_object() && body.contains(name) && !body[name].is_null();
  };
  SteeringVectorSpec spec;
  if (!set("name") || !body["name"].is_string()) {
    return bad("'name' must be the steering vector's name", "name");
  }
  spec.name = body["name"].get<std::string>();
  if (Status st = CheckSteeringName(spec.name); !st.ok()) return bad(st.message(), "name");
  const json& pairs = set("pairs") ? body["pairs"] : json();
  if (!pairs.is_array() || pairs.empty() || pairs.size() > kMaxSteeringPairs) {
    return bad("'pairs' must be a list of 1 to " + std::to_string(kMaxSteeringPairs) +
                   " {\"positive\", \"negative\"} prompt pairs",
               "pairs");
  }
  for (size_t i = 0; i < pairs.size(); ++i) {
    const std::string at = "pairs[" + std::to_string(i) + "]";
    const json& p = pairs[i];
    if (!p.is_object() || p.size() != 2 || !p.contains("positive") || !p.contains("negative") ||
        !p["positive"].is_string() || !p["negative"].is_string()) {
      return bad(at + " must be {\"positive\": TEXT, \"negative\": TEXT}", at);
    }
    std::vector<int32_t> pos = encode(p["positive"].get<std::string>());
    std::vector<int32_t> neg = encode(p["negative"].get<std::string>());
    for (const auto& [prompt, side] : {std::pair{&pos, "positive"}, {&neg, "negative"}}) {
      if (p[side].get<std::string>().empty()) {
        return bad(at + "." + side + " is empty", at + "." + side);
      }
      if (static_cast<int64_t>(prompt->size()) > max_context) {
        return bad(at + "." + side + " has " + std::to_string(prompt->size()) +
                       " tokens; a prompt has 1 to the model's context of " +
                       std::to_string(max_context),
                   at + "." + side);
      }
    }
    spec.pairs.emplace_back(std::move(pos), std::move(neg));
  }
  if (set("layers")) {
    const json& layers = body["layers"];
    if (!layers.is_array() || layers.empty()) {
      return bad("'layers' must be a list of layers", "layers");
    }
    for (const json& l : layers) {
      // Read wide: a huge number must not wrap into a layer.
      if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() >= num_layers) {
        return bad(
            "'layers' must be a list of the model's layers, 0 to " + std::to_string(num_layers - 1),
            "layers");
      }
      spec.layers.push_back(static_cast<int>(l.get<int64_t>()));
    }
  } else {
    spec.layers = MiddleThirdLayers(num_layers);
  }
  if (Status st = CheckSteeringVectorSpec(spec, num_layers, max_context); !st.ok()) {
    return bad(st.message(), "layers");
  }
  return spec;
}

std::vector<int> MiddleThirdLayers(int num_layers) {
  std::vector<int> layers;
  const int first = num_layers / 3, end = std::max(2 * num_layers / 3, first + 1);
  for (int l = first; l < std::min(end, num_layers); ++l) layers.push_back(l);
  return layers;
}

}  // namespace kdn::blend
