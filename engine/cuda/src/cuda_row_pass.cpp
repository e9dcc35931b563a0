// CudaEngine's per-layer calls for blend (engine.h: RowPass,
// RotateCachedKeys). A row pass runs its rows through the engine's
// activation buffers; attention is one FlashInfer launch per layer over every
// row with a per-row causal mask (the reference kernels, and any pass over a
// sequence with an attention bias: once per run of consecutive positions, a
// prefill of that run on top of the cache), and the
// deviation of the rows'
// new K and V from the cached ones is taken on the host from two gathers.
#include "cuda_engine_impl.h"
#include "kdn/engine/cuda/deviation.cuh"

#include <nvtx3/nvToolsExt.h>

namespace kdn::engine::cuda {

namespace {

// A run of rows [row, row + len) at positions [pos, pos + len).
struct Run {
  int64_t row, pos, len;
};

std::vector<Run> Runs(const std::vector<int64_t>& positions) {
  std::vector<Run> runs;
  for (int64_t i = 0; i < static_cast<int64_t>(positions.size()); ++i) {
    if (!runs.empty() && positions[i] == runs.back().pos + runs.back().len) {
      ++runs.back().len;
    } else {
      runs.push_back({i, positions[i], 1});
    }
  }
  return runs;
}

}  // namespace

class CudaRowPass final : public RowPass {
 public:
  CudaRowPass(CudaEngine::Impl& m, KvSequence& seq, std::vector<int64_t> positions,
              std::span<const int64_t> slot_positions)
      : m_(m), seq_(seq), positions_(std::move(positions)) {
    for (int64_t p : positions_) rope_.push_back(slot_positions.empty() ? p : slot_positions[p]);
  }
  // Its buffers go on the engine's device, whatever thread ends the pass.
  ~CudaRowPass() override { (void)UseDevice(m_.options.device); }

