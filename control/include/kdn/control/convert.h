#pragma once
// Conversions between the serving protocol's generated types
// (proto/serving.proto) and the project's own, so that generated types stay
// at the edges. Thread-safe (pure functions).

#include <string>
#include <string_view>

#include "kdn/common/status.h"
#include "kdn/kvbus/key.h"
#include "kdn/model/sampling.h"
#include "serving.pb.h"

namespace kdn::control {

// An OK Status leaves `out` cleared (code 0).
void StatusToProto(const Status& status, proto::Error* out);
// Code 0 is OK; an unknown code becomes INTERNAL, keeping the message.
Status StatusFromProto(const proto::Error& error);

void SamplingToProto(const model::SamplingParams& p, proto::Sampling* out);
model::SamplingParams SamplingFromProto(const proto::Sampling& p);

// A key as its 16 canonical bytes, and back (INVALID_ARGUMENT unless 16 bytes).
std::string KeyToBytes(const kvbus::ChunkKey& key);
Result<kvbus::ChunkKey> KeyFromBytes(std::string_view bytes);

}  // namespace kdn::control
