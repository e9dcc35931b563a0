#include "worker_messages.h"

#include <algorithm>

#include "kdn/control/convert.h"
#include "kdn/control/request_spec.h"

namespace kdn::router {

namespace {

// The prompt and its sampling, as a prepare and a prefill both carry them.
template <typename Request>
void SetPrompt(const Job& job, Request* r) {
  r->mutable_tokens()->Add(job.tokens.begin(), job.tokens.end());
  r->set_ns(job.ns);
  control::SamplingToProto(job.sampling, r->mutable_sampling());
}

}  // namespace

proto::WorkerMessage LookupMessage(const Job& job, const std::vector<kvbus::ChunkKey>& keys,
                                   const std::vector<kvbus::ChunkKey>& segment_keys) {
  proto::WorkerMessage m;
  auto* lk = m.mutable_lookup();
  lk->set_ns(job.ns);
  for (const kvbus::ChunkKey& k : keys) lk->add_keys(control::KeyToBytes(k));
  if (!job.blend) {
    // For the tail step of the prefix match (docs/kvbus.md, "Tail keys").
    lk->mutable_tokens()->Add(job.tokens.begin(), job.tokens.end());
  }
  for (const kvbus::ChunkKey& k : segment_keys) lk->add_segment_keys(control::KeyToBytes(k));
  return m;
}

proto::WorkerMessage KeepMessage(const std::vector<kvbus::ChunkKey>& keys,
                                 std::chrono::milliseconds lease) {
  proto::WorkerMessage m;
  auto* k = m.mutable_keep();
  for (const kvbus::ChunkKey& key : keys) k->add_keys(control::KeyToBytes(key));
  k->set_lease_ms(static_cast<uint64_t>(std::max<int64_t>(lease.count(), 0)));
  return m;
}

proto::WorkerMessage PrepareMessage(const Job& job, const std::string& transfer_id,
                                    int64_t generated_tokens, bool local_prefill,
                                    int64_t lookup_tokens) {
  proto::WorkerMessage m;
  auto* pr = m.mutable_prepare();
  SetPrompt(job, pr);
  pr->set_max_tokens(job.max_tokens);
  pr->mutable_stop_ids()->Add(job.stop_ids.begin(), job.stop_ids.end());
  for (const std::string& s : job.stop_strings) pr->add_stop_strings(s);
  pr->set_transfer_id(transfer_id);
  pr->set_blended(job.blend.has_value());
  pr->set_generated_tokens(static_cast<int32_t>(generated_tokens));
  pr->set_local_prefill(local_prefill);
  pr->set_lookup_tokens(static_cast<int32_t>(lookup_tokens));
  if (job.blend && job.blend->emphasis) {
    control::EmphasisToProto(*job.blend->emphasis, pr->mutable_emphasis());
  }
  return m;
}

proto::WorkerMessage PrefillMessage(const Job& job, const std::string& decode_endpoint,
                                    int64_t decode_held_tokens, const std::string& transfer_id,
                                    int64_t generated_tokens) {
  proto::WorkerMessage m;
  auto* pf = m.mutable_prefill();
  SetPrompt(job, pf);
  pf->set_decode_endpoint(decode_endpoint);
  pf->set_decode_held_tokens(static_cast<int32_t>(decode_held_tokens));
  pf->set_transfer_id(transfer_id);
  pf->set_generated_tokens(static_cast<int32_t>(generated_tokens));
  if (job.blend) control::BlendToProto(*job.blend, pf->mutable_blend());
  return m;
}

proto::WorkerMessage StartMessage(int32_t first_token, int32_t kv_tokens,
                                  const std::string& kv_holes) {
  proto::WorkerMessage m;
  m.mutable_start()->set_first_token(first_token);
  m.mutable_start()->set_first_token_sent(true);
  m.mutable_start()->set_kv_tokens(kv_tokens);
  m.mutable_start()->set_kv_holes(kv_holes);
  return m;
}

proto::WorkerMessage CancelMessage() {
  proto::WorkerMessage m;
  m.mutable_cancel();
  return m;
}

proto::WorkerMessage InjectMessage(const InjectJob& job, size_t doc) {
  proto::WorkerMessage m;
  auto* ir = m.mutable_inject();
  const std::vector<int32_t>& document = job.documents[doc];
  ir->mutable_tokens()->Add(document.begin(), document.end());
  ir->set_ns(job.ns);
  if (job.prune) control::PruneToProto(*job.prune, ir->mutable_prune());
  if (doc < job.base_tokens.size()) {
    ir->set_base_tokens(static_cast<int32_t>(job.base_tokens[doc]));
    ir->set_base_required(job.base_required);
  }
  if (job.steer) control::SteerToProto(*job.steer, ir->mutable_steer());
  if (job.steering_vector) {
    control::SteeringVectorToProto(*job.steering_vector, ir->mutable_steering_vector());
  }
  return m;
}

proto::WorkerMessage PingMessage() {
  proto::WorkerMessage m;
  m.mutable_info_request();
  return m;
}

}  // namespace kdn::router