  // Uploads the rows' embeddings, positions, slots and the sequence's table.
  Status Start(std::span<const int32_t> tokens) {
    std::vector<int32_t> ids(positions_.size());
    for (size_t i = 0; i < positions_.size(); ++i) ids[i] = tokens[positions_[i]];
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m_.ids.get(), ids.data(), ids.size() * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, m_.stream));
    const std::vector<int32_t>& blocks = seq_.blocks();
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m_.tables.get(), blocks.data(),
                                             blocks.size() * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, m_.stream));
    // The sequence's attention bias, if any, held for the pass (a prefill
    // or decode between its layers stages its own).
    const ModelConfig& c = m_.config;
    const KvSequence* const one[] = {&seq_};
    KDN_RETURN_IF_ERROR(bias_.Stage(one, c.num_layers, c.num_heads, m_.stream));
    KDN_ASSIGN_OR_RETURN(reference_, m_.UsesReference(bias_));
    KDN_RETURN_IF_ERROR(m_.Embed(static_cast<int64_t>(ids.size())));
    KDN_RETURN_IF_ERROR(UploadRows());
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m_.stream));  // ids is a host vector
    return Status::Ok();
  }

  Status RunLayer(std::vector<float>* deviation) override {
    const ModelConfig& c = m_.config;
    const int l = next_layer_;
    if (l >= c.num_layers) return FailedPrecondition("row pass: every layer has run");
    KDN_RETURN_IF_ERROR(UseDevice(m_.options.device));
    // A range for Nsight tools (ncu --nvtx --nvtx-include "kdn.row_pass/");
    // free when none is attached.
    nvtxRangePushA("kdn.row_pass");
    struct Pop {
      ~Pop() { nvtxRangePop(); }
    } pop;
    const auto rows = static_cast<int64_t>(positions_.size());
    LayerWeights& L = m_.layers[l];
    const int qkv_out = static_cast<int>(m_.qkv_dim());
    KDN_RETURN_IF_ERROR(m_.NormGemm(m_.x.get(), rows, L.input_norm.get(), L.qkv.get(), qkv_out,
                                    m_.qkv.get(), CUDA_R_16BF));
    if (c.qkv_bias) {
      KDN_RETURN_IF_ERROR(
          AddBiasCuda<bf16>(m_.qkv.get(), L.qkv_bias.get(), rows, qkv_out, m_.stream));
    }
    if (deviation != nullptr) KDN_RETURN_IF_ERROR(Gather(l, &old_));
    KDN_RETURN_IF_ERROR(RopeQkvToCacheCuda<bf16>(m_.qkv.get(), rows, c.num_heads, c.num_kv_heads,
                                                 c.head_dim, m_.positions.get(), m_.inv_freq.get(),
                                                 m_.slots.get(), m_.Layer(l), m_.stream, m_.rope));
    if (deviation != nullptr) KDN_RETURN_IF_ERROR(Gather(l, &new_));
    KDN_RETURN_IF_ERROR(Attend(l, qkv_out));
    KDN_RETURN_IF_ERROR(m_.Finish(l, rows));
    // The layer's KV is final for these rows: other streams and the caller's
    // hook may read it once this returns.
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m_.stream));
    if (deviation != nullptr) KDN_RETURN_IF_ERROR(Deviation(deviation));
    ++next_layer_;
    return Status::Ok();
  }

  Status Keep(std::span<const int64_t> rows) override {
    KDN_RETURN_IF_ERROR(CheckKeep(rows, positions_.size()));
    KDN_RETURN_IF_ERROR(UseDevice(m_.options.device));
    // Compact the kept rows' hidden states to the front, run by run (kept
    // rows only move down, and runs are copied in ascending order).
    const int64_t d = m_.config.hidden_size;
    std::vector<int64_t> kept;
    for (size_t i = 0; i < rows.size();) {
      size_t j = i + 1;
      while (j < rows.size() && rows[j] == rows[j - 1] + 1) ++j;
      if (rows[i] != static_cast<int64_t>(i)) {
        KDN_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(m_.x.get() + static_cast<int64_t>(i) * d, m_.x.get() + rows[i] * d,
                            (j - i) * d * sizeof(bf16), cudaMemcpyDeviceToDevice, m_.stream));
      }
      i = j;
    }
    std::vector<int64_t> rope;
    for (int64_t r : rows) {
      kept.push_back(positions_[r]);
      rope.push_back(rope_[r]);
    }
    positions_ = std::move(kept);
    rope_ = std::move(rope);
    KDN_RETURN_IF_ERROR(UploadRows());
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m_.stream));
    return Status::Ok();
  }

  const std::vector<int64_t>& positions() const override { return positions_; }
  int next_layer() const override { return next_layer_; }

  Status Logits(std::vector<float>* logits) override {
    if (next_layer_ != m_.config.num_layers) {
      return FailedPrecondition("row pass: layers left to run");
    }
    KDN_RETURN_IF_ERROR(UseDevice(m_.options.device));
    logits->clear();
    return m_.Logits(static_cast<int64_t>(positions_.size()) - 1, 1, logits);
  }

 private:
  // Positions and cache slots of the current rows to the device.
  Status UploadRows() {
    const std::vector<int32_t>& blocks = seq_.blocks();
    pos_host_.resize(positions_.size());
    slot_host_.resize(positions_.size());
    for (size_t i = 0; i < positions_.size(); ++i) {
      const int64_t p = positions_[i];
      pos_host_[i] = static_cast<int32_t>(rope_[i]);  // RoPE's; p is the slot
      slot_host_[i] = int64_t{blocks[p / kKvBlockTokens]} * kKvBlockTokens + p % kKvBlockTokens;
    }
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m_.positions.get(), pos_host_.data(),
                                             pos_host_.size() * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, m_.stream));
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m_.slots.get(), slot_host_.data(),
                                             slot_host_.size() * sizeof(int64_t),
                                             cudaMemcpyHostToDevice, m_.stream));
    runs_ = Runs(positions_);
    planned_ = false;
    return Status::Ok();
  }

  // The cached K and V of the current rows at layer l into *out: per run,
  // its K rows then its V rows, at 2 * run.row rows in.
  Status Gather(int l, DeviceArray<bf16>* out) {
    const int64_t kvd = m_.config.kv_dim();
    const int64_t n = 2 * static_cast<int64_t>(positions_.size()) * kvd;
    if (out->size() < n) KDN_RETURN_IF_ERROR(out->Allocate(n));
    for (const Run& r : runs_) {
      KDN_RETURN_IF_ERROR(GatherKvCuda<bf16>(m_.Layer(l), m_.tables.get(), r.pos, r.len,
                                             out->get() + 2 * r.row * kvd, m_.stream));
    }
    return Status::Ok();
  }

  // Per row, the squared distance between new_ and old_ (both on the
  // device): one distance per K or V row on the device, then each row's two
  // summed here.
  Status Deviation(std::vector<float>* deviation) {
    const int64_t kvd = m_.config.kv_dim();
    const auto rows = static_cast<int64_t>(positions_.size());
    if (dist_.size() < 2 * rows) KDN_RETURN_IF_ERROR(dist_.Allocate(2 * rows));
    KDN_RETURN_IF_ERROR(RowSquaredDistanceCuda<bf16>(old_.get(), new_.get(), 2 * rows, kvd,
                                                     dist_.get(), m_.stream));
    std::vector<float> half(2 * rows);
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(half.data(), dist_.get(), half.size() * sizeof(float),
                                             cudaMemcpyDeviceToHost, m_.stream));
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m_.stream));
    deviation->assign(positions_.size(), 0.0f);
    for (const Run& r : runs_) {
      // The run's K rows, then its V rows, from row 2 * r.row of the buffers.
      for (int64_t j = 0; j < r.len; ++j) {
        (*deviation)[r.row + j] = half[2 * r.row + j] + half[2 * r.row + r.len + j];
      }
    }
    return Status::Ok();
  }

  // Plans scattered rows: up to kRowBands bands of consecutive rows. The keys
  // below the block of a band's first row are seen by every row of the band:
  // with Hopper kernels (flash_shared) they go there without a mask, and the
  // rest of the band's keys, up to its last row, through the per-row mask
  // (FA2); the two parts merge by their log-sum-exp. Without them every key
  // goes through the mask.
  Status PlanScattered() {
    const auto rows = static_cast<int64_t>(positions_.size());
    const std::vector<int32_t>& blocks = seq_.blocks();
    const bool cascade = m_.flash_shared != nullptr;
    const auto pages = [](int64_t kv) { return (kv + kKvBlockTokens - 1) / kKvBlockTokens; };
    int bands = static_cast<int>(
        std::min<int64_t>({kRowBands, rows, static_cast<int64_t>(m_.options.max_batch)}));
    std::vector<AttentionSequence> masked, shared;
    for (;; --bands) {  // as many bands as the masked plan's block budget holds
      masked.clear();
      shared.clear();
      rel_host_.resize(rows);
      shared_row0_ = rows;
      int64_t budget = 0;
      for (int b = 0; b < bands; ++b) {
        const int64_t r0 = rows * b / bands, r1 = rows * (b + 1) / bands;
        const int64_t base = cascade ? positions_[r0] / kKvBlockTokens * kKvBlockTokens : 0;
        const int64_t end = positions_[r1 - 1] + 1;
        masked.push_back({static_cast<int32_t>(r1 - r0), end - base,
                          blocks.data() + base / kKvBlockTokens,
                          static_cast<int64_t>(blocks.size()) - base / kKvBlockTokens});
        budget += pages(end - base);
        for (int64_t r = r0; r < r1; ++r) rel_host_[r] = static_cast<int32_t>(positions_[r] - base);
        if (base > 0) {
          if (shared.empty()) shared_row0_ = r0;
          shared.push_back(
              {static_cast<int32_t>(r1 - r0), base, blocks.data(), base / kKvBlockTokens});
        }
      }
      if (budget <= m_.kv->num_blocks() || bands == 1) break;
    }
    shared_rows_ = rows - shared_row0_;
    if (rel_pos_.size() < rows) KDN_RETURN_IF_ERROR(rel_pos_.Allocate(rows));
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(rel_pos_.get(), rel_host_.data(),
                                             rows * sizeof(int32_t), cudaMemcpyHostToDevice,
                                             m_.stream));
    KDN_RETURN_IF_ERROR(m_.flash->PlanPositions(masked.data(), static_cast<int>(masked.size()),
                                                rel_pos_.get(), m_.stream));
    if (shared_rows_ == 0) return Status::Ok();
    const int64_t heads = m_.config.num_heads;
    if (lse_.size() < rows * heads) KDN_RETURN_IF_ERROR(lse_.Allocate(rows * heads));
    if (shared_lse_.size() < shared_rows_ * heads) {
      KDN_RETURN_IF_ERROR(shared_lse_.Allocate(shared_rows_ * heads));
    }
    if (shared_out_.size() < shared_rows_ * m_.config.q_dim()) {
      KDN_RETURN_IF_ERROR(shared_out_.Allocate(shared_rows_ * m_.config.q_dim()));
    }
    return m_.flash_shared->PlanFull(shared.data(), static_cast<int>(shared.size()), m_.stream);
  }

  // Every row attends over the cache up to its own position. With FlashInfer
  // that is one launch per layer, planned once for the rows (after Start and
  // each Keep): consecutive rows are a prefill of them on top of the cache
  // (the causal kernels, Hopper's where the device has them), scattered
  // rows take a per-row mask. The reference kernels go run by run, each a
  // prefill of the run.
  Status Attend(int l, int qkv_out) {
    const ModelConfig& c = m_.config;
    const int64_t qd = c.q_dim();
    const std::vector<int32_t>& blocks = seq_.blocks();
    if (!reference_) {
      if (!planned_) {
        if (runs_.size() == 1) {
          const int64_t kv_len = runs_[0].pos + runs_[0].len;
          const AttentionSequence one{static_cast<int32_t>(runs_[0].len), kv_len, blocks.data(),
                                      (kv_len + kKvBlockTokens - 1) / kKvBlockTokens};
          KDN_RETURN_IF_ERROR(m_.flash->Plan(&one, 1, /*graph=*/false, m_.stream));
          shared_rows_ = 0;
        } else {
          KDN_RETURN_IF_ERROR(PlanScattered());
        }
        planned_ = true;
      }
      const bool split = shared_rows_ > 0;
      KDN_RETURN_IF_ERROR(m_.flash->Run(m_.qkv.get(), qkv_out, m_.ConstLayer(l), m_.attn.get(),
                                        m_.stream, split ? lse_.get() : nullptr));
      if (!split) return Status::Ok();
      KDN_RETURN_IF_ERROR(m_.flash_shared->Run(m_.qkv.get() + shared_row0_ * qkv_out, qkv_out,
                                               m_.ConstLayer(l), shared_out_.get(), m_.stream,
                                               shared_lse_.get()));
      return FlashAttention::MergeInPlace(
          m_.attn.get() + shared_row0_ * qd, lse_.get() + shared_row0_ * c.num_heads,
          shared_out_.get(), shared_lse_.get(), shared_rows_, c.num_heads, c.head_dim, m_.stream);
    }
    const auto rows = static_cast<int64_t>(positions_.size());
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(m_.q.get(), qd * sizeof(bf16), m_.qkv.get(),
                                               qkv_out * sizeof(bf16), qd * sizeof(bf16), rows,
                                               cudaMemcpyDeviceToDevice, m_.stream));
    const AttentionShape shape = m_.Shape(l);
    const ScoreBiasCuda bias = bias_.Layer(l, c.num_heads);
    for (const Run& r : runs_) {
      KDN_RETURN_IF_ERROR(PrefillAttentionCuda<bf16>(m_.q.get() + r.row * qd, r.len, r.pos,
                                                     m_.ConstLayer(l), m_.tables.get(), shape,
                                                     m_.attn.get() + r.row * qd, m_.stream, bias));
    }
    return Status::Ok();
  }

  CudaEngine::Impl& m_;
  KvSequence& seq_;
  std::vector<int64_t> positions_;
  std::vector<Run> runs_;
  bool planned_ = false;  // the attention plan is for the current rows
  // The reference kernels (no FlashAttention, or a bias: bias_), run by run.
  bool reference_ = true;
  DeviceBias bias_;
  // PlanScattered's: rows from shared_row0_ on (shared_rows_ of them) have
  // shared keys; each row's position from its band's first masked key.
  int64_t shared_row0_ = 0, shared_rows_ = 0;
  std::vector<int32_t> rel_host_;
  DeviceArray<int32_t> rel_pos_;
  DeviceArray<float> lse_, shared_lse_;
  DeviceArray<bf16> shared_out_;
  std::vector<int64_t> rope_;  // the rows' positions (positions_ are their slots)
  std::vector<int32_t> pos_host_;
  std::vector<int64_t> slot_host_;
  DeviceArray<bf16> old_, new_;
  DeviceArray<float> dist_;
  int next_layer_ = 0;
};

