// What every kvbus transport shares: the batch status helpers.

#include "kdn/kvbus/transport.h"

#include "kdn/kvbus/copy_plan.h"

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

Result<SourcedChunk> MakeSourcedChunk(const ChunkInfo& info, const DeviceMemory& memory,
                                      std::vector<Extent> extents) {
  KDN_RETURN_IF_ERROR(CheckExtentsWithin(extents, memory.bytes(), "sourced chunk"));
  uint64_t total = 0;
  for (const Extent& x : extents) total += x.bytes;
  if (total != info.payload_bytes()) {
    return InvalidArgument("sourced chunk " + info.key.ToHex() + ": extents of " +
                           std::to_string(total) + " bytes for a payload of " +
                           std::to_string(info.payload_bytes()));
  }
  KDN_ASSIGN_OR_RETURN(const uint64_t sum, memory.ops().Checksum(memory.data(), extents));
  SourcedChunk c;
  KDN_ASSIGN_OR_RETURN(c.header, Chunk::SealedHeader(info, sum));
  c.info = info;
  c.memory = &memory;
  c.extents = std::move(extents);
  return c;
}

}  // namespace kdn::kvbus
