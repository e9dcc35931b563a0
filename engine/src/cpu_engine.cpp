#include "kdn/engine/cpu_engine.h"

#include <cblas.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kdn/engine/cpu_ops.h"

namespace kdn::engine {

using model::ModelConfig;

struct CpuEngine::Layer {
  std::vector<float> attn_norm, ffn_norm;
  WeightMatrix wq, wk, wv;        // [out][hidden]
  std::vector<float> bq, bk, bv;  // empty without QKV bias
  WeightMatrix wo;                // [hidden][q_dim]
  std::vector<float> bo;          // empty without o bias
  WeightMatrix w_gate_up;         // [2*inter][hidden]: gate rows, then up rows
  WeightMatrix w_down;            // [hidden][inter]
};

struct CpuEngine::Segment {
  KvSequence* seq;
  const int32_t* tokens;
  int64_t n;      // new tokens
  int64_t start;  // slot of the first new token (= KV already held)
  int64_t row0;   // first row of this segment in the pass's activations
};

struct CpuEngine::Scratch {
  std::vector<float> h, q, k, v, attn, gu, act;
  ProductScratch product;
  // A forward pass's own: embeddings, positions, the logits' rows.
  std::vector<float> x, hf;
  // Each row's slot in its sequence's KV, and its position (RoPE's): the
  // same but past pruned KV (KvSequence::next_position).
  std::vector<int32_t> pos, rope_pos;
  std::vector<int64_t> out_rows;
  // Attention: the work's rows (a segment's row i, and i + 1 with it where
  // `pair`), and each OpenMP thread's buffers.
  struct Thread {
    std::vector<float> scores;
    std::vector<const float*> kb, vb;
  };
  struct AttendRows {
    const Segment* s;
    int64_t i;
    bool pair;
  };
  std::vector<AttendRows> short_rows;
  std::vector<Thread> threads;
  // A decode step's segments and logits (DecodeStep, DecodeSample).
  std::vector<Segment> segs;
  std::vector<float> logits;
  // Sizes every buffer for `rows` rows; capacity is kept across layers.
  void Fit(const ModelConfig& c, int64_t rows) {
    const int64_t d = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), ff = c.intermediate_size;
    h.resize(rows * d);
    q.resize(rows * qd);
    k.resize(rows * kvd);
    v.resize(rows * kvd);
    attn.resize(rows * qd);
    gu.resize(rows * 2 * ff);
    act.resize(rows * ff);
  }
};

namespace {

void AddBias(float* x, int64_t rows, int64_t cols, const std::vector<float>& bias) {
  if (bias.empty()) return;
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * cols;
    for (int64_t i = 0; i < cols; ++i) xr[i] += bias[i];
  }
}

// A vector's fp32 values (empty when the model has no such tensor).
std::vector<float> Take(ModelWeights& w, const std::string& name) {
  auto it = w.find(name);
  if (it == w.end()) return {};
  ToF32(&it->second);
  std::vector<float> v = std::move(it->second.data);
  w.erase(it);
  return v;
}

// A matrix in the format it came in.
Result<WeightMatrix> TakeMatrix(ModelWeights& w, const std::string& name) {
  auto it = w.find(name);
  if (it == w.end()) return NotFound("weights: tensor \"" + name + "\" is missing");
  HostTensor t = std::move(it->second);
  w.erase(it);
  return WeightMatrix::FromTensor(std::move(t), name);
}

