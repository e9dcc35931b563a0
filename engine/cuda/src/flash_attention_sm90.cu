// sm90::Plan and sm90::Run (flash_attention_sm90.h): kdn's paged cache handed
// to FlashInfer's Hopper prefill kernels. Compiled for sm_90a alone, with
// bf16, head_dim 64 and 128, and the causal mask or none instantiated. Without the
// FlashInfer headers, or for another architecture, Available() is false.
#include "flash_attention_sm90.h"

#include <string>

#include "kdn/common/cuda_status.h"

#ifdef KDN_FLASHINFER_SM90
#include <flashinfer/attention/hopper/prefill_sm90.cuh>
#include <flashinfer/attention/hopper/variants.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/cutlass_utils.cuh>
#endif

namespace kdn::engine::cuda::sm90 {

#ifdef KDN_FLASHINFER_SM90
namespace {

namespace fi = ::flashinfer;
using DType = fi::cutlass_dtype_t<__nv_bfloat16>;

// The parameter block of FlashInfer's Hopper paged prefill (its default
// variant's fields; the optional pointers stay null).
struct PagedParams {
  using DTypeQ = DType;
  using DTypeKV = DType;
  using DTypeO = DType;
  using IdType = int32_t;
  DTypeQ* q_ptr = nullptr;
  DTypeKV* k_ptr = nullptr;
  DTypeKV* v_ptr = nullptr;
  DTypeO* o_ptr = nullptr;
  float* lse_ptr = nullptr;

  IdType* qo_tile_indices = nullptr;
  IdType* qo_indptr = nullptr;
  IdType* kv_indptr = nullptr;
  IdType* kv_indices = nullptr;
  IdType* qo_lens = nullptr;
  IdType* kv_lens = nullptr;
  IdType* head_indices = nullptr;
  IdType* work_indptr = nullptr;
  IdType* batch_indices = nullptr;

  struct AdditionalParams {
    uint32_t* maybe_prefix_len_ptr = nullptr;
    uint16_t* maybe_token_pos_in_items_ptr = nullptr;
    uint16_t* maybe_max_item_len_ptr = nullptr;
    float* maybe_scale_v = nullptr;
    double logits_soft_cap = 0.0;
    double sm_scale = 1.0;
    double scale_v_scalar = 1.0;
    int64_t token_pos_in_items_len = 0;
  } additional_params;

  int64_t q_stride_n = 0, k_stride_n = 0, v_stride_n = 0, o_stride_n = 0;
  int64_t q_stride_h = 0, k_stride_h = 0, v_stride_h = 0, o_stride_h = 0;
  int64_t nnz_qo = 0;
  int64_t k_page_stride = 0, v_page_stride = 0;

  int head_dim = 0;
  int num_qo_heads = 0;
  int num_kv_heads = 0;
  int group_size = 0;
  int page_size = 0;
  int window_left = -1;

