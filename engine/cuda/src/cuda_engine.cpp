#include "cuda_engine_impl.h"

#include <atomic>

namespace kdn::engine::cuda {

namespace {

// What Create and Materialize share: the device checked, then every buffer
// but the weights.
Result<std::unique_ptr<CudaEngine::Impl>> SetUp(const ModelConfig& config,
                                                const CudaEngineOptions& options) {
  KDN_RETURN_IF_ERROR(CheckDevice(config, options));
  auto impl = std::make_unique<CudaEngine::Impl>();
  impl->config = config;
  impl->options = options;
  KDN_RETURN_IF_ERROR(impl->Setup());
  return impl;
}

}  // namespace

CudaEngine::CudaEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaEngine::~CudaEngine() {
  // The engine may be destroyed on a thread other than the one that used it
  // last; its buffers, graphs and streams go on its own device.
  if (impl_ != nullptr) (void)UseDevice(impl_->options.device);
}

Result<std::unique_ptr<CudaEngine>> CudaEngine::Create(const ModelConfig& config,
                                                       const ModelWeights& weights,
                                                       const CudaEngineOptions& options) {
  KDN_ASSIGN_OR_RETURN(auto impl, SetUp(config, options));
  KDN_RETURN_IF_ERROR(impl->UploadWeights(weights));
  return std::unique_ptr<CudaEngine>(new CudaEngine(std::move(impl)));
}

Result<std::unique_ptr<CudaEngine>> CudaEngine::Materialize(const ModelConfig& config,
                                                            uint64_t seed,
                                                            const CudaEngineOptions& options) {
  KDN_ASSIGN_OR_RETURN(auto impl, SetUp(config, options));
  KDN_RETURN_IF_ERROR(impl->MaterializeWeights(seed));
  return std::unique_ptr<CudaEngine>(new CudaEngine(std::move(impl)));
}

const ModelConfig& CudaEngine::config() const { return impl_->config; }
std::string CudaEngine::device() const { return "cuda:" + std::to_string(impl_->options.device); }
KvCache& CudaEngine::kv_cache() { return *impl_->kv; }

namespace {

// The device whose context pins host buffers: the pool maps buffers on
// whatever thread needs one (a transport's receiver, say), whose current
// device would otherwise be 0, and a context made there would take memory
// on a GPU the worker was not given. Portable pinning serves every device.
std::atomic<int> pin_device{0};

bool PinHost(void* p, size_t bytes) {
  if (cudaSetDevice(pin_device.load()) == cudaSuccess &&
      cudaHostRegister(p, bytes, cudaHostRegisterPortable) == cudaSuccess) {
    return true;
  }
  (void)cudaGetLastError();  // not sticky: clear it for the next launch's check
  return false;
}

void UnpinHost(void* p) {
  if (cudaSetDevice(pin_device.load()) != cudaSuccess || cudaHostUnregister(p) != cudaSuccess) {
    (void)cudaGetLastError();
  }
}

}  // namespace

const HostPinning* CudaEngine::host_pinning() const {
  static const HostPinning pinning{PinHost, UnpinHost};
  pin_device.store(impl_->options.device);
  return &pinning;
}
int64_t CudaEngine::weight_bytes() const { return impl_->weight_bytes; }
int64_t CudaEngine::max_prefill_tokens() const { return impl_->max_rows; }

Status CudaEngine::Prefill(KvSequence& seq, std::span<const int32_t> tokens,
                           const PrefillOptions& options, std::vector<float>* logits) {
  Impl& m = *impl_;
  const ModelConfig& c = m.config;
  const auto n = static_cast<int64_t>(tokens.size());
  if (n == 0) return InvalidArgument("prefill: no tokens");
  KDN_RETURN_IF_ERROR(UseDevice(m.options.device));
  if (n > m.max_rows) {
    return InvalidArgument("prefill: " + std::to_string(n) + " tokens in one call; at most " +
                           std::to_string(m.max_rows) + " (CudaEngineOptions::max_prefill_tokens)");
  }
  KDN_RETURN_IF_ERROR(RefuseHoles(seq, "prefill"));
  KDN_RETURN_IF_ERROR(CheckAttentionBias(c, seq));
  const int64_t start = seq.length();
  if (seq.next_position() + n > c.max_context) {
    return InvalidArgument("prefill: " + std::to_string(seq.next_position() + n) +
                           " tokens exceed the model's context of " +
                           std::to_string(c.max_context));
  }
  KDN_RETURN_IF_ERROR(m.CheckTokens(tokens));
  KDN_RETURN_IF_ERROR(m.kv->Reserve(seq, start + n));
  // On failure the blocks taken here go back; the KV held before stays.
  Status st = m.PrefillBody(seq, tokens, start, options, logits);
  if (!st.ok()) {
    seq.Truncate(start);
    return st;
  }
  m.kv->SetLength(seq, start + n);
  return Status::Ok();
}

Status CudaEngine::Impl::PrefillBody(KvSequence& seq, std::span<const int32_t> tokens,
                                     int64_t start, const PrefillOptions& options,
                                     std::vector<float>* logits) {
  Impl& m = *this;
  const ModelConfig& c = m.config;
  const auto n = static_cast<int64_t>(tokens.size());
  const std::vector<int32_t>& blocks = seq.blocks();
  std::vector<int32_t> pos(n);
  std::vector<int64_t> slot(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = start + i;  // the slot; its position is past pruned KV
    pos[i] = static_cast<int32_t>(seq.position_shift() + p);
    slot[i] = int64_t{blocks[p / 16]} * 16 + p % 16;
  }
  auto up = [&](void* dst, const void* src, size_t bytes) {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, m.stream);
  };
  KDN_CUDA_RETURN_IF_ERROR(up(m.ids.get(), tokens.data(), n * sizeof(int32_t)));
  KDN_CUDA_RETURN_IF_ERROR(up(m.positions.get(), pos.data(), n * sizeof(int32_t)));
  KDN_CUDA_RETURN_IF_ERROR(up(m.slots.get(), slot.data(), n * sizeof(int64_t)));
  // Its attention bias, if any, for this call alone.
  struct BiasScope {
    DeviceBias& b;
    ~BiasScope() { b.any = false; }
  } bias_scope{m.call_bias};
  const KvSequence* const one_seq[] = {&seq};
  KDN_RETURN_IF_ERROR(m.call_bias.Stage(one_seq, c.num_layers, c.num_heads, m.stream));
  KDN_ASSIGN_OR_RETURN(const bool reference, m.UsesReference(m.call_bias));
  if (!reference) {
    const AttentionSequence one{static_cast<int32_t>(n), start + n, blocks.data(),
                                static_cast<int64_t>(blocks.size())};
    KDN_RETURN_IF_ERROR(m.flash->Plan(&one, 1, /*graph=*/false, m.stream));
  } else {
    KDN_CUDA_RETURN_IF_ERROR(up(m.tables.get(), blocks.data(), blocks.size() * sizeof(int32_t)));
  }
  KDN_RETURN_IF_ERROR(m.Embed(n));
  // The hook, if any, sees each layer's queries (KV pruning's scores).
  struct HookScope {
    Impl& m;
    ~HookScope() {
      m.query_hook = nullptr;
      m.query_positions = nullptr;
    }
  } hook_scope{m};
  if (options.on_queries) {
    m.query_hook = &options.on_queries;
    m.query_positions = pos.data();
  }
  const int run = options.layers > 0 ? std::min(options.layers, c.num_layers) : c.num_layers;
  for (int l = 0; l < run; ++l) {
    KDN_RETURN_IF_ERROR(m.Attend(l, n, /*decode=*/false, start, 0, 0));
    KDN_RETURN_IF_ERROR(m.Finish(l, n));
    if (options.on_layer) {
      KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(m.stream));
      m.kv->SetLength(seq, start + n);  // the hook may read the layer's KV
      Status st = options.on_layer(l);
      m.kv->SetLength(seq, start);
      if (!st.ok()) return st;
    }
  }
  logits->clear();
  if (run < c.num_layers) return Status::Ok();  // a scoring pass: no logits
  return options.all_logits ? m.Logits(0, n, logits) : m.Logits(n - 1, 1, logits);
}