// Gate and up projections as one matrix; a file that stores them in two
// formats has both widened to the wider (f32 for two quantized formats).
Result<WeightMatrix> StackOrWiden(WeightMatrix gate, WeightMatrix up) {
  if (gate.traits().type == up.traits().type)
    return WeightMatrix::Stack(std::move(gate), std::move(up));
  auto widen = [](const WeightMatrix& w) {
    HostTensor t;
    t.shape = {w.rows(), w.cols()};
    t.data.resize(static_cast<size_t>(w.rows() * w.cols()));
    for (int64_t r = 0; r < w.rows(); ++r) w.RowToFloat(r, &t.data[r * w.cols()]);
    return WeightMatrix::FromTensor(std::move(t), "mlp");
  };
  KDN_ASSIGN_OR_RETURN(WeightMatrix g, widen(gate));
  KDN_ASSIGN_OR_RETURN(WeightMatrix u, widen(up));
  return WeightMatrix::Stack(std::move(g), std::move(u));
}

// The first key a query at `position` sees: 0, or under a sliding window
// (transformers' mask: key j is seen when j > position - window) the oldest
// key inside it.
int64_t FirstVisibleKey(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
}

}  // namespace

CpuEngine::CpuEngine(const ModelConfig& config, const EngineOptions& options)
    : config_(config), options_(options), scratch_(std::make_unique<Scratch>()) {}

CpuEngine::~CpuEngine() = default;

Result<std::unique_ptr<CpuEngine>> CpuEngine::Create(const ModelConfig& config,
                                                     ModelWeights weights,
                                                     const EngineOptions& options) {
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    auto it = weights.find(spec.name);
    if (it == weights.end()) return NotFound("weights: tensor \"" + spec.name + "\" is missing");
    if (it->second.shape != spec.shape) {
      return InvalidArgument("weights: tensor \"" + spec.name + "\" has shape " +
                             ShapeToString(it->second.shape) + ", expected " +
                             ShapeToString(spec.shape));
    }
  }
  std::unique_ptr<CpuEngine> m(new CpuEngine(config, options));
  if (options.threads > 0) {
    omp_set_num_threads(options.threads);
    openblas_set_num_threads(options.threads);
  }
  KDN_ASSIGN_OR_RETURN(m->embed_, TakeMatrix(weights, "model.embed_tokens.weight"));
  if (!config.tie_word_embeddings) {
    KDN_ASSIGN_OR_RETURN(m->lm_head_, TakeMatrix(weights, "lm_head.weight"));
  }
  m->final_norm_ = Take(weights, "model.norm.weight");
  m->layers_.resize(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    Layer& L = m->layers_[l];
    L.attn_norm = Take(weights, p + "input_layernorm.weight");
    L.ffn_norm = Take(weights, p + "post_attention_layernorm.weight");
    KDN_ASSIGN_OR_RETURN(L.wq, TakeMatrix(weights, p + "self_attn.q_proj.weight"));
    KDN_ASSIGN_OR_RETURN(L.wk, TakeMatrix(weights, p + "self_attn.k_proj.weight"));
    KDN_ASSIGN_OR_RETURN(L.wv, TakeMatrix(weights, p + "self_attn.v_proj.weight"));
    L.bq = Take(weights, p + "self_attn.q_proj.bias");
    L.bk = Take(weights, p + "self_attn.k_proj.bias");
    L.bv = Take(weights, p + "self_attn.v_proj.bias");
    KDN_ASSIGN_OR_RETURN(L.wo, TakeMatrix(weights, p + "self_attn.o_proj.weight"));
    L.bo = Take(weights, p + "self_attn.o_proj.bias");
    KDN_ASSIGN_OR_RETURN(WeightMatrix gate, TakeMatrix(weights, p + "mlp.gate_proj.weight"));
    KDN_ASSIGN_OR_RETURN(WeightMatrix up, TakeMatrix(weights, p + "mlp.up_proj.weight"));
    KDN_ASSIGN_OR_RETURN(L.w_gate_up, StackOrWiden(std::move(gate), std::move(up)));
    KDN_ASSIGN_OR_RETURN(L.w_down, TakeMatrix(weights, p + "mlp.down_proj.weight"));
  }
  m->inv_freq_ = RopeInvFreq(config);
  m->rope_ = RopeParamsFor(config);
  int blocks = options.kv_blocks;
  if (blocks <= 0) {
    blocks = static_cast<int>((options.kv_tokens + kKvBlockTokens - 1) / kKvBlockTokens);
  }
  uint8_t* storage = nullptr;
  if (options.kv_pool_memory) {
    KDN_ASSIGN_OR_RETURN(storage,
                         options.kv_pool_memory(CpuKvCache::StorageBytes(
                             config.num_layers, config.num_kv_heads, config.head_dim, blocks)));
  }
  m->kv_ = std::make_unique<CpuKvCache>(config.num_layers, config.num_kv_heads, config.head_dim,
                                        blocks, storage);
  return m;
}

