#pragma once
// Value steering as a request asks for it (docs/serving.md, "Steering a
// document"): a steering vector made from contrastive prompt pairs and stored
// in the KDN under a name, and a document's steered version, its stored KV
// with a vector added. Engine-free: kdn-router parses and checks these, the
// prefill worker makes and applies them (kdn/kvbridge/steer.h).
//
// Pure functions and values.

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "kdn/common/status.h"

namespace kdn::blend {

// A document's steered version: its stored KV with the steering vector named
// `vector` (in the request's namespace), times `strength`, added to the
// values of its last token at the vector's layers.
struct SteerSpec {
  std::string vector;
  float strength = 0;
  friend bool operator==(const SteerSpec&, const SteerSpec&) = default;
};

// A steering vector to make and store under `name`: the mean value
// difference of the pairs' last tokens (positive minus negative) at `layers`.
struct SteeringVectorSpec {
  std::string name;
  std::vector<int> layers;
  std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> pairs;
  friend bool operator==(const SteeringVectorSpec&, const SteeringVectorSpec&) = default;
};

// The largest steering strength a request may ask for: past it the measured
// efficacy no longer rises and specificity falls (docs/kvbus.md, "Editing
// stored KV": 8 already costs 9 points of specificity).
inline constexpr double kMaxSteerStrength = 16.0;
// The most prompt pairs one vector is made from: each is two prefills.
inline constexpr size_t kMaxSteeringPairs = 256;
// The longest name, in bytes.
inline constexpr size_t kMaxSteeringNameBytes = 128;

// OK for a finite strength, not 0, of magnitude at most kMaxSteerStrength.
Status CheckSteerStrength(double strength);
// OK for a name of 1 to kMaxSteeringNameBytes bytes of letters, digits, '.',
// '_' and '-'.
Status CheckSteeringName(std::string_view name);
// OK for a spec whose name passes CheckSteeringName, of 1 to
// kMaxSteeringPairs pairs of non-empty prompts of at most `max_context`
// tokens, and of ascending distinct layers in [0, num_layers), at least one.
Status CheckSteeringVectorSpec(const SteeringVectorSpec& spec, int num_layers, int64_t max_context);
// The name, pairs and layers of a POST /v1/kdn/steering body (its other
// fields are the caller's: kdn-router refuses unknown ones, and takes
// cache_salt), each prompt made tokens by `encode` (as a request's prompt,
// after a BOS), the layers the middle third when it names none; checked as
// CheckSteeringVectorSpec does. INVALID_ARGUMENT otherwise, with *param the
// field at fault ("name", "pairs", "pairs[2].negative", "layers").
Result<SteeringVectorSpec> ParseSteeringBody(
    const nlohmann::json& body,
    const std::function<std::vector<int32_t>(const std::string&)>& encode, int num_layers,
    int64_t max_context, std::string* param);
// The layers a vector is made at when the request names none: the middle
// third, [num_layers / 3, 2 * num_layers / 3), at least one (as the measured
// vector of docs/kvbus.md, "Editing stored KV").
std::vector<int> MiddleThirdLayers(int num_layers);

}  // namespace kdn::blend
