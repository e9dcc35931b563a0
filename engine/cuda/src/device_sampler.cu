#include "kdn/engine/cuda/device_sampler.h"

#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <string>

#include "kdn/common/cuda_status.h"
#include "kdn/engine/cuda/sampling.cuh"

namespace kdn::engine::cuda {
namespace {

constexpr int kThreads = 1024;

__global__ void IotaKernel(int32_t* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = static_cast<int32_t>(i);
  }
}

// One block walks one sorted row (values descending, ids beside them):
// each thread owns a contiguous run of the first k candidates, a block scan
// gives each run's starting mass, and the first index where a running mass
// crosses a bound is the smallest one any thread finds.
__global__ void __launch_bounds__(kThreads)
    PickKernel(const float* __restrict__ sorted, const int32_t* __restrict__ ids, int64_t vocab,
               DeviceSamplingRow p, int32_t* __restrict__ out) {
  using Scan = cub::BlockScan<double, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int64_t first;
  __shared__ double kept_mass;
  const int64_t k = p.top_k > 0 && p.top_k < vocab ? p.top_k : vocab;
  const int64_t run = (k + kThreads - 1) / kThreads;
  const int64_t lo = threadIdx.x * run < k ? threadIdx.x * run : k;
  const int64_t hi = lo + run < k ? lo + run : k;
  const double mx = sorted[0];
  const double t = p.temperature;
  auto weight = [&](int64_t i) { return exp((static_cast<double>(sorted[i]) - mx) / t); };

  double mine = 0.0;
  for (int64_t i = lo; i < hi; ++i) mine += weight(i);
  double before = 0.0, sum = 0.0;
  Scan(scan_storage).ExclusiveSum(mine, before, sum);

  // top_p: keep the smallest prefix whose share of the mass reaches top_p.
  if (threadIdx.x == 0) first = k - 1;
  __syncthreads();
  if (p.top_p < 1.0f) {
    double acc = before;
    for (int64_t i = lo; i < hi; ++i) {
      acc += weight(i);
      if (acc / sum >= p.top_p) {
        atomicMin(reinterpret_cast<unsigned long long*>(&first),
                  static_cast<unsigned long long>(i));
        break;
      }
    }
  }
  __syncthreads();
  const int64_t keep = first + 1;
  if (threadIdx.x == 0) kept_mass = 0.0;
  __syncthreads();
  {  // The mass of the kept prefix, from the run holding its last candidate.
    double acc = before;
    for (int64_t i = lo; i < hi && i < keep; ++i) {
      acc += weight(i);
      if (i == keep - 1) kept_mass = acc;
    }
  }
  __syncthreads();
  const double u = p.uniform * kept_mass;
  if (threadIdx.x == 0) first = keep - 1;
  __syncthreads();
  double acc = before;
  for (int64_t i = lo; i < hi && i < keep; ++i) {
    acc += weight(i);
    if (acc > u) {
      atomicMin(reinterpret_cast<unsigned long long*>(&first), static_cast<unsigned long long>(i));
      break;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *out = ids[first];
}

}  // namespace

struct DeviceSampler::Impl {
  int max_rows = 0;
  int64_t vocab = 0;
  int32_t* iota = nullptr;
  float* keys = nullptr;
  int32_t* values = nullptr;
  void* temp = nullptr;
  size_t temp_bytes = 0;
  ~Impl() {
    for (void* p :
         {static_cast<void*>(iota), static_cast<void*>(keys), static_cast<void*>(values), temp}) {
      if (p != nullptr) (void)cudaFree(p);
    }
  }
};

DeviceSampler::DeviceSampler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceSampler::~DeviceSampler() = default;

Result<std::unique_ptr<DeviceSampler>> DeviceSampler::Create(int max_rows, int64_t vocab) {
  if (max_rows < 1 || vocab < 1 || vocab > INT32_MAX) {
    return InvalidArgument("DeviceSampler: bad shape");
  }
  auto m = std::make_unique<Impl>();
  m->max_rows = max_rows;
  m->vocab = vocab;
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&m->iota), vocab * sizeof(int32_t)));
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&m->keys), vocab * sizeof(float)));
  KDN_CUDA_RETURN_IF_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&m->values), vocab * sizeof(int32_t)));
  KDN_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairsDescending(
      nullptr, m->temp_bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<int>(vocab)));
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(&m->temp, std::max<size_t>(1, m->temp_bytes)));
  IotaKernel<<<static_cast<unsigned>(std::min<int64_t>((vocab + 255) / 256, 4096)), 256>>>(m->iota,
                                                                                           vocab);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  KDN_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return std::unique_ptr<DeviceSampler>(new DeviceSampler(std::move(m)));
}

Status DeviceSampler::Sample(const float* logits, const DeviceSamplingRow* params, int rows,
                             int32_t* out, cudaStream_t stream) {
  Impl& m = *impl_;
  if (rows < 0 || rows > m.max_rows)
    return InvalidArgument("DeviceSampler: more rows than it was made for");
  if (rows == 0) return Status::Ok();
  if (logits == nullptr || out == nullptr || params == nullptr) {
    return InvalidArgument("DeviceSampler: null pointer");
  }
  // Greedy rows first, all at once; sampled rows then overwrite their ids.
  KDN_RETURN_IF_ERROR(ArgmaxCuda(logits, rows, m.vocab, out, stream));
  for (int r = 0; r < rows; ++r) {
    const DeviceSamplingRow& p = params[r];
    if (p.temperature <= 0.0f || p.top_k == 1) continue;
    if (p.top_k < 0 || !(p.top_p > 0.0f && p.top_p <= 1.0f) ||
        !(p.uniform >= 0.0 && p.uniform < 1.0)) {
      return InvalidArgument("DeviceSampler: row " + std::to_string(r) + " has bad parameters");
    }
    size_t bytes = m.temp_bytes;
    KDN_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairsDescending(
        m.temp, bytes, logits + int64_t{r} * m.vocab, m.keys, m.iota, m.values,
        static_cast<int>(m.vocab), 0, 32, stream));
    PickKernel<<<1, kThreads, 0, stream>>>(m.keys, m.values, m.vocab, p, out + r);
    KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return Status::Ok();
}

}  // namespace kdn::engine::cuda