int64_t CpuEngine::weight_bytes() const {
  auto vec = [](const std::vector<float>& v) { return static_cast<int64_t>(v.size() * 4); };
  int64_t n = embed_.bytes() + lm_head_.bytes() + vec(final_norm_);
  for (const Layer& L : layers_) {
    n += L.wq.bytes() + L.wk.bytes() + L.wv.bytes() + L.wo.bytes() + L.w_gate_up.bytes() +
         L.w_down.bytes();
    n += vec(L.attn_norm) + vec(L.ffn_norm) + vec(L.bq) + vec(L.bk) + vec(L.bv) + vec(L.bo);
  }
  return n;
}

Result<std::unique_ptr<CpuEngine>> CpuEngine::Load(const std::filesystem::path& dir,
                                                   const EngineOptions& options) {
  KDN_ASSIGN_OR_RETURN(ModelConfig config, model::LoadModelConfig(dir));
  KDN_ASSIGN_OR_RETURN(ModelWeights weights, LoadWeights(dir, config, options.weights_dtype));
  return Create(config, std::move(weights), options);
}

Status CpuEngine::CheckPrefillTokens(size_t n) const {
  if (n == 0) return InvalidArgument("prefill: no tokens");
  if (static_cast<int64_t>(n) > max_prefill_tokens()) {
    return InvalidArgument("prefill: " + std::to_string(n) + " tokens in one call; at most " +
                           std::to_string(max_prefill_tokens()) +
                           " (EngineOptions::max_prefill_tokens)");
  }
  return Status::Ok();
}

Status CpuEngine::Prefill(KvSequence& seq, std::span<const int32_t> tokens,
                          const PrefillOptions& options, std::vector<float>* logits) {
  KDN_RETURN_IF_ERROR(CheckPrefillTokens(tokens.size()));
  Segment seg{&seq, tokens.data(), static_cast<int64_t>(tokens.size()), seq.length(), 0};
  return Forward(std::span<Segment>(&seg, 1), options.all_logits, options.on_layer,
                 options.on_queries, logits, options.layers);
}

std::vector<CpuEngine::Segment>& CpuEngine::DecodeSegments(std::span<KvSequence* const> seqs,
                                                           std::span<const int32_t> tokens) {
  std::vector<Segment>& segs = scratch_->segs;
  segs.clear();
  for (size_t b = 0; b < seqs.size(); ++b) {
    segs.push_back({seqs[b], &tokens[b], 1, seqs[b]->length(), static_cast<int64_t>(b)});
  }
  return segs;
}

Status CpuEngine::DecodeStep(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                             std::vector<float>* logits) {
  KDN_RETURN_IF_ERROR(CheckDecodeBatch(seqs, tokens, seqs.size()));
  return Forward(DecodeSegments(seqs, tokens), /*all_logits=*/false, LayerHook(), QueryHook(),
                 logits);
}

Status CpuEngine::DecodeSample(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                               std::span<Sampler* const> samplers, std::vector<int32_t>* next) {
  return DecodeSampleWith(seqs, tokens, samplers, next, {});
}

