// What every kvbus transport shares: the batch status helpers.

#include "kdn/kvbus/transport.h"

namespace kdn::kvbus {

const char* ChunkOutcomeName(ChunkOutcome outcome) {
  switch (outcome) {
    case ChunkOutcome::kPending: return "pending";
    case ChunkOutcome::kSent: return "sent";
    case ChunkOutcome::kSkipped: return "skipped";
    case ChunkOutcome::kFailed: return "failed";
  }
  return "?";
}

size_t BatchStatus::Count(ChunkOutcome outcome) const {
  size_t n = 0;
  for (const ChunkResult& c : chunks) n += c.outcome == outcome ? 1 : 0;
  return n;
}

Status BatchStatus::ToStatus() const {
  for (const ChunkResult& c : chunks) {
    if (c.outcome == ChunkOutcome::kFailed) {
      return c.status.WithContext("batch " + std::to_string(batch) + ", chunk " + c.key.ToHex());
    }
  }
  if (!done) {
    return Status(StatusCode::kDeadlineExceeded, "batch " + std::to_string(batch) + ": " +
                                                     std::to_string(Count(ChunkOutcome::kPending)) +
                                                     " of " + std::to_string(chunks.size()) +
                                                     " chunks still pending");
  }
  return Status::Ok();
}

}  // namespace kdn::kvbus
