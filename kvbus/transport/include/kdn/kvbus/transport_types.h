#pragma once
// What a kvbus sender and receiver share (kdn/kvbus/transport.h has the
// overview): a chunk's outcome in a batch, the transport kinds, a batch's
// status, a plane's figures, and chunks read where they lie.

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/region.h"
#include "kdn/net/curve.h"

namespace kdn::kvbus {

enum class ChunkOutcome : uint8_t {
  kPending = 0,  // not decided yet
  kSent,         // the receiver verified and stored it (or found it held on arrival)
  kSkipped,      // the receiver already held the key: nothing was sent
  kFailed,       // see ChunkResult::status
};
const char* ChunkOutcomeName(ChunkOutcome outcome);

enum class TransportKind : uint8_t {
  kAuto = 0,  // by topology: shm on one host when the receiver offers it, else tcp
  kTcp,       // bytes on the ZeroMQ connection, any host
  kShm,       // only shm: a grant it cannot use fails its chunk
  // Chunks claimed in place only by the device plane (a claim it cannot
  // write fails its chunk); the rest as kAuto. Needs SenderOptions::device_ops.
  kCudaIpc,
  // Chunks claimed in place only over a link of SenderOptions::device_ops
  // (a claim outside a device region, or a receiver that did not join the
  // link, fails its chunk); the rest as kAuto.
  kNccl,
};
const char* TransportKindName(TransportKind kind);
// "auto", "tcp", "shm", "cuda_ipc" or "nccl"; INVALID_ARGUMENT otherwise.
Result<TransportKind> ParseTransportKind(const std::string& name);
// Whether `kind` lands claimed chunks by a device plane (cuda_ipc, nccl),
// which needs a device backend at both ends.
inline bool OverDevicePlane(TransportKind kind) {
  return kind == TransportKind::kCudaIpc || kind == TransportKind::kNccl;
}

struct ChunkResult {
  ChunkKey key;
  ChunkOutcome outcome = ChunkOutcome::kPending;
  Status status;  // not OK exactly when outcome is kFailed
};

// A snapshot of one batch.
struct BatchStatus {
  uint64_t batch = 0;
  bool done = false;                // every chunk has a final outcome
  std::vector<ChunkResult> chunks;  // in submission order

  size_t Count(ChunkOutcome outcome) const;
  // OK when done and nothing failed; the first failed chunk's Status (naming
  // its key) when one failed; DEADLINE_EXCEEDED when not done yet.
  Status ToStatus() const;
};

// What a sender moved over one data plane (its chunks acked as stored), and
// the seconds its batches were in flight there, from Submit to the last
// outcome (a batch counts for the region plane any of its chunks landed by,
// else for tcp); copy_seconds: of those, spent writing into the receivers'
// regions (region planes only).
struct PlaneStats {
  uint64_t chunks = 0, bytes = 0;
  double seconds = 0, copy_seconds = 0;

  PlaneStats& operator+=(const PlaneStats& o) {
    chunks += o.chunks;
    bytes += o.bytes;
    seconds += o.seconds;
    copy_seconds += o.copy_seconds;
    return *this;
  }
};

// A chunk the sender reads where it lies rather than from a Chunk in host
// memory: a layer slice of the sender's own KV pool, whose payload is
// extents of memory of a DeviceOps backend, in payload order. Made by
// MakeSourcedChunk; see Sender::SubmitSourced.
struct SourcedChunk {
  ChunkInfo info;  // raw; the payload is info.payload_bytes()
  // Sealed over the payload where it lies (Chunk::SealedHeader).
  std::array<uint8_t, Chunk::kHeaderBytes> header{};
  const DeviceMemory* memory = nullptr;  // borrowed
  std::vector<Extent> extents;
  uint64_t size() const { return Chunk::kHeaderBytes + info.payload_bytes(); }
};

// The chunk `info` whose payload is `extents` of `memory`: checksummed
// through the memory's backend, its header sealed. INVALID_ARGUMENT for an
// encoded info, an extent outside the memory, or extents that do not hold
// the payload exactly.
Result<SourcedChunk> MakeSourcedChunk(const ChunkInfo& info, const DeviceMemory& memory,
                                      std::vector<Extent> extents);

}  // namespace kdn::kvbus
