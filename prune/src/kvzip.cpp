#include "kdn/prune/kvzip.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kdn/engine/cpu_ops.h"

namespace kdn::prune {

namespace {

// The queries of a repeat pass, before RoPE: [layer][row][num_heads *
// head_dim], and the rows' RoPE positions.
struct CapturedQueries {
  std::vector<std::vector<float>> by_layer;
  std::vector<int32_t> positions;
};

// Scores part [first, last) of the context from one repeat pass: for layer
// l, the rows' rotated queries against keys `sink` sinks, the part, and the
// pass's own rows (causally); each part token's score is the most any row
// and any query head of its group pays it.
void ScorePart(const model::ModelConfig& c, int l, const float* kv_layer, int64_t context,
               int64_t sink, int64_t first, int64_t last, const CapturedQueries& queries,
               const std::vector<float>& inv_freq, const engine::RopeParams& rope, Scores* out) {
  const int hd = c.head_dim, H = c.num_heads, G = c.num_kv_heads, group = H / G;
  const int64_t qd = c.q_dim(), kvd = c.kv_dim();
  const auto rows = static_cast<int64_t>(queries.positions.size());
  std::vector<float> q = queries.by_layer[l];
  engine::ApplyRope(q.data(), rows, H, hd, queries.positions.data(), inv_freq.data(), rope);
  const int64_t part = last - first, keys = sink + part + rows;
  std::vector<float> k(keys * hd), w(rows * keys);
  for (int g = 0; g < G; ++g) {
    // This KV head's keys, in a row: the sinks, the part, the pass's rows.
    auto put = [&](int64_t j, int64_t slot) {
      std::copy_n(kv_layer + slot * kvd + int64_t{g} * hd, hd, &k[j * hd]);
    };
    for (int64_t j = 0; j < sink; ++j) put(j, j);
    for (int64_t j = 0; j < part; ++j) put(sink + j, first + j);
    for (int64_t j = 0; j < rows; ++j) put(sink + part + j, context + j);
    for (int h = g * group; h < (g + 1) * group; ++h) {
      // Causal over the pass's rows: row r sees its own key, not later ones.
      engine::AttentionWeights(&q[int64_t{h} * hd], qd, rows, k.data(), keys, hd, sink + part,
                               w.data());
      for (int64_t r = 0; r < rows; ++r) {
        const float* wr = &w[r * keys + sink];
        for (int64_t j = 0; j < part; ++j) {
          float& best = out->at(l, g, first + j);
          best = std::max(best, wr[j]);
        }
      }
    }
  }
}

}  // namespace

Result<Scores> KvzipScores(engine::Engine& model, engine::KvSequence& seq,
                           std::span<const int32_t> context, const KvzipPrompts& prompts,
                           const KvzipOptions& o) {
  const model::ModelConfig& c = model.config();
  const auto n = static_cast<int64_t>(context.size());
  if (n == 0 || seq.length() != n || seq.next_position() != n || seq.has_holes()) {
    return InvalidArgument("kvzip: the sequence holds " + std::to_string(seq.length()) +
                           " tokens at next position " + std::to_string(seq.next_position()) +
                           ", not the context's " + std::to_string(n));
  }
  if (prompts.first.empty() || prompts.next.empty() || o.chunk_tokens <= 0 || o.sinks < 0 ||
      o.overlap < 0 || o.layers < 0) {
    return InvalidArgument(
        "kvzip: empty repeat prompts, or a chunk, sink, overlap or layer count out of range");
  }
  const int scored = o.layers > 0 ? std::min(o.layers, c.num_layers) : c.num_layers;
  const std::vector<float> inv_freq = engine::RopeInvFreq(c);
  const engine::RopeParams rope = engine::RopeParamsFor(c);
  engine::KvCache& kv = model.kv_cache();
  Scores out{c.num_layers, c.num_kv_heads, n,
             std::vector<float>(size_t(c.num_layers) * c.num_kv_heads * n, 0.0f)};
  std::vector<float> logits, layer_kv;
  for (int64_t first = 0; first < n; first += o.chunk_tokens) {
    const int64_t last = std::min(n, first + o.chunk_tokens);
    // The pass: prompt (and the previous part's tail), the request's end,
    // the part.
    std::vector<int32_t> rows = first == 0 ? prompts.first : prompts.next;
    if (first > 0) {
      rows.insert(rows.end(), context.begin() + std::max<int64_t>(0, first - o.overlap),
                  context.begin() + first);
    }
    rows.insert(rows.end(), prompts.suffix.begin(), prompts.suffix.end());
    rows.insert(rows.end(), context.begin() + first, context.begin() + last);
    CapturedQueries queries;
    queries.by_layer.resize(scored);
    const int64_t qd = c.q_dim();
    engine::PrefillOptions po;
    po.layers = scored;
    po.on_queries = [&](int layer, const float* q, int64_t r, const int32_t* positions) {
      auto& dst = queries.by_layer[layer];
      dst.insert(dst.end(), q, q + r * qd);
      if (layer == 0) queries.positions.insert(queries.positions.end(), positions, positions + r);
    };
    Status st = engine::PrefillInPieces(model, seq, rows, po, &logits);
    // Each scored layer's KV, the context's and the pass's, before the pass
    // goes.
    const int64_t held = seq.length();
    for (int l = 0; l < scored && st.ok(); ++l) {
      layer_kv.resize(2 * held * c.kv_dim());
      st = kv.Read(seq, l, 0, held, engine::DType::kF32,
                   {reinterpret_cast<uint8_t*>(layer_kv.data()), layer_kv.size() * sizeof(float)});
      if (st.ok()) {
        ScorePart(c, l, layer_kv.data(), n, std::min<int64_t>(o.sinks, first), first, last, queries,
                  inv_freq, rope, &out);
      }
    }
    seq.Truncate(n);
    KDN_RETURN_IF_ERROR(st);
  }
  return out;
}

}  // namespace kdn::prune
