// FlashAttention (flash_attention.h): kdn's paged cache handed to
// FlashInfer's batch prefill kernels. Only the instantiations kdn needs are
// compiled: bf16, head_dim 64 and 128, query tiles of 16, 64 and 128 rows,
// with the causal mask, and with kdn's own mask for rows at scattered
// positions (PositionCausal: row r sees keys 0 .. positions[r]). Without the
// FlashInfer headers this file compiles to the "unsupported" answers only.
#include "kdn/engine/cuda/flash_attention.h"

#include <algorithm>
#include <string>
#include <vector>

#include "flash_attention_sm90.h"
#include "kdn/common/cuda_status.h"

#ifdef KDN_FLASHINFER
#include <flashinfer/attention/cascade.cuh>
#include <flashinfer/attention/mask.cuh>
#include <flashinfer/attention/prefill.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>
#include <flashinfer/page.cuh>
#endif

namespace kdn::engine::cuda {

#ifdef KDN_FLASHINFER
namespace {

using bf16 = __nv_bfloat16;
namespace fi = ::flashinfer;

// The parameter block FlashInfer's batch prefill kernel reads (the fields of
// its default attention variant; the optional pointers stay null).
struct PagedParams {
  using DTypeQ = bf16;
  using DTypeKV = bf16;
  using DTypeO = bf16;
  using IdType = int32_t;

  bf16* q = nullptr;
  fi::paged_kv_t<bf16, int32_t> paged_kv;
  int32_t* q_indptr = nullptr;
  bf16* o = nullptr;
  float* lse = nullptr;
  fi::uint_fastdiv group_size;

  const int32_t* maybe_q_positions = nullptr;  // PositionCausal: each row's position

  uint8_t* maybe_custom_mask = nullptr;
  int32_t* maybe_mask_indptr = nullptr;
  float* maybe_alibi_slopes = nullptr;
  uint32_t* maybe_prefix_len_ptr = nullptr;
  uint16_t* maybe_token_pos_in_items_ptr = nullptr;
  uint16_t* maybe_max_item_len_ptr = nullptr;
  uint8_t* maybe_k_cache_sf = nullptr;
  uint8_t* maybe_v_cache_sf = nullptr;
  double logits_soft_cap = 0.0;
  double sm_scale = 1.0;
  double rope_rcp_scale = 1.0;
  double rope_rcp_theta = 1.0;
  int64_t token_pos_in_items_len = 0;

  uint32_t num_qo_heads = 0;
  int32_t q_stride_n = 0;
  int32_t q_stride_h = 0;
  uint32_t k_sf_stride_page = 0, k_sf_stride_n = 0, k_sf_stride_h = 0;
  uint32_t v_sf_stride_page = 0, v_sf_stride_n = 0, v_sf_stride_h = 0;
  int32_t window_left = -1;

  int32_t* request_indices = nullptr;
  int32_t* qo_tile_indices = nullptr;
  int32_t* kv_tile_indices = nullptr;
  int32_t* merge_indptr = nullptr;
  int32_t* o_indptr = nullptr;
  bool* block_valid_mask = nullptr;
  int32_t* kv_chunk_size_ptr = nullptr;
  uint32_t max_total_num_rows = 0;
  uint32_t* total_num_rows = nullptr;
  uint32_t padded_batch_size = 0;
  bool partition_kv = false;

  __host__ __device__ __forceinline__ uint32_t get_qo_len(uint32_t batch_idx) const {
    return q_indptr[batch_idx + 1] - q_indptr[batch_idx];
  }
  __host__ __device__ __forceinline__ uint32_t get_kv_len(uint32_t batch_idx) const {
    return paged_kv.get_length(batch_idx);
  }
};

using Variant = fi::DefaultAttention</*use_custom_mask=*/false, /*use_sliding_window=*/false,
                                     /*use_logits_soft_cap=*/false, /*use_alibi=*/false>;

// The mask of a row pass (CacheBlend's recomputed rows): the rows of a
// request sit at ascending positions that need not be consecutive, and row r
// sees keys 0 .. positions[r]. FlashInfer runs it as a custom mask: every key
// tile below the request's kv_len is read and masked per element.
struct PositionCausal : fi::AttentionVariantBase {
  static constexpr bool use_softmax = true;