Status CpuEngine::DecodeSampleWith(std::span<KvSequence* const> seqs,
                                   std::span<const int32_t> tokens,
                                   std::span<Sampler* const> samplers, std::vector<int32_t>* next,
                                   std::span<const Piece> pieces) {
  KDN_RETURN_IF_ERROR(CheckDecodeBatch(seqs, tokens, samplers.size()));
  std::vector<Segment>& segs = DecodeSegments(seqs, tokens);
  for (const Piece& p : pieces) {
    KDN_RETURN_IF_ERROR(CheckPrefillTokens(p.tokens.size()));
    for (const Segment& s : segs) {
      if (s.seq == p.seq) return InvalidArgument("decode: a sequence appears twice in a step");
    }
    segs.push_back({p.seq, p.tokens.data(), static_cast<int64_t>(p.tokens.size()), p.seq->length(),
                    static_cast<int64_t>(segs.size())});
  }
  // The last row of each segment: the decode rows, then each piece's last.
  std::vector<float>& logits = scratch_->logits;
  KDN_RETURN_IF_ERROR(Forward(segs, /*all_logits=*/false, LayerHook(), QueryHook(), &logits));
  const size_t vocab = static_cast<size_t>(config_.vocab_size);
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].logits == nullptr) continue;
    const float* row = logits.data() + (seqs.size() + i) * vocab;
    pieces[i].logits->assign(row, row + vocab);
  }
  next->resize(seqs.size());
  for (size_t b = 0; b < seqs.size(); ++b) {
    (*next)[b] = samplers[b]->Sample(std::span<const float>(logits).subspan(b * vocab, vocab));
  }
  return Status::Ok();
}

Status CpuEngine::Forward(std::span<Segment> segs, bool all_logits, const LayerHook& hook,
                          const QueryHook& on_queries, std::vector<float>* logits, int layers) {
  const ModelConfig& c = config_;
  const int64_t d = c.hidden_size;

  // Validate and reserve KV room first, so that failure leaves sequences as
  // they were (Truncate gives back the blocks taken here).
  int64_t rows = 0;
  for (Segment& s : segs) {
    KDN_RETURN_IF_ERROR(CheckAttentionBias(c, *s.seq));
    if (s.seq->position_shift() + s.start + s.n > c.max_context) {
      return InvalidArgument(
          "sequence of " + std::to_string(s.seq->position_shift() + s.start + s.n) +
          " tokens exceeds the model's context of " + std::to_string(c.max_context));
    }
    for (int64_t i = 0; i < s.n; ++i) {
      if (s.tokens[i] < 0 || s.tokens[i] >= c.vocab_size) {
        return InvalidArgument("token id " + std::to_string(s.tokens[i]) +
                               " is outside the vocabulary [0, " + std::to_string(c.vocab_size) +
                               ")");
      }
    }
    s.row0 = rows;
    rows += s.n;
  }
  auto rollback = [&]() {
    for (Segment& s : segs) s.seq->Truncate(s.start);
  };
  for (Segment& s : segs) {
    Status st = kv_->Reserve(*s.seq, s.start + s.n);
    if (!st.ok()) {
      rollback();
      return st;
    }
  }

  // The engine's own buffers: grown once, no allocation per decode step.
  Scratch& scratch = *scratch_;
  std::vector<int32_t>&pos = scratch.pos, &rope_pos = scratch.rope_pos;
  pos.resize(rows);
  rope_pos.resize(rows);
  for (const Segment& s : segs) {
    for (int64_t i = 0; i < s.n; ++i) {
      pos[s.row0 + i] = static_cast<int32_t>(s.start + i);
      rope_pos[s.row0 + i] = static_cast<int32_t>(s.seq->position_shift() + s.start + i);
    }
  }
  std::vector<float>& x = scratch.x;
  x.resize(rows * d);
  for (const Segment& s : segs) {
    for (int64_t i = 0; i < s.n; ++i) {
      embed_.RowToFloat(s.tokens[i], &x[(s.row0 + i) * d]);
    }
  }

  const int run = layers > 0 ? std::min(layers, c.num_layers) : c.num_layers;
  for (int l = 0; l < run; ++l) {
    RunLayer(l, segs, {pos.data(), rope_pos.data()}, rows, x.data(), scratch, nullptr, &on_queries);
    if (hook) {
      // The hook sees this layer's KV for the new tokens: publish the lengths.
      for (Segment& s : segs) kv_->SetLength(*s.seq, s.start + s.n);
      Status st = hook(l);
      if (!st.ok()) {
        rollback();
        return st;
      }
    }
  }

  if (run < c.num_layers) {
    logits->clear();
    for (Segment& s : segs) kv_->SetLength(*s.seq, s.start + s.n);
    return Status::Ok();
  }
  // Logits: every row, or the last row of each segment.
  std::vector<int64_t>& out_rows = scratch.out_rows;
  out_rows.clear();
  for (const Segment& s : segs) {
    if (all_logits) {
      for (int64_t i = 0; i < s.n; ++i) out_rows.push_back(s.row0 + i);
    } else {
      out_rows.push_back(s.row0 + s.n - 1);
    }
  }
  const int64_t nout = static_cast<int64_t>(out_rows.size());
  std::vector<float>& hf = scratch.hf;
  hf.resize(nout * d);
  for (int64_t i = 0; i < nout; ++i) {
    RmsNorm(&x[out_rows[i] * d], final_norm_.data(), static_cast<float>(c.rms_norm_eps), 1, d,
            &hf[i * d]);
  }
  logits->resize(nout * c.vocab_size);
  head().Product(nout, hf.data(), d, logits->data(), c.vocab_size, false, scratch.product);
  for (Segment& s : segs) kv_->SetLength(*s.seq, s.start + s.n);
  return Status::Ok();
}

