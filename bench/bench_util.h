#pragma once
// Shared pieces of kdn-bench: the physical limits measured in each run
// (sgemm peak, memcpy bandwidth), common flags, and output.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdn/common/status.h"
#include "kdn/engine/model.h"

namespace kdn::bench {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double Seconds(Clock::time_point a, Clock::time_point b);

// Best-of-N GFLOP/s of a square single-precision product: the ceiling the
// engine's matrix products can reach on this machine with these threads.
double SgemmPeakGflops(int n, int reps);

// Best-of-N GB/s of memcpy over a buffer far larger than the caches, counting
// bytes read plus bytes written, with the same threads as the engine.
double MemcpyGBps(size_t bytes, int reps);

// Best-of-N GB/s of one thread copying `bytes` (bytes copied per second).
double MemcpyOneThreadGBps(size_t bytes, int reps);

struct Common {
  std::string preset = "small";
  uint64_t seed = 0;
  std::string model_dir;
  int threads = 0;
  int reps = 3;
  std::string json_path;
};

Result<std::unique_ptr<engine::Model>> MakeModel(const Common& c, int64_t kv_tokens,
                                                 std::string* what);
// Backend, threads, BLAS build and core: what a run ran on.
json Machine(const Common& c);
// Writes `j` to --json's file, if one was given.
void Emit(const Common& c, const json& j);

int RunPrefill(const Common& c, const std::vector<int>& lengths);
int RunDecode(const Common& c, const std::vector<int>& batches, int context, int steps);
int RunStore(const Common& c, int tokens, int chunk_tokens, const std::string& dtype,
             const std::string& disk_dir);
int RunPdTransfer(const Common& c, int tokens, int chunk_tokens, const std::string& dtype,
                  int socket_buffer_kib);

}  // namespace kdn::bench