  const int32_t* positions;
  uint32_t qo_len, kv_len, window_left;
  float sm_scale_log2;

  template <typename Params>
  __device__ __host__ PositionCausal(const Params& params, uint32_t batch_idx, uint8_t*) {
    qo_len = params.get_qo_len(batch_idx);
    kv_len = params.get_kv_len(batch_idx);
    window_left = kv_len;
    sm_scale_log2 = params.sm_scale * fi::math::log2e;
    positions = params.maybe_q_positions + params.q_indptr[batch_idx];
  }

  REGISTER_LOGITS_MASK(params, batch_idx, qo_idx, kv_idx, qo_head_idx, kv_head_idx, {
    return qo_idx < qo_len && kv_idx <= static_cast<uint32_t>(positions[qo_idx]);
  })
};

template <uint32_t kHeadDim, uint32_t kTileQ, fi::MaskMode kMask, typename V>
cudaError_t Launch(const PagedParams& p, bf16* tmp_v, float* tmp_s, cudaStream_t stream) {
  return fi::BatchPrefillWithPagedKVCacheDispatched<
      /*SAME_KV_STRIDES=*/true, kTileQ, kHeadDim, kHeadDim, fi::PosEncodingMode::kNone,
      /*USE_FP16_QK_REDUCTION=*/false, kMask, V, PagedParams>(p, tmp_v, tmp_s,
                                                              /*enable_pdl=*/false, stream);
}

template <uint32_t kHeadDim, fi::MaskMode kMask, typename V>
cudaError_t LaunchTile(int64_t tile_q, const PagedParams& p, bf16* tmp_v, float* tmp_s,
                       cudaStream_t stream) {
  switch (tile_q) {
    case 16: return Launch<kHeadDim, 16, kMask, V>(p, tmp_v, tmp_s, stream);
    case 64: return Launch<kHeadDim, 64, kMask, V>(p, tmp_v, tmp_s, stream);
    case 128: return Launch<kHeadDim, 128, kMask, V>(p, tmp_v, tmp_s, stream);
    default: return cudaErrorInvalidConfiguration;
  }
}

template <uint32_t kHeadDim>
cudaError_t LaunchFor(bool positioned, int64_t tile_q, const PagedParams& p, bf16* tmp_v,
                      float* tmp_s, cudaStream_t stream) {
  return positioned ? LaunchTile<kHeadDim, fi::MaskMode::kCustom, PositionCausal>(tile_q, p, tmp_v,
                                                                                  tmp_s, stream)
                    : LaunchTile<kHeadDim, fi::MaskMode::kCausal, Variant>(tile_q, p, tmp_v, tmp_s,
                                                                           stream);
}

constexpr size_t kFloatWorkspaceBytes = size_t{256} << 20;
constexpr size_t kIntWorkspaceBytes = size_t{16} << 20;

}  // namespace

struct FlashAttention::Impl {
  AttentionShape shape;
  int max_batch = 0;
  int64_t max_rows = 0, max_blocks = 0;

  // Device: FlashInfer's workspaces, then the batch description.
  void* float_ws = nullptr;
  void* int_ws = nullptr;
  int32_t* indices = nullptr;  // all block tables, back to back
  int32_t* meta =
      nullptr;  // q_indptr [max_batch+1], page indptr [max_batch+1], last lens [max_batch]
  // Pinned host staging for the same, and the event that says it is free again.
  void* int_ws_host = nullptr;
  int32_t* indices_host = nullptr;
  int32_t* meta_host = nullptr;
  cudaEvent_t staged = nullptr;
  std::vector<int32_t> kv_lens;  // host, for the Hopper plan

  bool hopper = false;  // prefill plans may use the Hopper kernels
  fi::PrefillPlanInfo plan;
  std::vector<int64_t> hopper_plan;  // the plan when planned_hopper
  bool planned_hopper = false;
  const int32_t* row_positions = nullptr;  // device; set by PlanPositions
  uint32_t batch = 0;
  int64_t rows = 0;

  bool causal = true;  // of the Hopper plan (FA2 plans are causal or positioned)