void CpuEngine::RunLayer(int l, std::span<Segment> segs, RowPositions rp, int64_t rows, float* x,
                         Scratch& scratch, std::vector<float>* deviation,
                         const QueryHook* on_queries) {
  const int32_t* pos = rp.slot;
  const ModelConfig& c = config_;
  const int64_t d = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), ff = c.intermediate_size;
  const Layer& L = layers_[l];
  scratch.Fit(c, rows);
  std::vector<float>&h = scratch.h, &q = scratch.q, &k = scratch.k, &v = scratch.v,
  &attn = scratch.attn, &gu = scratch.gu, &act = scratch.act;
  RmsNorm(x, L.attn_norm.data(), static_cast<float>(c.rms_norm_eps), rows, d, h.data());
  ProductScratch& ps = scratch.product;
  L.wq.Product(rows, h.data(), d, q.data(), qd, false, ps);
  L.wk.Product(rows, h.data(), d, k.data(), kvd, false, ps);
  L.wv.Product(rows, h.data(), d, v.data(), kvd, false, ps);
  AddBias(q.data(), rows, qd, L.bq);
  AddBias(k.data(), rows, kvd, L.bk);
  AddBias(v.data(), rows, kvd, L.bv);
  if (on_queries != nullptr && *on_queries) (*on_queries)(l, q.data(), rows, rp.rope);
  ApplyRope(q.data(), rows, c.num_heads, c.head_dim, rp.rope, inv_freq_.data(), rope_);
  ApplyRope(k.data(), rows, c.num_kv_heads, c.head_dim, rp.rope, inv_freq_.data(), rope_);
  if (deviation != nullptr) deviation->assign(rows, 0.0f);
  for (const Segment& s : segs) {
    for (int64_t i = 0; i < s.n; ++i) {
      const int64_t r = s.row0 + i;
      float* kc = kv_->KeyAt(*s.seq, l, pos[r]);
      float* vc = kv_->ValueAt(*s.seq, l, pos[r]);
      if (deviation != nullptr) {
        double dev = 0.0;
        for (int64_t j = 0; j < kvd; ++j) {
          const double dk = k[r * kvd + j] - kc[j], dv = v[r * kvd + j] - vc[j];
          dev += dk * dk + dv * dv;
        }
        (*deviation)[r] = static_cast<float>(dev);
      }
      std::memcpy(kc, &k[r * kvd], kvd * sizeof(float));
      std::memcpy(vc, &v[r * kvd], kvd * sizeof(float));
      // Computed here, the slot holds KV in every head (a row pass's row
      // over a blend's per-head segment).
      s.seq->FillHoles(l, pos[r]);
    }
  }
  AttendAll(l, segs, pos, q.data(), attn.data(), scratch);
  L.wo.Product(rows, attn.data(), qd, x, d, true, ps);
  AddBias(x, rows, d, L.bo);

  RmsNorm(x, L.ffn_norm.data(), static_cast<float>(c.rms_norm_eps), rows, d, h.data());
  L.w_gate_up.Product(rows, h.data(), d, gu.data(), 2 * ff, false, ps);
  SiluMul(gu.data(), rows, static_cast<int>(ff), act.data());
  L.w_down.Product(rows, act.data(), ff, x, d, true, ps);
}

