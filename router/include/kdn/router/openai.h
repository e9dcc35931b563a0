#pragma once
// The OpenAI-compatible surface of kdn-router (docs/serving.md): request
// validation into the project's own types (chat prompts rendered by
// kdn/text/chat_template.h), and the response and error bodies. No I/O.
// Thread-safe (functions over values).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdn/blend/emphasis.h"
#include "kdn/model/config.h"
#include "kdn/model/sampling.h"
#include "kdn/router/request_spec.h"
#include "kdn/text/chat_template.h"
#include "kdn/text/tokenizer.h"

namespace kdn::router {

using nlohmann::json;

enum class ApiKind { kCompletion, kChat };

// What a client sees of a refused request: an HTTP status and OpenAI's error
// object.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending field; empty: none
  std::string code;   // empty: null
};
json ErrorBody(const ApiError& e);

struct ApiRequest {
  ApiKind kind = ApiKind::kCompletion;
  std::vector<int32_t> prompt;     // token ids, template applied, documents in place
  std::optional<BlendSpec> blend;  // set when the prompt has documents
  int max_tokens = control::kDefaultMaxTokens;
  model::SamplingParams sampling;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_ids;  // the end-of-sequence token unless ignore_eos
  bool stream = false;
  bool include_usage = false;
  std::string cache_salt;                        // the tenant's namespace
  std::optional<Disaggregation> disaggregation;  // "disaggregation": where the prompt is computed
  // `cache_control`: on a chat message or one of its parts, the prompt up
  // to the end of the last message so marked; on a completion, the whole
  // prompt.
  std::optional<PinSpec> pin;
};

// What the router serves, for validation.
struct ServedModel {
  std::string name;
  const model::ModelConfig* config = nullptr;
  const text::Tokenizer* tokenizer = nullptr;
  // Blend defaults, which a request may override.
  std::string separator;  // empty: prompts are not split
  double recompute_ratio = blend::kDefaultRecomputeRatio;
  int check_layer = blend::kDefaultCheckLayer;
  // Progressive filtering (blend::CheckSchedule); empty: one check.
  std::vector<int> check_layers = blend::DefaultCheckLayers();
  std::vector<double> check_ratios;
  // A request's 'blend_selection' overrides it.
  blend::BlendSelection selection = blend::DefaultBlendSelection();
  // Emphasis defaults (docs/serving.md, "Emphasis"), which a request's
  // 'emphasis' overrides: the heads biased (empty: blend::MiddleThirdHeads),
  // and the strength.
  std::vector<blend::EmphasisHead> emphasis_heads;
  double emphasis_strength = blend::kDefaultEmphasisStrength;
  // The model folder's chat template; null: the built-in format of
  // config->architecture.
  const text::ChatTemplate* chat_template = nullptr;
};

// Parses and validates a body of /v1/completions or /v1/chat/completions.
// Returns the request, or the error to answer with: a 4xx, or a 500 where the
// model's chat template uses what kdn's Jinja does not support.
std::optional<ApiError> ParseRequest(ApiKind kind, const std::string& body,
                                     const ServedModel& model, ApiRequest* out);
// The router's spec of a parsed request: its fields moved over, nothing
// checked again; `ns` is its namespace (RequestNamespace), `route` its path.
Job ToJob(ApiRequest req, std::string ns, std::string route);

// A body of /v1/kdn/inject: documents to store in the KDN ahead of any
// question, each tokenized as a request's document is (with its erratum's
// tokens after its own, if it has one).
struct InjectApiRequest {
  std::vector<std::vector<int32_t>> documents;
  // Per document: its text's tokens when it has an erratum (which is
  // computed on top of the text's stored KV), else 0.
  std::vector<int64_t> base_tokens;
  std::string cache_salt;
  bool stream = false;
  // `prune`: {"method", "keep", "sinks"}; KVzip's repeat prompts tokenized
  // here (docs/serving.md, "Documents").
  std::optional<prune::PruneSpec> prune;
  // A body of /v1/kdn/edit: one document with an erratum, or steered, whose
  // original the KDN must hold (docs/serving.md, "Editing a document").
  bool edit = false;
  std::optional<blend::SteerSpec> steer;  // a steer edit
  // A body of /v1/kdn/steering: a vector to make (no documents).
  std::optional<blend::SteeringVectorSpec> steering_vector;
};
std::optional<ApiError> ParseInjectRequest(const std::string& body, const ServedModel& model,
                                           InjectApiRequest* out);
// POST /v1/kdn/edit's body: {"document", "erratum" or "steer", "cache_salt"};
// unknown fields are refused by name.
std::optional<ApiError> ParseEditRequest(const std::string& body, const ServedModel& model,
                                         InjectApiRequest* out);
// POST /v1/kdn/steering's body: {"name", "pairs": [{"positive", "negative"}],
// "layers", "cache_salt"} (docs/serving.md, "Steering a document"); each
// prompt tokenized as a request's prompt is (after a BOS).
std::optional<ApiError> ParseSteeringRequest(const std::string& body, const ServedModel& model,
                                             InjectApiRequest* out);

struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_tokens = 0;         // prompt tokens whose KV came from the KDN
  bool blended = false;          // a blend request: the two below are reported
  int blended_tokens = 0;        // of cached_tokens, fused from documents' KV
  int recomputed_tokens = 0;     // of blended_tokens, recomputed by blend
  int question_pass_tokens = 0;  // a query selection's pass over the question
  int pruned_tokens = 0;         // of blended_tokens, with no KV: pruned when stored
  double recompute_ratio = 0;    // the ratio the blend used
  // The longest pinned prefix the request made or reached (0: none), and
  // when that pin now expires (Unix seconds).
  int pinned_tokens = 0;
  int64_t pin_expires_at = 0;
};
json UsageJson(const Usage& u);

// A whole response, and the pieces of a stream (one SSE `data:` each).
json CompletionResponse(ApiKind kind, const std::string& id, int64_t created,
                        const std::string& model, const std::string& text,
                        const std::string& finish_reason, const Usage& usage);
json StreamChunk(ApiKind kind, const std::string& id, int64_t created, const std::string& model,
                 const std::string& text, const std::string* finish_reason, bool first);
json StreamUsageChunk(ApiKind kind, const std::string& id, int64_t created,
                      const std::string& model, const Usage& usage);

}  // namespace kdn::router
