#include "kdn/engine/cuda/attention.cuh"

#include <algorithm>
#include <cmath>
#include <string>

#include "element.cuh"
#include "kdn/common/cuda_status.h"

namespace kdn::engine::cuda {
namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 16;  // query heads per KV head
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kDecodeTile = 64;                         // keys per tile of a decode block
constexpr int kDimsPerThread = kMaxHeadDim / kThreads;  // 2

__device__ __forceinline__ int64_t MinI64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__device__ __forceinline__ const T* RowAt(const T* base, const int32_t* table, int64_t pos, int row,
                                          int offset) {
  const int64_t slot = static_cast<int64_t>(table[pos / kKvBlockTokensCuda]) * kKvBlockTokensCuda +
                       pos % kKvBlockTokensCuda;
  return base + slot * row + offset;
}

// The bias query head h of batch row b adds to its score of the key in
// `slot` (ScoreBiasCuda); 0 without one.
__device__ __forceinline__ float BiasAt(const ScoreBiasCuda& bias, int64_t b, int h, int64_t slot) {
  if (bias.head_bias == nullptr) return 0.0f;
  const float v = bias.head_bias[b * bias.head_stride + h];
  if (v == 0.0f) return 0.0f;
  for (int i = bias.span_first[b]; i < bias.span_first[b + 1]; ++i) {
    if (slot >= bias.spans[2 * i] && slot < bias.spans[2 * i + 1]) return v;
  }
  return 0.0f;
}

// ------------------------------------------------------------------ decode
// grid (splits, kv_heads, batch). A block takes the `group` query heads of
// one KV head over one split of the keys, so each K and V row is read once
// for all of them.
template <typename T>
__global__ void DecodeKernel(const T* __restrict__ q, PagedKvLayer<const T> cache,
                             const int32_t* __restrict__ tables, int64_t table_stride,
                             const int32_t* __restrict__ lengths, int heads, int head_dim,
                             float scale, int64_t window, int splits, int64_t split_len,
                             float* __restrict__ partial, T* __restrict__ out, ScoreBiasCuda bias) {
  const int split = blockIdx.x, g = blockIdx.y;
  const int64_t b = blockIdx.z;
  const int group = heads / cache.kv_heads;
  const int row = cache.kv_heads * head_dim;
  const int64_t len = lengths[b];
  // Under a sliding window the keys before len - window are not seen: a
  // split wholly before them has none (l = 0, which the combine skips).
  const int64_t first = window > 0 && len > window ? len - window : 0;
  const int64_t begin = split * split_len > first ? split * split_len : first;
  const int64_t end = MinI64(len, split * split_len + split_len);
  const int32_t* table = tables + b * table_stride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  __shared__ float qs[kMaxGroup][kMaxHeadDim];
  __shared__ float p[kMaxGroup][kDecodeTile];
  __shared__ float m_s[kMaxGroup], l_s[kMaxGroup], alpha_s[kMaxGroup];
  for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x) {
    const int r = i / head_dim, d = i % head_dim;
    qs[r][d] = ToFloat(q[(b * heads + g * group + r) * head_dim + d]);
  }
  if (threadIdx.x < group) {
    m_s[threadIdx.x] = -INFINITY;
    l_s[threadIdx.x] = 0.0f;
  }
  float acc[kMaxGroup][kDimsPerThread];
#pragma unroll
  for (int r = 0; r < kMaxGroup; ++r) {
#pragma unroll
    for (int k = 0; k < kDimsPerThread; ++k) acc[r][k] = 0.0f;
  }
  __syncthreads();