Status CudaEngine::DecodeStep(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                              std::vector<float>* logits) {
  return impl_->Decode(seqs, tokens, logits, nullptr);
}

Status CudaEngine::DecodeGreedy(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                                std::vector<int32_t>* next) {
  return impl_->Decode(seqs, tokens, nullptr, next);
}

Status CudaEngine::DecodeSample(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                                std::span<Sampler* const> samplers, std::vector<int32_t>* next) {
  KDN_RETURN_IF_ERROR(CheckDecodeBatch(seqs, tokens, samplers.size()));
  for (Sampler* s : samplers) {
    if (s == nullptr) return InvalidArgument("decode: a null sampler");
    KDN_RETURN_IF_ERROR(model::ValidateSamplingParams(s->params()));
  }
  return impl_->Decode(seqs, tokens, nullptr, next, samplers);
}

bool CudaEngine::uses_flash_attention() const { return impl_->flash != nullptr; }
bool CudaEngine::uses_cuda_graphs() const { return impl_->graphs(); }

Status CudaEngine::Impl::Decode(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                                std::vector<float>* logits_out, std::vector<int32_t>* next_out,
                                std::span<Sampler* const> samplers) {
  const ModelConfig& c = config;
  const auto batch = static_cast<int64_t>(seqs.size());
  KDN_RETURN_IF_ERROR(CheckDecodeBatch(seqs, tokens, seqs.size()));
  for (const KvSequence* s : seqs) {
    KDN_RETURN_IF_ERROR(RefuseHoles(*s, "decode"));
    KDN_RETURN_IF_ERROR(CheckAttentionBias(c, *s));
  }
  KDN_RETURN_IF_ERROR(UseDevice(options.device));
  if (batch > options.max_batch) {
    return InvalidArgument("decode: batch of " + std::to_string(batch) + " beyond max_batch " +
                           std::to_string(options.max_batch));
  }
  KDN_RETURN_IF_ERROR(CheckTokens(tokens));
  for (KvSequence* s : seqs) {
    if (s->next_position() + 1 > c.max_context) {
      return InvalidArgument("decode: the context is full");
    }
  }
  // Blocks for the new tokens; on failure, give back what this step took
  // (Truncate to the unchanged length frees them).
  auto give_back = [&](int64_t upto) {
    for (int64_t u = 0; u < upto; ++u) seqs[u]->Truncate(seqs[u]->length());
  };
  for (int64_t b = 0; b < batch; ++b) {
    if (Status st = kv->Reserve(*seqs[b], seqs[b]->length() + 1); !st.ok()) {
      give_back(b);
      return st;
    }
  }
  // The step's attention biases, if any: the reference kernels apply them,
  // without a graph.
  struct BiasScope {
    DeviceBias& b;
    ~BiasScope() { b.any = false; }
  } bias_scope{call_bias};
  if (Status st = call_bias.Stage(std::vector<const KvSequence*>(seqs.begin(), seqs.end()),
                                  c.num_layers, c.num_heads, stream);
      !st.ok()) {
    give_back(batch);
    return st;
  }
  auto reference = UsesReference(call_bias);
  if (!reference.ok()) {
    give_back(batch);
    return reference.status();
  }
  const bool use_graph = graphs() && !call_bias.any;
  const int64_t rows = use_graph ? DecodeBucket(static_cast<int>(batch), options.max_batch) : batch;
  int64_t max_len = 0, stride = 0;
  std::vector<AttentionSequence> attn_seqs(rows);
  for (int64_t b = 0; b < rows; ++b) {
    if (b < batch) {
      const KvSequence& s = *seqs[b];
      const int64_t len = s.length();
      const std::vector<int32_t>& blocks = s.blocks();
      ids_host.get()[b] = tokens[b];
      positions_host.get()[b] = static_cast<int32_t>(s.next_position());
      slots_host.get()[b] = int64_t{blocks[len / 16]} * 16 + len % 16;
      attn_seqs[b] = {1, len + 1, blocks.data(), static_cast<int64_t>(blocks.size())};
      max_len = std::max(max_len, len + 1);
      stride = std::max(stride, static_cast<int64_t>(blocks.size()));
    } else {  // padding: token 0 at position 0 of the scratch block
      ids_host.get()[b] = 0;
      positions_host.get()[b] = 0;
      slots_host.get()[b] = int64_t{scratch_block} * 16;
      attn_seqs[b] = {1, 1, &scratch_block, 1};
    }
  }
  auto up = [&](void* dst, const void* src, size_t bytes) {
    return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream);
  };
  // From here on a failure gives back this step's blocks (below).
  auto inputs = [&]() -> Status {
    KDN_CUDA_RETURN_IF_ERROR(up(ids.get(), ids_host.get(), rows * sizeof(int32_t)));
    KDN_CUDA_RETURN_IF_ERROR(up(positions.get(), positions_host.get(), rows * sizeof(int32_t)));
    KDN_CUDA_RETURN_IF_ERROR(up(slots.get(), slots_host.get(), rows * sizeof(int64_t)));
    if (!*reference)
      return flash->Plan(attn_seqs.data(), static_cast<int>(rows), use_graph, stream);
    std::vector<int32_t> lens(batch), table(batch * stride, 0);
    for (int64_t b = 0; b < batch; ++b) {
      lens[b] = static_cast<int32_t>(seqs[b]->length() + 1);
      std::copy(seqs[b]->blocks().begin(), seqs[b]->blocks().end(), table.begin() + b * stride);
    }
    KDN_CUDA_RETURN_IF_ERROR(up(lengths.get(), lens.data(), batch * sizeof(int32_t)));
    // From pageable memory: the copies have read the vectors when they return.
    KDN_CUDA_RETURN_IF_ERROR(up(tables.get(), table.data(), table.size() * sizeof(int32_t)));
    return Status::Ok();
  };
  Status st = inputs();
  if (st.ok() && use_graph) {
    auto exec = DecodeGraph(static_cast<int>(rows));
    st = exec.ok() ? Status::Ok() : exec.status();
    if (st.ok()) {
      const cudaError_t launched = cudaGraphLaunch(*exec, stream);
      if (launched != cudaSuccess)
        st = Internal(std::string("cudaGraphLaunch: ") + cudaGetErrorString(launched));
    }
  } else if (st.ok()) {
    st = DecodeBody(rows, stride, max_len);
  }
  // Sampled rows: their draws from their own streams (kept to restore on
  // failure), then the device sampler over the step's logits.
  std::vector<Sampler> saved;
  if (st.ok() && !samplers.empty()) {
    std::vector<DeviceSamplingRow> rows_params(batch);
    bool any = false;
    for (int64_t b = 0; b < batch; ++b) {
      saved.push_back(*samplers[b]);
      const SamplingParams& p = samplers[b]->params();
      const double u = samplers[b]->NextDraw();
      rows_params[b] = {u < 0.0 ? 0.0f : p.temperature, p.top_k, p.top_p, u < 0.0 ? 0.0 : u};
      any = any || u >= 0.0;
    }
    if (any && sampler == nullptr) {
      auto made = DeviceSampler::Create(options.max_batch, c.vocab_size);
      if (made.ok())
        sampler = std::move(made).value();
      else
        st = made.status();
    }
    if (st.ok() && any) {
      st = sampler->Sample(logits.get(), rows_params.data(), static_cast<int>(batch), sampled.get(),
                           stream);
    }
  }
  if (st.ok() && logits_out != nullptr) {
    logits_out->resize(batch * c.vocab_size);
    const cudaError_t e =
        cudaMemcpyAsync(logits_out->data(), logits.get(), batch * c.vocab_size * sizeof(float),
                        cudaMemcpyDeviceToHost, stream);
    if (e != cudaSuccess) st = Internal(std::string("logits copy: ") + cudaGetErrorString(e));
  }
  if (st.ok() && next_out != nullptr) {
    const cudaError_t e = cudaMemcpyAsync(sampled_host.get(), sampled.get(),
                                          batch * sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
    if (e != cudaSuccess) st = Internal(std::string("token copy: ") + cudaGetErrorString(e));
  }
  const cudaError_t synced = cudaStreamSynchronize(stream);
  if (st.ok() && synced != cudaSuccess) st = Internal(cudaGetErrorString(synced));
  if (!st.ok()) {
    give_back(batch);
    for (size_t b = 0; b < saved.size(); ++b) *samplers[b] = saved[b];
    return st;
  }
  if (next_out != nullptr) next_out->assign(sampled_host.get(), sampled_host.get() + batch);
  for (KvSequence* s : seqs) kv->SetLength(*s, s->length() + 1);
  return Status::Ok();
}

}  // namespace kdn::engine::cuda
