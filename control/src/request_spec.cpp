#include "kdn/control/request_spec.h"

#include "serving.pb.h"

namespace kdn::control {

void BlendToProto(const BlendSpec& spec, proto::BlendSpec* out) {
  out->set_head_tokens(spec.head_tokens);
  for (int len : spec.segment_tokens) out->add_segment_tokens(len);
  out->set_recompute_ratio(spec.recompute_ratio);
  out->set_check_layer(spec.check_layer);
}

BlendSpec BlendFromProto(const proto::BlendSpec& p) {
  BlendSpec spec;
  spec.head_tokens = p.head_tokens();
  spec.segment_tokens.assign(p.segment_tokens().begin(), p.segment_tokens().end());
  spec.recompute_ratio = p.recompute_ratio();
  spec.check_layer = p.check_layer();
  return spec;
}

}  // namespace kdn::control
