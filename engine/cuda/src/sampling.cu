#include "kdn/engine/cuda/sampling.cuh"

#include <algorithm>
#include <string>

#include "element.cuh"
#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {
namespace {

// (value, index) pairs: the larger value wins, the smaller index on ties; NaN
// loses to anything.
struct Best {
  float v;
  int64_t i;
};

__device__ __forceinline__ Best Better(Best a, Best b) {
  if (isnan(a.v)) return isnan(b.v) ? (a.i < b.i ? a : b) : b;
  if (isnan(b.v)) return a;
  if (a.v != b.v) return a.v > b.v ? a : b;
  return a.i < b.i ? a : b;
}

// The best of the block's candidates (valid in thread 0).
__device__ __forceinline__ Best BlockBest(Best best) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Best other{__shfl_xor_sync(0xffffffffu, best.v, offset),
               __shfl_xor_sync(0xffffffffu, best.i, offset)};
    best = Better(best, other);
  }
  __shared__ Best warp_best[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  Best b = warp_best[0];
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) b = Better(b, warp_best[w]);
  }
  return b;
}

__global__ void ArgmaxKernel(const float* __restrict__ logits, int64_t vocab,
                             int32_t* __restrict__ out) {
  const float* row = logits + blockIdx.x * vocab;
  Best best{NAN, INT64_MAX};
  for (int64_t i = threadIdx.x; i < vocab; i += blockDim.x) best = Better(best, {row[i], i});
  best = BlockBest(best);
  if (threadIdx.x == 0) out[blockIdx.x] = static_cast<int32_t>(best.i == INT64_MAX ? 0 : best.i);
}

// Block (s, r) finds the best of row r's s-th slice; the combine kernel takes
// the best of the slices by the same rule.
__global__ void ArgmaxSliceKernel(const float* __restrict__ logits, int64_t vocab,
                                  Best* __restrict__ partial) {
  const int64_t r = blockIdx.y;
  const int64_t slice = (vocab + gridDim.x - 1) / gridDim.x;
  const int64_t lo = blockIdx.x * slice;
  const int64_t hi = lo + slice < vocab ? lo + slice : vocab;
  const float* row = logits + r * vocab;
  Best best{NAN, INT64_MAX};
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) best = Better(best, {row[i], i});
  best = BlockBest(best);
  if (threadIdx.x == 0) partial[r * gridDim.x + blockIdx.x] = best;
}

__global__ void ArgmaxCombineKernel(const Best* __restrict__ partial, int slices,
                                    int32_t* __restrict__ out) {
  const int64_t r = blockIdx.x;
  Best best{NAN, INT64_MAX};
  for (int s = threadIdx.x; s < slices; s += blockDim.x)
    best = Better(best, partial[r * slices + s]);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Best other{__shfl_xor_sync(0xffffffffu, best.v, offset),
               __shfl_xor_sync(0xffffffffu, best.i, offset)};
    best = Better(best, other);
  }
  if (threadIdx.x == 0) out[r] = static_cast<int32_t>(best.i == INT64_MAX ? 0 : best.i);
}

}  // namespace

size_t ArgmaxWorkspaceBytes(int64_t rows) {
  return sizeof(Best) * kArgmaxSplits * static_cast<size_t>(rows > 0 ? rows : 0);
}

Status ArgmaxCuda(const float* logits, int64_t rows, int64_t vocab, int32_t* out,
                  cudaStream_t stream, void* workspace) {
  if (rows < 0 || rows > kMaxGridX || vocab <= 0 || vocab > INT32_MAX) {
    return InvalidArgument("ArgmaxCuda: bad shape rows=" + std::to_string(rows) +
                           " vocab=" + std::to_string(vocab));
  }
  if (rows == 0) return Status::Ok();
  if (logits == nullptr || out == nullptr) return InvalidArgument("ArgmaxCuda: null pointer");
  if (workspace != nullptr && rows <= 65535) {
    Best* partial = static_cast<Best*>(workspace);
    ArgmaxSliceKernel<<<dim3(kArgmaxSplits, static_cast<unsigned>(rows)), 256, 0, stream>>>(
        logits, vocab, partial);
    KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    ArgmaxCombineKernel<<<static_cast<unsigned>(rows), 32, 0, stream>>>(partial, kArgmaxSplits,
                                                                        out);
    KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return Status::Ok();
  }
  ArgmaxKernel<<<static_cast<unsigned>(rows), 1024, 0, stream>>>(logits, vocab, out);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace kdn::engine::cuda