void CpuEngine::AttendAll(int layer, std::span<const Segment> segs, const int32_t* pos,
                          const float* q, float* out, Scratch& scratch) {
  // Row by row, in parallel, a prefill's rows as a decode step's: each
  // (row, KV head) is one AttendPagedGroup over the paged KV, so a row's
  // attention does not depend on the rows computed beside it (batch
  // invariance, weight_matrix.h; docs/engine.md). Two rows of a segment
  // with the same first visible key go to AttendPagedPair together where
  // the CPU has it: the keys and values read once for both, each row's
  // result the same bits as alone.
  const ModelConfig& c = config_;
  const int64_t qd = c.q_dim();
  const int64_t window = c.LayerWindow(layer);
  auto& items = scratch.short_rows;
  items.clear();
  for (const Segment& s : segs) {
    for (int64_t i = 0; i < s.n; ++i) {
      const bool pair = i + 1 < s.n && FirstVisibleKey(pos[s.row0 + i], window) ==
                                           FirstVisibleKey(pos[s.row0 + i + 1], window);
      items.push_back({&s, i, pair});
      if (pair) ++i;
    }
  }
  if (items.empty()) return;
  const int group = c.num_heads / c.num_kv_heads;
  const int hd = c.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t kvs = kv_->token_stride();
  // One work item per (rows, KV head): its group of query heads together.
  const int64_t work = static_cast<int64_t>(items.size()) * c.num_kv_heads;
  if (scratch.threads.size() < static_cast<size_t>(omp_get_max_threads())) {
    scratch.threads.resize(omp_get_max_threads());
  }
  // Every thread's buffers hold the longest rows before the work is dealt
  // (any thread may take any row), with room to grow: a decode step's
  // context grows a token a step, and a step allocates nothing once warm.
  int64_t span = 0, blocks = 0;
  for (const Segment& s : segs) {
    for (int64_t i = 0; i < s.n; ++i) {
      const int64_t p = pos[s.row0 + i];
      span = std::max(span, p + 1 - FirstVisibleKey(p, window));
      blocks = std::max(blocks, (p + kKvBlockTokens) / kKvBlockTokens);
    }
  }
  const auto room = [](auto& v, int64_t n) {
    if (v.capacity() < static_cast<size_t>(n)) v.reserve(static_cast<size_t>(2 * n));
  };
  for (Scratch::Thread& t : scratch.threads) {
    room(t.scores, 2 * group * span);
    room(t.kb, blocks);
    room(t.vb, blocks);
  }
#pragma omp parallel
  {
    Scratch::Thread& t = scratch.threads[omp_get_thread_num()];
    std::vector<float>& scores = t.scores;
    std::vector<const float*>&kb = t.kb, &vb = t.vb;
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < work; ++w) {
      const Scratch::AttendRows& item = items[w / c.num_kv_heads];
      const Segment* s = item.s;
      const int g = static_cast<int>(w % c.num_kv_heads);
      const int64_t row = s->row0 + item.i, rows = item.pair ? 2 : 1;
      // Causal: row r sees positions 0..pos (one row: both entries its own).
      const int64_t ctx[2] = {pos[row] + 1, pos[row + rows - 1] + 1};
      const int64_t lo = FirstVisibleKey(pos[row], window);
      // This KV head's keys and values, block by block.
      const std::vector<int32_t>& blocks = s->seq->blocks();
      const int64_t nb = (std::max(ctx[0], ctx[1]) + kKvBlockTokens - 1) / kKvBlockTokens;
      kb.resize(nb);
      vb.resize(nb);
      for (int64_t b = lo / kKvBlockTokens; b < nb; ++b) {
        kb[b] = kv_->Key(layer, blocks[b]) + g * hd;
        vb[b] = kv_->Value(layer, blocks[b]) + g * hd;
      }
      scores.resize(group * (ctx[0] + ctx[1] - 2 * lo));
      const int64_t at = row * qd + static_cast<int64_t>(g) * group * hd;
      const std::span<const uint8_t> holes = s->seq->Holes(layer, g);
      ScoreBias bias;
      if (const KvSequence::AttentionBias* ab = s->seq->attention_bias()) {
        // A group whose heads have no bias at this layer keeps the fast
        // kernels (and their bits).
        const float* per_head =
            ab->bias.data() + static_cast<int64_t>(layer) * ab->heads + g * group;
        if (std::any_of(per_head, per_head + group, [](float b) { return b != 0.0f; })) {
          bias.per_head = per_head;
          bias.spans = ab->spans;
        }
      }
      if (rows == 2 && holes.empty() && bias.per_head == nullptr &&
          AttendPagedPair(q + at, q + at + qd, group, kb.data(), vb.data(), kvs, lo, ctx[0], ctx[1],
                          hd, scale, scores.data(), out + at, out + at + qd)) {
        continue;
      }
      for (int64_t r = 0; r < rows; ++r) {
        AttendPagedGroup(q + at + r * qd, group, kb.data(), vb.data(), kvs, lo, ctx[r], hd, scale,
                         scores.data(), out + at + r * qd, holes.data(),
                         static_cast<int64_t>(holes.size()), bias);
      }
    }
  }
}