  Status Plan(const AttentionSequence* seqs, int count, bool graph, bool allow_hopper,
              bool causal_mask, cudaStream_t stream);

  ~Impl() {
    for (void* p : {float_ws, int_ws, static_cast<void*>(indices), static_cast<void*>(meta)}) {
      if (p != nullptr) (void)cudaFree(p);
    }
    for (void* p : {int_ws_host, static_cast<void*>(indices_host), static_cast<void*>(meta_host)}) {
      if (p != nullptr) (void)cudaFreeHost(p);
    }
    if (staged != nullptr) (void)cudaEventDestroy(staged);
  }

  int32_t* q_indptr(int32_t* base) const { return base; }
  int32_t* page_indptr(int32_t* base) const { return base + max_batch + 1; }
  int32_t* last_len(int32_t* base) const { return base + 2 * (max_batch + 1); }
};

bool FlashAttention::Supports(const AttentionShape& shape) {
  // Sliding windows are left to the reference kernels: FlashInfer's
  // windowed variants would double the instantiations compiled here.
  return (shape.head_dim == 64 || shape.head_dim == 128) && shape.kv_heads > 0 &&
         shape.heads % shape.kv_heads == 0 && shape.window == 0;
}

Result<std::unique_ptr<FlashAttention>> FlashAttention::Create(const AttentionShape& shape,
                                                               int max_batch, int64_t max_rows,
                                                               int64_t max_blocks, bool hopper) {
  if (!Supports(shape)) {
    return Unimplemented("FlashAttention: no kernels for head_dim " +
                         std::to_string(shape.head_dim));
  }
  if (max_batch < 1 || max_rows < 1 || max_blocks < 1) {
    return InvalidArgument("FlashAttention: empty limits");
  }
  auto impl = std::make_unique<Impl>();
  impl->shape = shape;
  impl->max_batch = max_batch;
  impl->max_rows = max_rows;
  impl->max_blocks = max_blocks;
  impl->kv_lens.resize(max_batch);
  int device = 0;
  KDN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  impl->hopper = hopper && sm90::Available(shape, device);
  const size_t meta = sizeof(int32_t) * (3 * static_cast<size_t>(max_batch) + 2);
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(&impl->float_ws, kFloatWorkspaceBytes));
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(&impl->int_ws, kIntWorkspaceBytes));
  KDN_CUDA_RETURN_IF_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&impl->indices), sizeof(int32_t) * max_blocks));
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&impl->meta), meta));
  KDN_CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl->int_ws_host, kIntWorkspaceBytes));
  KDN_CUDA_RETURN_IF_ERROR(
      cudaMallocHost(reinterpret_cast<void**>(&impl->indices_host), sizeof(int32_t) * max_blocks));
  KDN_CUDA_RETURN_IF_ERROR(cudaMallocHost(reinterpret_cast<void**>(&impl->meta_host), meta));
  KDN_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&impl->staged, cudaEventDisableTiming));
  KDN_CUDA_RETURN_IF_ERROR(cudaEventRecord(impl->staged, nullptr));
  return std::unique_ptr<FlashAttention>(new FlashAttention(std::move(impl)));
}

FlashAttention::FlashAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FlashAttention::~FlashAttention() = default;

Status FlashAttention::Plan(const AttentionSequence* seqs, int count, bool graph,
                            cudaStream_t stream) {
  impl_->row_positions = nullptr;
  return impl_->Plan(seqs, count, graph, /*allow_hopper=*/true, /*causal=*/true, stream);
}

Status FlashAttention::PlanFull(const AttentionSequence* seqs, int count, cudaStream_t stream) {
  if (!impl_->hopper) {
    return Unimplemented("FlashAttention: plans without a mask run on the Hopper kernels only");
  }
  impl_->row_positions = nullptr;
  return impl_->Plan(seqs, count, /*graph=*/false, /*allow_hopper=*/true, /*causal=*/false, stream);
}

Status FlashAttention::PlanPositions(const AttentionSequence* seqs, int count,
                                     const int32_t* device_positions, cudaStream_t stream) {
  if (device_positions == nullptr) {
    return InvalidArgument("FlashAttention::PlanPositions: no positions");
  }
  impl_->row_positions = nullptr;
  KDN_RETURN_IF_ERROR(impl_->Plan(seqs, count, /*graph=*/false, /*allow_hopper=*/false,
                                  /*causal=*/true, stream));
  impl_->row_positions = device_positions;
  return Status::Ok();
}

