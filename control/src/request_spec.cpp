#include "kdn/control/request_spec.h"

#include "serving.pb.h"

namespace kdn::control {

void BlendToProto(const blend::BlendSpec& spec, proto::BlendSpec* out) {
  out->set_head_tokens(spec.head_tokens);
  for (int len : spec.segment_tokens) out->add_segment_tokens(len);
  out->set_recompute_ratio(spec.recompute_ratio);
  out->set_check_layer(spec.check_layer);
  for (int l : spec.check_layers) out->add_check_layers(l);
  for (double r : spec.check_ratios) out->add_check_ratios(r);
  if (spec.selection != blend::BlendSelection{}) {
    out->set_selection(blend::BlendSelectionName(spec.selection));
  }
  out->set_max_kl(spec.max_kl);
  if (spec.emphasis) EmphasisToProto(*spec.emphasis, out->mutable_emphasis());
  for (const auto& steer : spec.steer) {
    proto::SteerSpec* p = out->add_steer();
    if (steer) SteerToProto(*steer, p);
  }
}

void SteerToProto(const blend::SteerSpec& s, proto::SteerSpec* out) {
  out->set_vector(s.vector);
  out->set_strength(s.strength);
}

std::optional<blend::SteerSpec> SteerFromProto(const proto::SteerSpec& p) {
  if (p.vector().empty()) return std::nullopt;
  return blend::SteerSpec{p.vector(), p.strength()};
}

void SteeringVectorToProto(const blend::SteeringVectorSpec& s, proto::SteeringVectorSpec* out) {
  out->set_name(s.name);
  out->mutable_layers()->Assign(s.layers.begin(), s.layers.end());
  for (const auto& [pos, neg] : s.pairs) {
    proto::PromptPair* p = out->add_pairs();
    p->mutable_positive()->Assign(pos.begin(), pos.end());
    p->mutable_negative()->Assign(neg.begin(), neg.end());
  }
}

blend::SteeringVectorSpec SteeringVectorFromProto(const proto::SteeringVectorSpec& p) {
  blend::SteeringVectorSpec s;
  s.name = p.name();
  s.layers.assign(p.layers().begin(), p.layers().end());
  for (const proto::PromptPair& pair : p.pairs()) {
    s.pairs.emplace_back(std::vector<int32_t>(pair.positive().begin(), pair.positive().end()),
                         std::vector<int32_t>(pair.negative().begin(), pair.negative().end()));
  }
  return s;
}

void EmphasisToProto(const blend::Emphasis& e, proto::Emphasis* out) {
  for (const auto& [begin, end] : e.spans) {
    out->add_span_begin(begin);
    out->add_span_end(end);
  }
  out->set_heads(e.heads);
  out->mutable_bias()->Assign(e.bias.begin(), e.bias.end());
}

// Ends that do not pair up, or no spans, give an empty span, which the
// engine refuses (KvSequence::SetAttentionBias) as it does a bias of the
// wrong size: a malformed emphasis fails the request, never goes unseen.
blend::Emphasis EmphasisFromProto(const proto::Emphasis& p) {
  blend::Emphasis e;
  for (int i = 0; i < p.span_begin_size() && i < p.span_end_size(); ++i) {
    e.spans.emplace_back(p.span_begin(i), p.span_end(i));
  }
  if (e.spans.empty() || p.span_begin_size() != p.span_end_size()) e.spans.emplace_back(0, 0);
  e.heads = p.heads();
  e.bias.assign(p.bias().begin(), p.bias().end());
  return e;
}

blend::BlendSpec BlendFromProto(const proto::BlendSpec& p) {
  blend::BlendSpec spec;
  spec.head_tokens = p.head_tokens();
  spec.segment_tokens.assign(p.segment_tokens().begin(), p.segment_tokens().end());
  spec.recompute_ratio = p.recompute_ratio();
  spec.check_layer = p.check_layer();
  spec.check_layers.assign(p.check_layers().begin(), p.check_layers().end());
  spec.check_ratios.assign(p.check_ratios().begin(), p.check_ratios().end());
  spec.max_kl = p.max_kl();
  if (p.has_emphasis()) spec.emphasis = EmphasisFromProto(p.emphasis());
  for (const proto::SteerSpec& steer : p.steer()) spec.steer.push_back(SteerFromProto(steer));
  // The router sends only what it parsed; an unknown name (a newer router)
  // falls back to the default rather than failing the request.
  if (!p.selection().empty()) {
    if (auto sel = blend::ParseBlendSelection(p.selection()); sel.ok()) spec.selection = *sel;
  }
  return spec;
}

void PruneToProto(const prune::PruneSpec& spec, proto::PruneSpec* out) {
  out->set_method(spec.method);
  out->set_keep(spec.keep);
  out->set_sinks(spec.sinks);
  if (spec.granularity) out->set_granularity(prune::GranularityName(*spec.granularity));
  if (spec.scoring) out->set_scoring(prune::KvzipScoringName(*spec.scoring));
  out->mutable_kvzip_first()->Assign(spec.kvzip_first.begin(), spec.kvzip_first.end());
  out->mutable_kvzip_next()->Assign(spec.kvzip_next.begin(), spec.kvzip_next.end());
  out->mutable_kvzip_suffix()->Assign(spec.kvzip_suffix.begin(), spec.kvzip_suffix.end());
}

Result<prune::PruneSpec> PruneFromProto(const proto::PruneSpec& p) {
  prune::PruneSpec spec;
  spec.method = p.method();
  spec.keep = p.keep();
  spec.sinks = p.sinks();
  if (!p.granularity().empty()) {
    KDN_ASSIGN_OR_RETURN(spec.granularity, prune::ParseGranularity(p.granularity()));
  }
  if (!p.scoring().empty()) {
    KDN_ASSIGN_OR_RETURN(spec.scoring, prune::ParseKvzipScoring(p.scoring()));
  }
  spec.kvzip_first.assign(p.kvzip_first().begin(), p.kvzip_first().end());
  spec.kvzip_next.assign(p.kvzip_next().begin(), p.kvzip_next().end());
  spec.kvzip_suffix.assign(p.kvzip_suffix().begin(), p.kvzip_suffix().end());
  return spec;
}

}  // namespace kdn::control