Result<std::unique_ptr<RowPass>> CudaEngine::BeginRowPass(KvSequence& seq,
                                                          std::span<const int32_t> tokens,
                                                          std::span<const int64_t> positions,
                                                          std::span<const int64_t> slot_positions) {
  Impl& m = *impl_;
  KDN_RETURN_IF_ERROR(RefuseHoles(seq, "row pass"));
  KDN_RETURN_IF_ERROR(CheckRowPass(m.config, seq, tokens, positions, slot_positions));
  if (static_cast<int64_t>(positions.size()) > m.max_rows) {
    return InvalidArgument("row pass: " + std::to_string(positions.size()) + " rows; at most " +
                           std::to_string(m.max_rows) + " (CudaEngineOptions::max_prefill_tokens)");
  }
  KDN_RETURN_IF_ERROR(UseDevice(m.options.device));
  auto pass = std::make_unique<CudaRowPass>(
      m, seq, std::vector<int64_t>(positions.begin(), positions.end()), slot_positions);
  KDN_RETURN_IF_ERROR(pass->Start(tokens));
  return std::unique_ptr<RowPass>(std::move(pass));
}

Status CudaEngine::RotateCachedKeys(KvSequence& seq, int64_t first, int64_t count, int64_t delta,
                                    int layer) {
  Impl& m = *impl_;
  KDN_RETURN_IF_ERROR(CheckRotation(m.config, seq, first, count, delta, layer));
  if (delta == 0 || count == 0) return Status::Ok();
  const int l0 = layer < 0 ? 0 : layer;
  const int l1 = layer < 0 ? m.config.num_layers : layer + 1;
  for (int l = l0; l < l1; ++l) {
    KDN_RETURN_IF_ERROR(m.kv->RotateKeys(seq.blocks(), l, first, count, delta, m.inv_freq.get()));
  }
  return Status::Ok();
}

}  // namespace kdn::engine::cuda