class CpuEngine::CpuRowPass final : public RowPass {
 public:
  CpuRowPass(CpuEngine& engine, KvSequence& seq, std::span<const int32_t> tokens,
             std::span<const int64_t> positions, std::span<const int64_t> slot_positions)
      : engine_(engine),
        seq_(seq),
        positions_(positions.begin(), positions.end()),
        scratch_(std::make_unique<Scratch>()) {
    for (int64_t p : positions) rope_.push_back(slot_positions.empty() ? p : slot_positions[p]);
    const int64_t d = engine_.config_.hidden_size;
    x_.resize(positions.size() * d);
    for (size_t i = 0; i < positions.size(); ++i) {
      engine_.embed_.RowToFloat(tokens[positions[i]], &x_[i * d]);
    }
  }

  Status RunLayer(std::vector<float>* deviation) override {
    if (next_layer_ >= engine_.config_.num_layers) {
      return FailedPrecondition("row pass: every layer has run");
    }
    const auto rows = static_cast<int64_t>(positions_.size());
    std::vector<int32_t> pos(positions_.begin(), positions_.end()),
        rope(rope_.begin(), rope_.end());
    Segment seg{&seq_, nullptr, rows, 0, 0};
    engine_.RunLayer(next_layer_, std::span<Segment>(&seg, 1), {pos.data(), rope.data()}, rows,
                     x_.data(), *scratch_, deviation, nullptr);
    ++next_layer_;
    return Status::Ok();
  }