bool FlashAttention::hopper() const { return impl_->hopper; }

Status FlashAttention::MergeInPlace(bf16* out, float* lse, const bf16* other_out,
                                    const float* other_lse, int64_t rows, int heads, int head_dim,
                                    cudaStream_t stream) {
  if (rows == 0) return Status::Ok();
  if (out == nullptr || lse == nullptr || other_out == nullptr || other_lse == nullptr ||
      rows < 0 || heads <= 0 || (head_dim != 64 && head_dim != 128)) {
    return InvalidArgument("FlashAttention::MergeInPlace: bad arguments");
  }
  cudaError_t st = cudaSuccess;
  try {
    st = fi::MergeStateInPlace<bf16>(out, lse, const_cast<bf16*>(other_out),
                                     const_cast<float*>(other_lse), static_cast<uint32_t>(rows),
                                     static_cast<uint32_t>(heads), static_cast<uint32_t>(head_dim),
                                     /*mask=*/nullptr, stream);
  } catch (const std::exception& e) {
    return Internal(std::string("FlashAttention::MergeInPlace: ") + e.what());
  }
  KDN_CUDA_RETURN_IF_ERROR(st);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

Status FlashAttention::Impl::Plan(const AttentionSequence* seqs, int count, bool graph,
                                  bool allow_hopper, bool causal_mask, cudaStream_t stream) {
  Impl& m = *this;
  const size_t b = count > 0 ? static_cast<size_t>(count) : 0;
  if (b == 0 || seqs == nullptr) return InvalidArgument("FlashAttention::Plan: an empty batch");
  if (b > static_cast<size_t>(m.max_batch)) {
    return InvalidArgument("FlashAttention::Plan: batch of " + std::to_string(b) +
                           " beyond its limit of " + std::to_string(m.max_batch));
  }
  // The staging buffers may still feed the previous plan's copies.
  KDN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(m.staged));
  m.batch = 0;  // no plan until this one is complete
  int32_t* qi = m.q_indptr(m.meta_host);
  int32_t* pi = m.page_indptr(m.meta_host);
  int32_t* last = m.last_len(m.meta_host);
  qi[0] = 0;
  pi[0] = 0;
  bool uniform_one = true;
  for (size_t i = 0; i < b; ++i) {
    const AttentionSequence& s = seqs[i];
    const int64_t kv = s.kv_len;
    const int64_t pages = (kv + kKvBlockTokensCuda - 1) / kKvBlockTokensCuda;
    // A causal plan's queries are the last q_len of its keys; without the
    // mask (PlanFull: a band's shared keys) a band may have more rows than
    // keys.
    if (s.q_len < 1 || kv < 1 || (causal_mask && kv < s.q_len) || s.table == nullptr ||
        s.table_size < pages) {
      return InvalidArgument("FlashAttention::Plan: sequence " + std::to_string(i) +
                             " has a bad length or a short block table");
    }
    uniform_one = uniform_one && s.q_len == 1;
    qi[i + 1] = qi[i] + s.q_len;
    if (pi[i] + pages > m.max_blocks || qi[i + 1] > m.max_rows) {
      return InvalidArgument("FlashAttention::Plan: the batch exceeds the planned rows or blocks");
    }
    std::copy_n(s.table, pages, m.indices_host + pi[i]);
    pi[i + 1] = static_cast<int32_t>(pi[i] + pages);
    last[i] = static_cast<int32_t>(kv - (pages - 1) * kKvBlockTokensCuda);
    m.kv_lens[i] = static_cast<int32_t>(kv);
  }
  if (graph && !uniform_one) {
    return InvalidArgument("FlashAttention::Plan: a graph plan is for decode (every q length 1)");
  }
  const size_t meta_bytes = sizeof(int32_t) * (3 * static_cast<size_t>(m.max_batch) + 2);
  KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m.indices, m.indices_host, sizeof(int32_t) * pi[b],
                                           cudaMemcpyHostToDevice, stream));
  KDN_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(m.meta, m.meta_host, meta_bytes, cudaMemcpyHostToDevice, stream));
  m.rows = qi[b];
  m.planned_hopper = allow_hopper && m.hopper && !graph && !uniform_one;
  // One query per sequence sees all its keys with either mask.
  if (!causal_mask && !m.planned_hopper && !uniform_one) {
    return Unimplemented("FlashAttention: plans without a mask run on the Hopper kernels only");
  }
  m.causal = causal_mask;
  if (m.planned_hopper) {
    KDN_RETURN_IF_ERROR(sm90::Plan(
        m.float_ws, kFloatWorkspaceBytes, m.int_ws, m.int_ws_host, kIntWorkspaceBytes, qi, pi,
        m.kv_lens.data(), static_cast<int>(b), m.shape, causal_mask, stream, &m.hopper_plan));
    KDN_CUDA_RETURN_IF_ERROR(cudaEventRecord(m.staged, stream));
    m.batch = static_cast<uint32_t>(b);
    return Status::Ok();
  }
  try {
    const cudaError_t st = fi::PrefillPlan<int32_t>(
        m.float_ws, kFloatWorkspaceBytes, m.int_ws, m.int_ws_host, kIntWorkspaceBytes, m.plan, qi,
        pi, static_cast<uint32_t>(qi[b]), static_cast<uint32_t>(b),
        static_cast<uint32_t>(m.shape.heads), static_cast<uint32_t>(m.shape.kv_heads),
        static_cast<uint32_t>(m.shape.head_dim), static_cast<uint32_t>(m.shape.head_dim),
        kKvBlockTokensCuda, graph, /*sizeof_dtype_o=*/2, /*window_left=*/-1,
        /*fixed_split_size=*/-1, /*disable_split_kv=*/false, /*num_colocated_ctas=*/0,
        /*uniform_q_len=*/graph ? 1 : 0, stream);
    KDN_CUDA_RETURN_IF_ERROR(st);
  } catch (const std::exception& e) {
    return Internal(std::string("FlashAttention::Plan: ") + e.what());
  }
  KDN_CUDA_RETURN_IF_ERROR(cudaEventRecord(m.staged, stream));
  m.batch = static_cast<uint32_t>(b);
  return Status::Ok();
}

