#include "kdn/bench/transport_bench.h"

#include <algorithm>
#include <cstring>
#include <deque>

namespace kdn::kvbus {

namespace {

using BenchClock = std::chrono::steady_clock;

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

Result<std::vector<std::shared_ptr<const Chunk>>> MakeBenchChunks(const ChunkInfo& shape, int count,
                                                                  uint64_t seed) {
  if (count < 0) return InvalidArgument("MakeBenchChunks: negative count");
  std::vector<std::shared_ptr<const Chunk>> chunks;
  chunks.reserve(count);
  for (int i = 0; i < count; ++i) {
    ChunkInfo info = shape;
    uint64_t state = seed * 0x100000001b3ull + static_cast<uint64_t>(i);
    info.key = ChunkKey{SplitMix64(state), SplitMix64(state)};
    info.position = static_cast<int64_t>(i) * info.tokens;
    std::vector<uint8_t> payload(info.payload_bytes());
    for (size_t at = 0; at < payload.size(); at += 8) {
      const uint64_t v = SplitMix64(state);
      std::memcpy(payload.data() + at, &v, std::min<size_t>(8, payload.size() - at));
    }
    KDN_ASSIGN_OR_RETURN(std::shared_ptr<const Chunk> chunk, Chunk::Make(info, std::move(payload)));
    chunks.push_back(std::move(chunk));
  }
  return chunks;
}

Result<TransportBenchResult> RunSenderBench(Sender& sender,
                                            const std::vector<std::shared_ptr<const Chunk>>& chunks,
                                            int chunks_per_batch, int batches_in_flight,
                                            std::chrono::milliseconds timeout) {
  if (chunks_per_batch <= 0 || batches_in_flight <= 0) {
    return InvalidArgument("RunSenderBench: chunks_per_batch and batches_in_flight must be > 0");
  }
  TransportBenchResult result;
  std::deque<std::pair<uint64_t, size_t>> in_flight;  // batch id, index of its first chunk
  const auto wait_oldest = [&]() -> Status {
    const auto [id, first] = in_flight.front();
    in_flight.pop_front();
    KDN_ASSIGN_OR_RETURN(BatchStatus status, sender.Wait(id, timeout));
    KDN_RETURN_IF_ERROR(status.ToStatus());
    for (size_t i = 0; i < status.chunks.size(); ++i) {
      if (status.chunks[i].outcome == ChunkOutcome::kSkipped) {
        ++result.skipped;
      } else {
        ++result.chunks;
        result.bytes += chunks[first + i]->size();
      }
    }
    return Status::Ok();
  };
  const auto start = BenchClock::now();
  for (size_t first = 0; first < chunks.size(); first += chunks_per_batch) {
    const size_t end = std::min(chunks.size(), first + chunks_per_batch);
    std::vector<std::shared_ptr<const Chunk>> batch(chunks.begin() + first, chunks.begin() + end);
    KDN_ASSIGN_OR_RETURN(uint64_t id, sender.Submit(std::move(batch)));
    in_flight.emplace_back(id, first);
    if (static_cast<int>(in_flight.size()) >= batches_in_flight) KDN_RETURN_IF_ERROR(wait_oldest());
  }
  while (!in_flight.empty()) KDN_RETURN_IF_ERROR(wait_oldest());
  result.seconds = std::chrono::duration<double>(BenchClock::now() - start).count();
  return result;
}

double MeasureMemcpyGBps(size_t bytes, int reps) {
  std::vector<uint8_t> src(bytes, 1), dst(bytes, 0);
  double best = 0;
  for (int r = 0; r < std::max(1, reps); ++r) {
    const auto start = BenchClock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    const double s = std::chrono::duration<double>(BenchClock::now() - start).count();
    // Keep the copy from being optimised away.
    src[r % bytes] = dst[(r + 1) % bytes];
    if (s > 0) best = std::max(best, static_cast<double>(bytes) / s / 1e9);
  }
  return best;
}

Result<TransportBenchResult> RunTcpLoopbackBench(const TransportBenchConfig& config) {
  KDN_ASSIGN_OR_RETURN(auto chunks, MakeBenchChunks(config.shape, config.chunks, config.seed));
  DiscardStore sink;
  KDN_ASSIGN_OR_RETURN(std::unique_ptr<Receiver> receiver,
                       Listen("tcp://127.0.0.1:0", sink, config.receiver));
  KDN_ASSIGN_OR_RETURN(std::unique_ptr<Sender> sender,
                       Connect(receiver->endpoint(), config.sender));
  return RunSenderBench(*sender, chunks, config.chunks_per_batch, config.batches_in_flight,
                        config.timeout);
}

Result<std::shared_ptr<const Chunk>> DiscardStore::Get(const ChunkKey& key) {
  return NotFound("discard store keeps nothing (" + key.ToHex() + ")");
}

Status DiscardStore::Put(std::shared_ptr<const Chunk> chunk) {
  if (!chunk) return InvalidArgument("discard store: null chunk");
  puts_.fetch_add(1, std::memory_order_relaxed);
  return Status::Ok();
}

TierStats DiscardStore::Stats() {
  TierStats s;
  s.puts = puts_.load(std::memory_order_relaxed);
  return s;
}

}  // namespace kdn::kvbus
