// CudaEngine's per-layer calls for blend (engine.h: RowPass,
// RotateCachedKeys). A row pass runs its rows through the engine's
// activation buffers; attention runs once per run of consecutive positions
// (each run attends causally over the cache below its end, which is exactly
// a prefill of that run on top of the cache), and the deviation of the rows'
// new K and V from the cached ones is taken on the host from two gathers.
#include "cuda_engine_impl.h"

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
  CudaRowPass(CudaEngine::Impl& m, KvSequence& seq, std::vector<int64_t> positions)
      : m_(m), seq_(seq), positions_(std::move(positions)) {}

  // Uploads the rows' embeddings, positions, slots and the sequence's table.
  Status Start(std::span<const int32_t> tokens) {
    std::vector<int32_t> ids(positions_.size());
    for (size_t i = 0; i < positions_.size(); ++i) ids[i] = tokens[positions_[i]];
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m_.ids.get(), ids.data(),
                                             ids.size() * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, m_.stream));
    const std::vector<int32_t>& blocks = seq_.blocks();
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m_.tables.get(), blocks.data(),
                                             blocks.size() * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, m_.stream));
    KDN_RETURN_IF_ERROR(m_.Embed(static_cast<int64_t>(ids.size())));
    KDN_RETURN_IF_ERROR(UploadRows());
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m_.stream));  // ids is a host vector
    return Status::Ok();
  }

  Status RunLayer(std::vector<float>* deviation) override {
    const ModelConfig& c = m_.config;
    const int l = next_layer_;
    if (l >= c.num_layers) return FailedPrecondition("row pass: every layer has run");
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
                                                 c.head_dim, m_.positions.get(),
                                                 m_.inv_freq.get(), m_.slots.get(), m_.Layer(l),
                                                 m_.stream));
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
    // Compact the kept rows' hidden states to the front, run by run (kept
    // rows only move down, and runs are copied in ascending order).
    const int64_t d = m_.config.hidden_size;
    std::vector<int64_t> kept;
    for (size_t i = 0; i < rows.size();) {
      size_t j = i + 1;
      while (j < rows.size() && rows[j] == rows[j - 1] + 1) ++j;
      if (rows[i] != static_cast<int64_t>(i)) {
        KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
            m_.x.get() + static_cast<int64_t>(i) * d, m_.x.get() + rows[i] * d,
            (j - i) * d * sizeof(bf16), cudaMemcpyDeviceToDevice, m_.stream));
      }
      i = j;
    }
    for (int64_t r : rows) kept.push_back(positions_[r]);
    positions_ = std::move(kept);
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
      pos_host_[i] = static_cast<int32_t>(p);
      slot_host_[i] = int64_t{blocks[p / kKvBlockTokens]} * kKvBlockTokens + p % kKvBlockTokens;
    }
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m_.positions.get(), pos_host_.data(),
                                             pos_host_.size() * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, m_.stream));
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(m_.slots.get(), slot_host_.data(),
                                             slot_host_.size() * sizeof(int64_t),
                                             cudaMemcpyHostToDevice, m_.stream));
    runs_ = Runs(positions_);
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

  // Per row, the squared distance between new_ and old_ (both on the device,
  // the stream synchronized).
  Status Deviation(std::vector<float>* deviation) {
    const int64_t kvd = m_.config.kv_dim();
    const size_t n = 2 * positions_.size() * static_cast<size_t>(kvd);
    std::vector<uint16_t> a(n), b(n);
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpy(a.data(), old_.get(), n * 2, cudaMemcpyDeviceToHost));
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpy(b.data(), new_.get(), n * 2, cudaMemcpyDeviceToHost));
    std::vector<float> fa(n), fb(n);
    ToFloat(DType::kBF16, a.data(), n, fa.data());
    ToFloat(DType::kBF16, b.data(), n, fb.data());
    deviation->assign(positions_.size(), 0.0f);
    for (const Run& r : runs_) {
      const int64_t base = 2 * r.row * kvd;
      for (int64_t j = 0; j < r.len; ++j) {
        double sum = 0.0;
        for (int kv = 0; kv < 2; ++kv) {
          const int64_t at = base + (kv * r.len + j) * kvd;
          for (int64_t i = 0; i < kvd; ++i) {
            const double e = static_cast<double>(fb[at + i]) - fa[at + i];
            sum += e * e;
          }
        }
        (*deviation)[r.row + j] = static_cast<float>(sum);
      }
    }
    return Status::Ok();
  }

  // Each run attends over the cache below its end: a prefill of the run.
  Status Attend(int l, int qkv_out) {
    const ModelConfig& c = m_.config;
    const int64_t qd = c.q_dim();
    const std::vector<int32_t>& blocks = seq_.blocks();
    if (m_.flash != nullptr) {
      for (const Run& r : runs_) {
        const int64_t kv_len = r.pos + r.len;
        const AttentionSequence one{static_cast<int32_t>(r.len), kv_len, blocks.data(),
                                    (kv_len + kKvBlockTokens - 1) / kKvBlockTokens};
        KDN_RETURN_IF_ERROR(m_.flash->Plan(&one, 1, /*graph=*/false, m_.stream));
        KDN_RETURN_IF_ERROR(m_.flash->Run(m_.qkv.get() + r.row * qkv_out, qkv_out,
                                          m_.ConstLayer(l), m_.attn.get() + r.row * qd,
                                          m_.stream));
      }
      return Status::Ok();
    }
    const auto rows = static_cast<int64_t>(positions_.size());
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(
        m_.q.get(), qd * sizeof(bf16), m_.qkv.get(), qkv_out * sizeof(bf16), qd * sizeof(bf16),
        rows, cudaMemcpyDeviceToDevice, m_.stream));
    const AttentionShape shape = m_.Shape();
    for (const Run& r : runs_) {
      KDN_RETURN_IF_ERROR(PrefillAttentionCuda<bf16>(m_.q.get() + r.row * qd, r.len, r.pos,
                                                     m_.ConstLayer(l), m_.tables.get(), shape,
                                                     m_.attn.get() + r.row * qd, m_.stream));
    }
    return Status::Ok();
  }

  CudaEngine::Impl& m_;
  KvSequence& seq_;
  std::vector<int64_t> positions_;
  std::vector<Run> runs_;
  std::vector<int32_t> pos_host_;
  std::vector<int64_t> slot_host_;
  DeviceArray<bf16> old_, new_;
  int next_layer_ = 0;
};

