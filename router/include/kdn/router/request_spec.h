#pragma once
// The router's request spec: what a request asks, as the router drives it
// (docs/serving.md). Each field is declared once per process edge:
//   HTTP      openai.h's ApiRequest, validated and defaulted by ParseRequest;
//   router    Job (here), made from it by ToJob (openai.h), nothing re-checked;
//   proto     PrepareRequest/PrefillRequest, built by router/src/worker_messages.h;
//   worker    the prefill worker's PrefillJob, the decode worker's spec.
// Defaults shared across the edges (max_tokens, blend's) are
// control/request_spec.h's, the KV block size common/kv_block.h's.
//
// Thread-compatible values.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kdn/control/request_spec.h"
#include "kdn/model/sampling.h"

namespace kdn::router {

using blend::BlendSpec;

// Where a request's prompt is computed (docs/serving.md, "Two paths"):
//   always  on a prefill worker, its KV moved to the decode worker;
//   auto    on the decode worker when the placement's cost model says so;
//   never   on the decode worker whenever the request may be (a blended or
//           resumed request always takes the prefill worker's path).
enum class Disaggregation { kAlways, kAuto, kNever };
const char* DisaggregationName(Disaggregation d);
// "always", "auto" or "never"; nullopt for anything else.
std::optional<Disaggregation> ParseDisaggregation(const std::string& s);

// A prompt prefix to pin (docs/serving.md, "Pinning a prefix"): the
// prompt's first `tokens` tokens (its whole chunks are kept), for `ttl`.
struct PinSpec {
  int64_t tokens = 0;
  std::chrono::seconds ttl{0};
};

struct Job {
  std::vector<int32_t> tokens;  // the prompt, documents in place
  std::string ns;               // the tenant's cache namespace
  model::SamplingParams sampling;
  int max_tokens = control::kDefaultMaxTokens;  // generated in all, the first included
  std::vector<int32_t> stop_ids;
  std::vector<std::string> stop_strings;
  std::optional<BlendSpec> blend;  // set when the prompt has documents
  // The request's own choice of path; unset: the router's --disaggregation.
  std::optional<Disaggregation> disaggregation;
  std::string route;           // the HTTP path it came by, for log lines
  std::optional<PinSpec> pin;  // cache_control: a prefix to pin
  std::string tenant;          // its API key's tenant ("" without keys): whose pins
};

struct InjectJob {
  std::vector<std::vector<int32_t>> documents;
  // Per document (or empty: none): the leading tokens that are a document
  // stored on its own, under which its erratum is computed; 0: none.
  std::vector<int64_t> base_tokens;
  // An edit: a document whose base the KDN lacks fails, NOT_FOUND.
  bool base_required = false;
  std::string ns;
  std::optional<prune::PruneSpec> prune;  // each document's KV pruned when stored
  // A steer edit of the one document (docs/serving.md, "Steering a
  // document"); its base is required.
  std::optional<blend::SteerSpec> steer;
  // A steering vector to make: `documents` is one empty document.
  std::optional<blend::SteeringVectorSpec> steering_vector;
};

}  // namespace kdn::router
