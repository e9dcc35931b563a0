#pragma once
// The request fields that cross the router -> worker edge, declared once with
// their defaults, and their one conversion to and from proto/serving.proto.
// The router's spec (router/request_spec.h) and the prefill worker's job
// (prefill_worker/prefiller.h) use these types, not copies of them.
//
// Thread-compatible values.

#include <vector>

#include "kdn/common/kv_block.h"

namespace kdn::proto {
class BlendSpec;
}  // namespace kdn::proto

namespace kdn::control {

// Tokens generated in all, the first included, when a request names none.
inline constexpr int kDefaultMaxTokens = 16;
// Blend's defaults (docs/serving.md, "Documents"); kdn-router's
// --recompute-ratio and --check-layer and a request may override them.
inline constexpr double kDefaultRecomputeRatio = 0.15;
inline constexpr int kDefaultCheckLayer = 1;

// A prompt made of documents (CacheBlend; docs/serving.md, "Documents"): the
// prompt's first head_tokens tokens are computed in full, then come the
// documents (segment_tokens each), whose KV is reused from the KDN when held,
// then the rest of the prompt.
struct BlendSpec {
  int head_tokens = 0;              // leading prompt tokens computed in full
  std::vector<int> segment_tokens;  // then the documents' lengths, in order
  double recompute_ratio = kDefaultRecomputeRatio;
  int check_layer = kDefaultCheckLayer;
};

void BlendToProto(const BlendSpec& spec, proto::BlendSpec* out);
BlendSpec BlendFromProto(const proto::BlendSpec& p);

}  // namespace kdn::control