Result<std::unique_ptr<RowPass>> CudaEngine::BeginRowPass(KvSequence& seq,
                                                          std::span<const int32_t> tokens,
                                                          std::span<const int64_t> positions) {
  Impl& m = *impl_;
  KDN_RETURN_IF_ERROR(CheckRowPass(m.config, seq, tokens, positions));
  if (static_cast<int64_t>(positions.size()) > m.max_rows) {
    return InvalidArgument("row pass: " + std::to_string(positions.size()) +
                           " rows; at most " + std::to_string(m.max_rows) +
                           " (CudaEngineOptions::max_prefill_tokens)");
  }
  auto pass = std::make_unique<CudaRowPass>(
      m, seq, std::vector<int64_t>(positions.begin(), positions.end()));
  KDN_RETURN_IF_ERROR(pass->Start(tokens));
  return std::unique_ptr<RowPass>(std::move(pass));
}

Status CudaEngine::RotateCachedKeys(KvSequence& seq, int64_t first, int64_t count, int64_t delta,
                                    int layer) {
  Impl& m = *impl_;
  KDN_RETURN_IF_ERROR(CheckRotation(m.config, seq, first, count, layer));
  if (delta == 0 || count == 0) return Status::Ok();
  const int l0 = layer < 0 ? 0 : layer;
  const int l1 = layer < 0 ? m.config.num_layers : layer + 1;
  for (int l = l0; l < l1; ++l) {
    KDN_RETURN_IF_ERROR(m.kv->RotateKeys(seq.blocks(), l, first, count, delta, m.inv_freq.get()));
  }
  return Status::Ok();
}

}  // namespace kdn::engine::cuda
