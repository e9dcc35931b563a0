#pragma once
// Rotary position embedding on the GPU: the CUDA twin of
// kdn::engine::ApplyRope (cpu_ops.h).
//
// Host-only header: it declares the launcher and can be included from .cpp
// files compiled by the host compiler.

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kdn/common/status.h"
#include "kdn/engine/cuda/paged_kv.cuh"
#include "kdn/engine/rope.h"

namespace kdn::engine::cuda {

// Rotates, in place, `rows` rows of `heads` heads of `head_dim` elements (x is
// [rows][heads][head_dim], contiguous); row r sits at position positions[r].
// Hugging Face's "rotate half" pairing: for i < head_dim/2, element a = x[i]
// pairs with b = x[i + head_dim/2] and, with angle = positions[r] *
// inv_freq[i], becomes (a*cos - b*sin, b*cos + a*sin). Enqueues one kernel on
// `stream` and returns without waiting for it.
//
// T is float or __nv_bfloat16 (the only instantiations; another T does not
// link). x, positions ([rows]) and inv_freq ([head_dim/2], from RopeInvFreq)
// are device pointers and must not overlap. The rotation is done in fp32 and,
// for bf16, rounded once at the end.
//
// Accuracy: the angle is formed in double (the product of an int32 position
// and a float inverse frequency is exact there below position 2^29), and its
// cosine and sine are taken in double and rounded to float, as the CPU
// reference does. So the two agree on cos/sin to within one float ulp even at
// position 32K, where a float angle would be off by ~1e-3 rad. (sincospif
// tricks do not apply: inv_freq is no rational multiple of pi.) Double sincos
// runs once per (row, frequency) and is shared by all heads of the row, so
// its cost does not grow with the head count.
//
// Returns INVALID_ARGUMENT for rows < 0, heads <= 0, a head_dim that is odd,
// not positive or above 8192, rows beyond the grid limit (2^31 - 1) or a null
// pointer with rows > 0, and the launch's error (see kdn/common/cuda_status.h) if the
// kernel could not be launched. rows == 0 enqueues nothing and returns OK.
// Thread-safe.
//
// `rope` adds what the table cannot hold (kdn/engine/rope.h): yarn's factor
// on cos and sin and dynamic scaling's per-position base. The default is a
// plain rotation (as a delta rotation of cached keys must be).
template <typename T>
Status ApplyRopeCuda(T* x, int64_t rows, int heads, int head_dim, const int32_t* positions,
                     const float* inv_freq, cudaStream_t stream, const RopeParams& rope = {});

// The step after a fused QKV product, in one pass: qkv is [rows][heads +
// 2 * kv_heads][head_dim] (the query heads, then the key heads, then the
// value heads of each row, row-contiguous). Rotates the query heads in place
// and writes the rotated keys and the values of row r to cache slot slots[r]
// (block id * kKvBlockTokensCuda + row in block) of `layer`; the keys in qkv
// are left unrotated. The same rotation as ApplyRopeCuda and the same writes
// as WriteKvSlotsCuda, which stay as its reference.
//
// T is float or __nv_bfloat16. Returns INVALID_ARGUMENT as ApplyRopeCuda
// does, or when the layer's shape disagrees with kv_heads and head_dim.
template <typename T>
Status RopeQkvToCacheCuda(T* qkv, int64_t rows, int heads, int kv_heads, int head_dim,
                          const int32_t* positions, const float* inv_freq, const int64_t* slots,
                          PagedKvLayer<T> layer, cudaStream_t stream, const RopeParams& rope = {});

extern template Status ApplyRopeCuda<float>(float*, int64_t, int, int, const int32_t*, const float*,
                                            cudaStream_t, const RopeParams&);
extern template Status ApplyRopeCuda<__nv_bfloat16>(__nv_bfloat16*, int64_t, int, int,
                                                    const int32_t*, const float*, cudaStream_t,
                                                    const RopeParams&);

extern template Status RopeQkvToCacheCuda<float>(float*, int64_t, int, int, int, const int32_t*,
                                                 const float*, const int64_t*, PagedKvLayer<float>,
                                                 cudaStream_t, const RopeParams&);
extern template Status RopeQkvToCacheCuda<__nv_bfloat16>(__nv_bfloat16*, int64_t, int, int, int,
                                                         const int32_t*, const float*,
                                                         const int64_t*,
                                                         PagedKvLayer<__nv_bfloat16>, cudaStream_t,
                                                         const RopeParams&);

}  // namespace kdn::engine::cuda