  bool causal = true;
};

using Variant = fi::DefaultAttention</*use_logits_soft_cap=*/false>;

template <uint32_t kHeadDim, bool kSameSchedule, fi::MaskMode kMask>
cudaError_t Launch(PagedParams& p, cudaStream_t stream) {
  return fi::BatchPrefillWithPagedKVCacheDispatched<kHeadDim, kHeadDim, kMask,
                                                    /*LEFT_SLIDING_WINDOW=*/false, kSameSchedule,
                                                    Variant, PagedParams>(p, /*enable_pdl=*/false,
                                                                          stream);
}

template <uint32_t kHeadDim>
cudaError_t LaunchFor(bool same_schedule, bool causal, PagedParams& p, cudaStream_t stream) {
  if (causal) {
    return same_schedule ? Launch<kHeadDim, true, fi::MaskMode::kCausal>(p, stream)
                         : Launch<kHeadDim, false, fi::MaskMode::kCausal>(p, stream);
  }
  return same_schedule ? Launch<kHeadDim, true, fi::MaskMode::kNone>(p, stream)
                       : Launch<kHeadDim, false, fi::MaskMode::kNone>(p, stream);
}

}  // namespace

bool Available(const AttentionShape& shape, int device) {
  if (shape.head_dim != 64 && shape.head_dim != 128) return false;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;
}

Status Plan(void* float_ws, size_t float_bytes, void* int_ws, void* int_ws_host, size_t int_bytes,
            int32_t* qo_indptr, int32_t* page_indptr, int32_t* kv_lens, int batch,
            const AttentionShape& shape, bool causal, cudaStream_t stream,
            std::vector<int64_t>* plan) {
  fi::PrefillPlanSM90Info info;
  try {
    KDN_CUDA_RETURN_IF_ERROR(fi::PrefillSM90Plan<int32_t>(
        float_ws, float_bytes, int_ws, int_ws_host, int_bytes, info, qo_indptr, page_indptr,
        kv_lens, static_cast<uint32_t>(qo_indptr[batch]), static_cast<uint32_t>(batch),
        static_cast<uint32_t>(shape.heads), static_cast<uint32_t>(shape.kv_heads),
        static_cast<uint32_t>(shape.head_dim), static_cast<uint32_t>(shape.head_dim),
        kKvBlockTokensCuda, causal, /*enable_cuda_graph=*/false, /*sizeof_dtype_o=*/2, stream));
  } catch (const std::exception& e) {
    return Internal(std::string("FlashAttention (sm90) plan: ") + e.what());
  }
  *plan = info.ToVector();
  return Status::Ok();
}

Status Run(const std::vector<int64_t>& plan, void* int_ws, const __nv_bfloat16* q,
           int64_t q_row_stride, int64_t rows, PagedKvLayer<const __nv_bfloat16> cache,
           int32_t* indices, __nv_bfloat16* out, float* lse, const AttentionShape& shape,
           bool causal, cudaStream_t stream) {
  fi::PrefillPlanSM90Info info;
  try {
    info.FromVector(plan);
  } catch (const std::exception& e) {
    return Internal(std::string("FlashAttention (sm90) run: ") + e.what());
  }
  PagedParams p;
  p.q_ptr = reinterpret_cast<DType*>(const_cast<__nv_bfloat16*>(q));
  p.k_ptr = reinterpret_cast<DType*>(const_cast<__nv_bfloat16*>(cache.k));
  p.v_ptr = reinterpret_cast<DType*>(const_cast<__nv_bfloat16*>(cache.v));
  p.o_ptr = reinterpret_cast<DType*>(out);
  p.lse_ptr = lse;
  p.causal = causal;
  p.q_stride_n = q_row_stride;
  p.q_stride_h = shape.head_dim;
  p.o_stride_n = int64_t{shape.heads} * shape.head_dim;
  p.o_stride_h = shape.head_dim;
  // The cache is [block][slot][kv_head][head_dim] (NHD pages).
  p.k_stride_n = p.v_stride_n = int64_t{shape.kv_heads} * shape.head_dim;
  p.k_stride_h = p.v_stride_h = shape.head_dim;
  p.k_page_stride = p.v_page_stride = int64_t{kKvBlockTokensCuda} * shape.kv_heads * shape.head_dim;
  p.nnz_qo = rows;
  p.head_dim = shape.head_dim;
  p.num_qo_heads = shape.heads;
  p.num_kv_heads = shape.kv_heads;
  p.group_size = shape.heads / shape.kv_heads;
  p.page_size = kKvBlockTokensCuda;
  p.additional_params.sm_scale = shape.scale;
  p.qo_tile_indices = fi::GetPtrFromBaseOffset<int32_t>(int_ws, info.qo_tile_indices_offset);
  p.qo_indptr = fi::GetPtrFromBaseOffset<int32_t>(int_ws, info.qo_indptr_offset);
  p.kv_indptr = fi::GetPtrFromBaseOffset<int32_t>(int_ws, info.kv_indptr_offset);
  p.qo_lens = fi::GetPtrFromBaseOffset<int32_t>(int_ws, info.qo_len_offset);
  p.kv_lens = fi::GetPtrFromBaseOffset<int32_t>(int_ws, info.kv_len_offset);
  p.head_indices = fi::GetPtrFromBaseOffset<int32_t>(int_ws, info.head_indices_offset);
  p.work_indptr = fi::GetPtrFromBaseOffset<int32_t>(int_ws, info.work_indptr_offset);
  p.batch_indices = fi::GetPtrFromBaseOffset<int32_t>(int_ws, info.batch_indices_offset);
  p.kv_indices = indices;
  cudaError_t st = cudaSuccess;
  try {
    st = shape.head_dim == 64 ? LaunchFor<64>(info.same_schedule_for_all_heads, causal, p, stream)
                              : LaunchFor<128>(info.same_schedule_for_all_heads, causal, p, stream);
  } catch (const std::exception& e) {
    return Internal(std::string("FlashAttention (sm90) run: ") + e.what());
  }
  KDN_CUDA_RETURN_IF_ERROR(st);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

#else  // !KDN_FLASHINFER_SM90

bool Available(const AttentionShape&, int) { return false; }

Status Plan(void*, size_t, void*, void*, size_t, int32_t*, int32_t*, int32_t*, int,
            const AttentionShape&, bool, cudaStream_t, std::vector<int64_t>*) {
  return Unimplemented("FlashAttention: built without the Hopper kernels");
}

Status Run(const std::vector<int64_t>&, void*, const __nv_bfloat16*, int64_t, int64_t,
           PagedKvLayer<const __nv_bfloat16>, int32_t*, __nv_bfloat16*, float*,
           const AttentionShape&, bool, cudaStream_t) {
  return Unimplemented("FlashAttention: built without the Hopper kernels");
}

#endif  // KDN_FLASHINFER_SM90

}  // namespace kdn::engine::cuda::sm90
