#pragma once
// The tensors a Llama-family model has, named as Hugging Face names them,
// from its config alone: what the engine loads and what the model
// fingerprint covers (kvbridge/fingerprint.h), with no engine linked.
// Thread-safe (functions over values).

#include <cstdint>
#include <string>
#include <vector>

#include "kdn/model/config.h"

namespace kdn::model {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// Every tensor a model with `config` must have, in a stable order.
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

// "[a, b]": a shape as errors and the fingerprint write it.
std::string ShapeToString(const std::vector<int64_t>& shape);

}  // namespace kdn::model
