#pragma once
// The request fields that cross the router -> worker edge and their one
// conversion to and from proto/serving.proto: the blend and prune specs
// (declared with their defaults and rules in kdn/blend/spec.h and
// kdn/prune/spec.h) and the default length of an answer. The router's spec
// (router/request_spec.h) and the prefill worker's job
// (prefill_worker/prefiller.h) use these types, not copies of them.
//
// Thread-compatible values.

#include <optional>

#include "kdn/blend/spec.h"
#include "kdn/blend/steering.h"
#include "kdn/common/kv_block.h"
#include "kdn/common/status.h"
#include "kdn/prune/spec.h"

namespace kdn::proto {
class BlendSpec;
class Emphasis;
class PruneSpec;
class SteerSpec;
class SteeringVectorSpec;
}  // namespace kdn::proto

namespace kdn::control {

// Tokens generated in all, the first included, when a request names none.
inline constexpr int kDefaultMaxTokens = 16;
// The blend and prune specs (kdn/blend/spec.h, kdn/prune/spec.h) on the wire.
void BlendToProto(const blend::BlendSpec& spec, proto::BlendSpec* out);
blend::BlendSpec BlendFromProto(const proto::BlendSpec& p);

// Emphasis (blend::Emphasis) on the wire: in BlendSpec and PrepareRequest.
void EmphasisToProto(const blend::Emphasis& e, proto::Emphasis* out);
blend::Emphasis EmphasisFromProto(const proto::Emphasis& p);

// Steering (kdn/blend/steering.h) on the wire: a document's steered version
// (an empty vector name: none) and a vector to make.
void SteerToProto(const blend::SteerSpec& s, proto::SteerSpec* out);
std::optional<blend::SteerSpec> SteerFromProto(const proto::SteerSpec& p);
void SteeringVectorToProto(const blend::SteeringVectorSpec& s, proto::SteeringVectorSpec* out);
blend::SteeringVectorSpec SteeringVectorFromProto(const proto::SteeringVectorSpec& p);

void PruneToProto(const prune::PruneSpec& spec, proto::PruneSpec* out);
// INVALID_ARGUMENT for a granularity this kdn does not know.
Result<prune::PruneSpec> PruneFromProto(const proto::PruneSpec& p);

}  // namespace kdn::control
