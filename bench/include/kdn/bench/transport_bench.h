#pragma once
// The transport half of kdn-bench's pd-transfer benchmark: how fast KV chunks
// move from a prefill worker's memory into a decode worker's store through a
// kvbus transport. kdn-bench owns the processes and the printing; this owns
// the measurement, so that it can also run inside one process.
//
// Workloads (chunk shape from TransportBenchConfig; defaults are Llama-3-8B's
// KV, bf16, 64 tokens per chunk = 8 MiB):
//   tcp-loopback   receiver and sender in this process over 127.0.0.1
//                  (RunTcpLoopbackBench); compare with memcpy bandwidth
//                  (MeasureMemcpyGBps) for the ratio the design aims at (>= 0.5)
//   two processes  the decode side runs Listen into a DiscardStore, the
//                  prefill side Connect + RunSenderBench
//
// Thread-safety: the functions are reentrant; DiscardStore is thread-safe.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/transport.h"

namespace kdn::kvbus {

struct TransportBenchConfig {
  int chunks = 64;  // moved per run
  int chunks_per_batch = 8;
  int batches_in_flight = 4;  // submitted ahead of the oldest one's Wait
  ChunkInfo shape{
      .layers = 32, .kv_heads = 8, .head_dim = 128, .tokens = 64, .dtype = DType::kBF16};
  uint64_t seed = 1;                          // distinct seeds give distinct keys
  std::chrono::milliseconds timeout{120000};  // per Wait
  ReceiverOptions receiver;                   // tcp-loopback only
  SenderOptions sender;                       // tcp-loopback only
};

struct TransportBenchResult {
  uint64_t chunks = 0;  // not skipped: moved over the wire
  uint64_t bytes = 0;   // their serialized bytes
  uint64_t skipped = 0;
  double seconds = 0;  // first Submit to last Wait
  double GBps() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0; }
};

// `count` chunks of `shape` (its key and position are ignored) with keys
// derived from `seed` and pseudo-random payloads. Built untimed.
Result<std::vector<std::shared_ptr<const Chunk>>> MakeBenchChunks(const ChunkInfo& shape, int count,
                                                                  uint64_t seed);

// Moves `chunks` through `sender`, `chunks_per_batch` per batch with up to
// `batches_in_flight` batches submitted and not yet waited for. The first
// failed chunk's Status if any failed; DEADLINE_EXCEEDED if a Wait ran out.
Result<TransportBenchResult> RunSenderBench(Sender& sender,
                                            const std::vector<std::shared_ptr<const Chunk>>& chunks,
                                            int chunks_per_batch, int batches_in_flight,
                                            std::chrono::milliseconds timeout);

// memcpy bandwidth (GB/s, 1e9) between two buffers of `bytes`, best of `reps`
// (counting the bytes copied once, as the transfer's GBps does).
double MeasureMemcpyGBps(size_t bytes, int reps = 5);

// The workload tcp-loopback: a Listen into a DiscardStore and a Connect
// to it, in this process.
Result<TransportBenchResult> RunTcpLoopbackBench(const TransportBenchConfig& config);

// A sink for benchmarks: keeps nothing, counts what was Put. Contains is
// always false, so every run moves every chunk.
class DiscardStore final : public ChunkStore {
 public:
  std::string name() const override { return "discard"; }
  Result<std::shared_ptr<const Chunk>> Get(const ChunkKey& key) override;
  bool Contains(const ChunkKey&) override { return false; }
  Status Put(std::shared_ptr<const Chunk> chunk) override;
  TierStats Stats() override;

 private:
  std::atomic<uint64_t> puts_{0};
};

}  // namespace kdn::kvbus
