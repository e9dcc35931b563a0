#include "kdn/control/convert.h"

namespace kdn::control {

void StatusToProto(const Status& status, proto::Error* out) {
  out->Clear();
  if (status.ok()) return;
  out->set_code(static_cast<int32_t>(status.code()));
  out->set_message(status.message());
}

Status StatusFromProto(const proto::Error& error) {
  if (error.code() == 0) return Status::Ok();
  if (error.code() < 0 || error.code() > static_cast<int32_t>(StatusCode::kIoError)) {
    return Internal(error.message());
  }
  return Status(static_cast<StatusCode>(error.code()), error.message());
}

void SamplingToProto(const model::SamplingParams& p, proto::Sampling* out) {
  out->set_temperature(p.temperature);
  out->set_top_k(p.top_k);
  out->set_top_p(p.top_p);
  out->set_seed(p.seed);
}

model::SamplingParams SamplingFromProto(const proto::Sampling& p) {
  model::SamplingParams s;
  s.temperature = p.temperature();
  s.top_k = p.top_k();
  s.top_p = p.top_p();
  s.seed = p.seed();
  return s;
}

std::string KeyToBytes(const kvbus::ChunkKey& key) {
  uint8_t b[16];
  key.ToBytes(b);
  return std::string(reinterpret_cast<const char*>(b), 16);
}

Result<kvbus::ChunkKey> KeyFromBytes(std::string_view bytes) {
  if (bytes.size() != 16) {
    return InvalidArgument("a chunk key is 16 bytes, got " + std::to_string(bytes.size()));
  }
  return kvbus::ChunkKey::FromBytes(reinterpret_cast<const uint8_t*>(bytes.data()));
}

}  // namespace kdn::control
