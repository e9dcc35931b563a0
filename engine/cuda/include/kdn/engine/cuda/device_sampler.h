#pragma once
// Temperature, top-k and top-p sampling of fp32 logits on the GPU, with the
// semantics of engine::Sampler::Sample (sampler.h): candidates in descending
// logit order (ties: the lower id first), cut to top_k, weighed by
// exp((logit - max) / temperature) in double, cut to the smallest prefix
// whose mass reaches top_p, and one uniform draw u in [0, 1) picks the first
// candidate whose running mass exceeds u times the kept mass. The draw comes
// from the request's own Sampler (Sampler::NextDraw), so a seed gives the
// same tokens on the CPU and the GPU but where the two sums round apart at a
// boundary. Only the chosen ids go back to the host.
//
// Each sampled row is sorted on the device (CUB's stable radix sort, one
// row at a time), then one block walks the sorted row. Greedy rows
// (temperature <= 0 or top_k == 1) take the argmax instead.
//
// Host-only header. Thread-compatible.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "kdn/common/status.h"

namespace kdn::engine::cuda {

// One row's parameters and draw (unused for a greedy row).
struct DeviceSamplingRow {
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  double uniform = 0.0;
};

class DeviceSampler {
 public:
  // For up to `max_rows` rows of `vocab` logits.
  static Result<std::unique_ptr<DeviceSampler>> Create(int max_rows, int64_t vocab);
  ~DeviceSampler();
  DeviceSampler(const DeviceSampler&) = delete;
  DeviceSampler& operator=(const DeviceSampler&) = delete;

  // out[r] (device) = the sampled id of logits row r (device, [rows][vocab])
  // for r < rows, with params[r] (host). Enqueues on `stream`.
  Status Sample(const float* logits, const DeviceSamplingRow* params, int rows, int32_t* out,
                cudaStream_t stream);

 private:
  struct Impl;
  explicit DeviceSampler(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kdn::engine::cuda