  for (int64_t t0 = begin; t0 < end; t0 += kDecodeTile) {
    const int tile = static_cast<int>(MinI64(kDecodeTile, end - t0));
    // Scores: a warp per key, lanes across the head dimension.
    for (int j = warp; j < tile; j += kWarps) {
      const T* k = RowAt(cache.k, table, t0 + j, row, g * head_dim);
      float s[kMaxGroup];
#pragma unroll
      for (int r = 0; r < kMaxGroup; ++r) s[r] = 0.0f;
      for (int d = lane; d < head_dim; d += 32) {
        const float kv = ToFloat(k[d]);
#pragma unroll
        for (int r = 0; r < kMaxGroup; ++r) {
          if (r < group) s[r] = fmaf(qs[r][d], kv, s[r]);
        }
      }
#pragma unroll
      for (int r = 0; r < kMaxGroup; ++r) {
        if (r < group) {
          const float v = WarpSum(s[r]);
          if (lane == 0) p[r][j] = v * scale + BiasAt(bias, b, g * group + r, t0 + j);
        }
      }
    }
    __syncthreads();
    // Softmax bookkeeping: a warp per query head.
    for (int r = warp; r < group; r += kWarps) {
      float mx = -INFINITY;
      for (int j = lane; j < tile; j += 32) mx = fmaxf(mx, p[r][j]);
      mx = WarpMax(mx);
      const float m_new = fmaxf(m_s[r], mx);
      float sum = 0.0f;
      for (int j = lane; j < tile; j += 32) {
        const float e = expf(p[r][j] - m_new);
        p[r][j] = e;
        sum += e;
      }
      sum = WarpSum(sum);
      if (lane == 0) {
        const float alpha = expf(m_s[r] - m_new);  // 0 on the first tile
        alpha_s[r] = alpha;
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();
    // Values: threads across the head dimension.
#pragma unroll
    for (int k = 0; k < kDimsPerThread; ++k) {
      const int d = threadIdx.x + k * kThreads;
      if (d >= head_dim) continue;
#pragma unroll
      for (int r = 0; r < kMaxGroup; ++r) {
        if (r < group) acc[r][k] *= alpha_s[r];
      }
      for (int j = 0; j < tile; ++j) {
        const float v = ToFloat(RowAt(cache.v, table, t0 + j, row, g * head_dim)[d]);
#pragma unroll
        for (int r = 0; r < kMaxGroup; ++r) {
          if (r < group) acc[r][k] = fmaf(p[r][j], v, acc[r][k]);
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int k = 0; k < kDimsPerThread; ++k) {
    const int d = threadIdx.x + k * kThreads;
    if (d >= head_dim) continue;
#pragma unroll
    for (int r = 0; r < kMaxGroup; ++r) {
      if (r >= group) continue;
      const int64_t h = b * heads + g * group + r;
      if (splits == 1) {
        out[h * head_dim + d] = FromFloat<T>(acc[r][k] / l_s[r]);
      } else {
        // partial: [batch * heads][splits][2 + head_dim] = m, l, acc.
        float* part = partial + (h * splits + split) * (2 + head_dim);
        part[2 + d] = acc[r][k];
        if (d == 0) {
          part[0] = m_s[r];
          part[1] = l_s[r];
        }
      }
    }
  }
}

// grid (batch * heads): merges the splits of one query head.
template <typename T>
__global__ void CombineKernel(const float* __restrict__ partial, int splits, int head_dim,
                              T* __restrict__ out) {
  const int64_t h = blockIdx.x;
  const float* part = partial + h * splits * (2 + head_dim);
  float m = -INFINITY;
  for (int s = 0; s < splits; ++s) m = fmaxf(m, part[s * (2 + head_dim)]);
  float l = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float* ps = part + s * (2 + head_dim);
    if (ps[1] > 0.0f) l += ps[1] * expf(ps[0] - m);
  }
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float* ps = part + s * (2 + head_dim);
      if (ps[1] > 0.0f) o += ps[2 + d] * expf(ps[0] - m);
    }
    out[h * head_dim + d] = FromFloat<T>(o / l);
  }
}

// ----------------------------------------------------------------- prefill
// grid (query tiles of kPrefillQ, heads); a warp owns kPrefillQ / kWarps
// queries; K and V tiles of `tk` keys are staged in shared memory as fp32,
// rows padded by one float so that lanes reading one dimension of
// consecutive keys hit distinct banks.
constexpr int kPrefillQ = 16;
constexpr int kQueriesPerWarp = kPrefillQ / kWarps;  // 4
constexpr int kMaxDimsPerLane = kMaxHeadDim / 32;    // 8

int PrefillKeyTile(int head_dim) { return head_dim <= 128 ? 32 : 16; }

size_t PrefillSharedBytes(int head_dim) {
  const int tk = PrefillKeyTile(head_dim);
  return sizeof(float) *
         (static_cast<size_t>(2) * tk * (head_dim + 1) + static_cast<size_t>(kPrefillQ) * head_dim);
}

template <typename T>
__global__ void PrefillKernel(const T* __restrict__ q, int64_t n, int64_t q_start,
                              PagedKvLayer<const T> cache, const int32_t* __restrict__ table,
                              int heads, int head_dim, float scale, int64_t window, int tk,
                              T* __restrict__ out, ScoreBiasCuda bias) {
  extern __shared__ float smem[];
  const int ld = head_dim + 1;
  float* ks = smem;
  float* vs = ks + tk * ld;
  float* qs = vs + tk * ld;  // [kPrefillQ][head_dim]
  const int h = blockIdx.y;
  const int g = h / (heads / cache.kv_heads);
  const int row = cache.kv_heads * head_dim;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kPrefillQ;
  const int nq = static_cast<int>(MinI64(kPrefillQ, n - q0));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  for (int i = threadIdx.x; i < kPrefillQ * head_dim; i += blockDim.x) {
    const int r = i / head_dim, d = i % head_dim;
    qs[i] = r < nq ? ToFloat(q[((q0 + r) * heads + h) * head_dim + d]) * scale : 0.0f;
  }
  float m[kQueriesPerWarp], l[kQueriesPerWarp], acc[kQueriesPerWarp][kMaxDimsPerLane];
#pragma unroll
  for (int i = 0; i < kQueriesPerWarp; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxDimsPerLane; ++k) acc[i][k] = 0.0f;
  }
  // Keys up to the last query's position.
  const int64_t keys = q_start + q0 + nq;
  // A sliding window: the block's first query sees nothing before this.
  const int64_t first = window > 0 && q_start + q0 >= window ? q_start + q0 - window + 1 : 0;
  for (int64_t t0 = first; t0 < keys; t0 += tk) {
    const int tile = static_cast<int>(MinI64(tk, keys - t0));
    __syncthreads();  // the previous tile is consumed
    for (int i = threadIdx.x; i < tile * head_dim; i += blockDim.x) {
      const int j = i / head_dim, d = i % head_dim;
      ks[j * ld + d] = ToFloat(RowAt(cache.k, table, t0 + j, row, g * head_dim)[d]);
      vs[j * ld + d] = ToFloat(RowAt(cache.v, table, t0 + j, row, g * head_dim)[d]);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kQueriesPerWarp; ++i) {
      const int r = warp * kQueriesPerWarp + i;
      if (r >= nq) continue;
      const int64_t qpos = q_start + q0 + r;
      // Lane j scores key t0 + j (tk <= 32).
      float s = -INFINITY;
      if (lane < tile && t0 + lane <= qpos && (window == 0 || t0 + lane > qpos - window)) {
        const float* kr = ks + lane * ld;
        const float* qr = qs + r * head_dim;
        float dot = 0.0f;
        for (int d = 0; d < head_dim; ++d) dot = fmaf(qr[d], kr[d], dot);
        s = dot + BiasAt(bias, 0, h, t0 + lane);
      }
      const float m_new = fmaxf(m[i], WarpMax(s));
      if (m_new == -INFINITY) continue;  // every key of the tile is in the future
      const float e = s == -INFINITY ? 0.0f : expf(s - m_new);
      const float alpha = expf(m[i] - m_new);
      l[i] = l[i] * alpha + WarpSum(e);
      m[i] = m_new;
#pragma unroll
      for (int k = 0; k < kMaxDimsPerLane; ++k) acc[i][k] *= alpha;
      for (int j = 0; j < tile; ++j) {
        const float pj = __shfl_sync(0xffffffffu, e, j);
        if (pj == 0.0f) continue;
        const float* vr = vs + j * ld;
#pragma unroll
        for (int k = 0; k < kMaxDimsPerLane; ++k) {
          const int d = lane + 32 * k;
          if (d < head_dim) acc[i][k] = fmaf(pj, vr[d], acc[i][k]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kQueriesPerWarp; ++i) {
    const int r = warp * kQueriesPerWarp + i;
    if (r >= nq) continue;
    T* o = out + ((q0 + r) * heads + h) * head_dim;
#pragma unroll
    for (int k = 0; k < kMaxDimsPerLane; ++k) {
      const int d = lane + 32 * k;
      if (d < head_dim) o[d] = FromFloat<T>(acc[i][k] / l[i]);
    }
  }
}

Status CheckShape(const char* who, const AttentionShape& s, int cache_kv_heads,
                  int cache_head_dim) {
  if (s.heads <= 0 || s.kv_heads <= 0 || s.heads % s.kv_heads != 0 ||
      s.heads / s.kv_heads > kMaxGroup || s.head_dim <= 0 || s.head_dim % 8 != 0 ||
      s.head_dim > kMaxHeadDim || !(s.scale > 0) || cache_kv_heads != s.kv_heads ||
      cache_head_dim != s.head_dim) {
    return InvalidArgument(
        std::string(who) + ": unsupported shape heads=" + std::to_string(s.heads) +
        " kv_heads=" + std::to_string(s.kv_heads) + " head_dim=" + std::to_string(s.head_dim) +
        " (heads a multiple of kv_heads, at most " + std::to_string(kMaxGroup) +
        " per KV head; head_dim a multiple of 8 "
        "up to " +
        std::to_string(kMaxHeadDim) + "; the cache's shape)");
  }
  return Status::Ok();
}

int SplitsFor(int64_t batch, int kv_heads, int64_t max_length, int max_splits) {
  // Enough blocks for every SM a few times over, at least 256 keys a split.
  int sms = 132;
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess) {
    (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  const int64_t blocks = batch * kv_heads;
  int64_t splits = (2 * static_cast<int64_t>(sms) + blocks - 1) / blocks;
  splits = std::min<int64_t>(splits, (max_length + 255) / 256);
  return static_cast<int>(std::clamp<int64_t>(splits, 1, max_splits));
}

}  // namespace

size_t DecodeAttentionWorkspaceBytes(int64_t batch, const AttentionShape& shape, int max_splits) {
  if (max_splits <= 1) return 0;
  return sizeof(float) * static_cast<size_t>(batch) * shape.heads * max_splits *
         (2 + shape.head_dim);
}

template <typename T>
Status DecodeAttentionCuda(const T* q, PagedKvLayer<const T> cache, const int32_t* tables,
                           int64_t table_stride, const int32_t* lengths, int64_t batch,
                           int64_t max_length, const AttentionShape& shape, int max_splits,
                           float* workspace, T* out, cudaStream_t stream,
                           const ScoreBiasCuda& bias) {
  KDN_RETURN_IF_ERROR(CheckShape("DecodeAttentionCuda", shape, cache.kv_heads, cache.head_dim));
  if (batch < 0 || batch > 65535 || max_length < 0 || max_splits < 1 || table_stride < 0) {
    return InvalidArgument("DecodeAttentionCuda: bad batch, length, splits or table stride");
  }
  if (bias.head_bias != nullptr && (bias.spans == nullptr || bias.span_first == nullptr)) {
    return InvalidArgument("DecodeAttentionCuda: a bias without its spans");
  }
  if (batch == 0 || max_length == 0) return Status::Ok();
  if (q == nullptr || out == nullptr || tables == nullptr || lengths == nullptr ||
      cache.k == nullptr || cache.v == nullptr || (max_splits > 1 && workspace == nullptr)) {
    return InvalidArgument("DecodeAttentionCuda: null pointer");
  }
  const int splits = SplitsFor(batch, shape.kv_heads, max_length, max_splits);
  const int64_t split_len = (max_length + splits - 1) / splits;
  DecodeKernel<T>
      <<<dim3(splits, shape.kv_heads, static_cast<unsigned>(batch)), kThreads, 0, stream>>>(
          q, cache, tables, table_stride, lengths, shape.heads, shape.head_dim, shape.scale,
          shape.window, splits, split_len, workspace, out, bias);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (splits > 1) {
    CombineKernel<T>
        <<<static_cast<unsigned>(batch * shape.heads), std::min(256, RoundUpToWarp(shape.head_dim)),
           0, stream>>>(workspace, splits, shape.head_dim, out);
    KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return Status::Ok();
}

template <typename T>
Status PrefillAttentionCuda(const T* q, int64_t n, int64_t q_start, PagedKvLayer<const T> cache,
                            const int32_t* table, const AttentionShape& shape, T* out,
                            cudaStream_t stream, const ScoreBiasCuda& bias) {
  KDN_RETURN_IF_ERROR(CheckShape("PrefillAttentionCuda", shape, cache.kv_heads, cache.head_dim));
  if (n < 0 || q_start < 0 || (n + kPrefillQ - 1) / kPrefillQ > kMaxGridX || shape.heads > 65535) {
    return InvalidArgument("PrefillAttentionCuda: bad query count or start");
  }
  if (bias.head_bias != nullptr && (bias.spans == nullptr || bias.span_first == nullptr)) {
    return InvalidArgument("PrefillAttentionCuda: a bias without its spans");
  }
  if (n == 0) return Status::Ok();
  if (q == nullptr || out == nullptr || table == nullptr || cache.k == nullptr ||
      cache.v == nullptr) {
    return InvalidArgument("PrefillAttentionCuda: null pointer");
  }
  const size_t smem = PrefillSharedBytes(shape.head_dim);
  KDN_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      PrefillKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const dim3 grid(static_cast<unsigned>((n + kPrefillQ - 1) / kPrefillQ),
                  static_cast<unsigned>(shape.heads));
  PrefillKernel<T><<<grid, kThreads, smem, stream>>>(q, n, q_start, cache, table, shape.heads,
                                                     shape.head_dim, shape.scale, shape.window,
                                                     PrefillKeyTile(shape.head_dim), out, bias);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

template Status DecodeAttentionCuda<float>(const float*, PagedKvLayer<const float>, const int32_t*,
                                           int64_t, const int32_t*, int64_t, int64_t,
                                           const AttentionShape&, int, float*, float*, cudaStream_t,
                                           const ScoreBiasCuda&);
template Status DecodeAttentionCuda<__nv_bfloat16>(const __nv_bfloat16*,
                                                   PagedKvLayer<const __nv_bfloat16>,
                                                   const int32_t*, int64_t, const int32_t*, int64_t,
                                                   int64_t, const AttentionShape&, int, float*,
                                                   __nv_bfloat16*, cudaStream_t,
                                                   const ScoreBiasCuda&);
template Status PrefillAttentionCuda<float>(const float*, int64_t, int64_t,
                                            PagedKvLayer<const float>, const int32_t*,
                                            const AttentionShape&, float*, cudaStream_t,
                                            const ScoreBiasCuda&);
template Status PrefillAttentionCuda<__nv_bfloat16>(const __nv_bfloat16*, int64_t, int64_t,
                                                    PagedKvLayer<const __nv_bfloat16>,
                                                    const int32_t*, const AttentionShape&,
                                                    __nv_bfloat16*, cudaStream_t,
                                                    const ScoreBiasCuda&);

}  // namespace kdn::engine::cuda