  Status Keep(std::span<const int64_t> rows) override {
    KDN_RETURN_IF_ERROR(CheckKeep(rows, positions_.size()));
    const int64_t d = engine_.config_.hidden_size;
    std::vector<int64_t> pos, rope;
    std::vector<float> x;
    for (int64_t r : rows) {
      pos.push_back(positions_[r]);
      rope.push_back(rope_[r]);
      x.insert(x.end(), x_.begin() + r * d, x_.begin() + (r + 1) * d);
    }
    positions_ = std::move(pos);
    rope_ = std::move(rope);
    x_ = std::move(x);
    return Status::Ok();
  }

  const std::vector<int64_t>& positions() const override { return positions_; }
  int next_layer() const override { return next_layer_; }

  Status Logits(std::vector<float>* logits) override {
    const ModelConfig& c = engine_.config_;
    if (next_layer_ != c.num_layers) return FailedPrecondition("row pass: layers left to run");
    const int64_t d = c.hidden_size;
    std::vector<float> hf(d);
    RmsNorm(&x_[(positions_.size() - 1) * d], engine_.final_norm_.data(),
            static_cast<float>(c.rms_norm_eps), 1, d, hf.data());
    logits->resize(c.vocab_size);
    engine_.head().Product(1, hf.data(), d, logits->data(), c.vocab_size, false, scratch_->product);
    return Status::Ok();
  }

 private:
  CpuEngine& engine_;
  KvSequence& seq_;
  std::vector<int64_t> positions_;  // the rows' slots
  std::vector<int64_t> rope_;       // and their positions
  std::vector<float> x_;            // [row][hidden]
  std::unique_ptr<Scratch> scratch_;
  int next_layer_ = 0;
};

Result<std::unique_ptr<RowPass>> CpuEngine::BeginRowPass(KvSequence& seq,
                                                         std::span<const int32_t> tokens,
                                                         std::span<const int64_t> positions,
                                                         std::span<const int64_t> slot_positions) {
  KDN_RETURN_IF_ERROR(CheckRowPass(config_, seq, tokens, positions, slot_positions));
  if (static_cast<int64_t>(positions.size()) > max_prefill_tokens()) {
    return InvalidArgument("row pass: " + std::to_string(positions.size()) + " rows; at most " +
                           std::to_string(max_prefill_tokens()) +
                           " (EngineOptions::max_prefill_tokens)");
  }
  return std::unique_ptr<RowPass>(new CpuRowPass(*this, seq, tokens, positions, slot_positions));
}

Status CpuEngine::RotateCachedKeys(KvSequence& seq, int64_t first, int64_t count, int64_t delta,
                                   int layer) {
  KDN_RETURN_IF_ERROR(CheckRotation(config_, seq, first, count, delta, layer));
  if (delta == 0 || count == 0) return Status::Ok();
  // Every token turns by the same angle: the cosines and sines once, then a
  // plain loop (no OpenMP: this runs beside the compute threads on blend's
  // loader thread, and is light memory work).
  const int half = config_.head_dim / 2;
  std::vector<float> cs(half), sn(half);
  for (int i = 0; i < half; ++i) {
    const double a = static_cast<double>(delta) * inv_freq_[i];  // as ApplyRope, in double
    cs[i] = static_cast<float>(std::cos(a));
    sn[i] = static_cast<float>(std::sin(a));
  }
  const int l0 = layer < 0 ? 0 : layer;
  const int l1 = layer < 0 ? config_.num_layers : layer + 1;
  for (int l = l0; l < l1; ++l) {
    // Tokens of one block are contiguous: rotate them in runs.
    for (int64_t t = first; t < first + count;) {
      const int64_t run = std::min<int64_t>(kKvBlockTokens - t % kKvBlockTokens, first + count - t);
      RotateByAngles(kv_->KeyAt(seq, l, t), run * config_.num_kv_heads, config_.head_dim, cs.data(),
                     sn.data());
      t += run;
    }
  }
  return Status::Ok();
}

}  // namespace kdn::engine