Status FlashAttention::Run(const bf16* q, int64_t q_row_stride, PagedKvLayer<const bf16> cache,
                           bf16* out, cudaStream_t stream, float* lse) {
  Impl& m = *impl_;
  if (m.batch == 0) return FailedPrecondition("FlashAttention::Run before Plan");
  if (q == nullptr || out == nullptr || cache.k == nullptr || cache.v == nullptr ||
      cache.kv_heads != m.shape.kv_heads || cache.head_dim != m.shape.head_dim ||
      q_row_stride < int64_t{m.shape.heads} * m.shape.head_dim || q_row_stride > INT32_MAX) {
    return InvalidArgument("FlashAttention::Run: null pointers or a cache of another shape");
  }
  if (m.planned_hopper) {
    return sm90::Run(m.hopper_plan, m.int_ws, q, q_row_stride, m.rows, cache, m.indices, out, lse,
                     m.shape, m.causal, stream);
  }
  PagedParams p;
  p.q = const_cast<bf16*>(q);
  p.paged_kv = fi::paged_kv_t<bf16, int32_t>(
      static_cast<uint32_t>(m.shape.kv_heads), kKvBlockTokensCuda,
      static_cast<uint32_t>(m.shape.head_dim), m.batch, fi::QKVLayout::kNHD,
      const_cast<bf16*>(cache.k), const_cast<bf16*>(cache.v), m.indices, m.page_indptr(m.meta),
      m.last_len(m.meta));
  p.q_indptr = m.q_indptr(m.meta);
  p.maybe_q_positions = m.row_positions;
  p.o = out;
  p.lse = lse;
  p.group_size = fi::uint_fastdiv(static_cast<uint32_t>(m.shape.heads / m.shape.kv_heads));
  p.sm_scale = m.shape.scale;
  p.num_qo_heads = static_cast<uint32_t>(m.shape.heads);
  p.q_stride_n = static_cast<int32_t>(q_row_stride);
  p.q_stride_h = m.shape.head_dim;
  const fi::PrefillPlanInfo& plan = m.plan;
  p.request_indices = fi::GetPtrFromBaseOffset<int32_t>(m.int_ws, plan.request_indices_offset);
  p.qo_tile_indices = fi::GetPtrFromBaseOffset<int32_t>(m.int_ws, plan.qo_tile_indices_offset);
  p.kv_tile_indices = fi::GetPtrFromBaseOffset<int32_t>(m.int_ws, plan.kv_tile_indices_offset);
  p.o_indptr = fi::GetPtrFromBaseOffset<int32_t>(m.int_ws, plan.o_indptr_offset);
  p.kv_chunk_size_ptr = fi::GetPtrFromBaseOffset<int32_t>(m.int_ws, plan.kv_chunk_size_ptr_offset);
  bf16* tmp_v = nullptr;
  float* tmp_s = nullptr;
  if (plan.split_kv) {
    p.merge_indptr = fi::GetPtrFromBaseOffset<int32_t>(m.int_ws, plan.merge_indptr_offset);
    tmp_v = fi::GetPtrFromBaseOffset<bf16>(m.float_ws, plan.v_offset);
    tmp_s = fi::GetPtrFromBaseOffset<float>(m.float_ws, plan.s_offset);
  }
  p.padded_batch_size = static_cast<uint32_t>(plan.padded_batch_size);
  p.max_total_num_rows = static_cast<uint32_t>(plan.total_num_rows);
  if (plan.enable_cuda_graph) {
    p.block_valid_mask = fi::GetPtrFromBaseOffset<bool>(m.int_ws, plan.block_valid_mask_offset);
    p.total_num_rows = fi::GetPtrFromBaseOffset<uint32_t>(m.int_ws, plan.total_num_rows_offset);
  }
  cudaError_t st = cudaSuccess;
  try {
    const bool positioned = m.row_positions != nullptr;
    st = m.shape.head_dim == 64
             ? LaunchFor<64>(positioned, plan.cta_tile_q, p, tmp_v, tmp_s, stream)
             : LaunchFor<128>(positioned, plan.cta_tile_q, p, tmp_v, tmp_s, stream);
  } catch (const std::exception& e) {
    return Internal(std::string("FlashAttention::Run: ") + e.what());
  }
  KDN_CUDA_RETURN_IF_ERROR(st);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

bool FlashAttention::planned_hopper() const { return impl_->planned_hopper; }

#else  // !KDN_FLASHINFER

struct FlashAttention::Impl {};

bool FlashAttention::planned_hopper() const { return false; }

bool FlashAttention::Supports(const AttentionShape&) { return false; }

Result<std::unique_ptr<FlashAttention>> FlashAttention::Create(const AttentionShape&, int, int64_t,
                                                               int64_t, bool) {
  return Unimplemented(
      "FlashAttention: this build has no FlashInfer headers (scripts/install-deps.sh fetches "
      "them)");
}

FlashAttention::FlashAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
FlashAttention::~FlashAttention() = default;

Status FlashAttention::Plan(const AttentionSequence*, int, bool, cudaStream_t) {
  return Unimplemented("FlashAttention: not built");
}

Status FlashAttention::PlanFull(const AttentionSequence*, int, cudaStream_t) {
  return Unimplemented("FlashAttention: not built");
}

Status FlashAttention::PlanPositions(const AttentionSequence*, int, const int32_t*, cudaStream_t) {
  return Unimplemented("FlashAttention: not built");
}

bool FlashAttention::hopper() const { return false; }

Status FlashAttention::MergeInPlace(__nv_bfloat16*, float*, const __nv_bfloat16*, const float*,
                                    int64_t, int, int, cudaStream_t) {
  return Unimplemented("FlashAttention: not built");
}

Status FlashAttention::Run(const __nv_bfloat16*, int64_t, PagedKvLayer<const __nv_bfloat16>,
                           __nv_bfloat16*, cudaStream_t, float*) {
  return Unimplemented("FlashAttention: not built");
}

#endif  // KDN_FLASHINFER

}  // namespace kdn::engine::cuda
