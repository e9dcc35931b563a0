// QuestionAttention (kdn/blend/blend.h): the question prefilled over the
// cached documents' KV as it is, in a sequence of its own, and the weights
// its queries pay each cached slot.

#include <algorithm>
#include <string>
#include <vector>

#include "kdn/blend/blend.h"
#include "kdn/engine/cpu_ops.h"

namespace kdn::blend {

Result<std::vector<float>> QuestionAttention(engine::Engine& model,
                                             std::span<const PlacedSegment> segments, int64_t slots,
                                             std::span<const int32_t> question,
                                             int64_t question_position) {
  const model::ModelConfig& c = model.config();
  engine::KvCache& cache = model.kv_cache();
  if (question.empty()) return InvalidArgument("blend: the question is empty");
  // The cached slots, one after another: where each segment's go in the
  // pass's sequence, and back in the prompt.
  std::vector<int64_t> prompt_slot;
  std::vector<PlacedSegment> placed;
  for (const PlacedSegment& s : segments) {
    PlacedSegment p = s;
    p.at = static_cast<int64_t>(prompt_slot.size());
    for (int64_t i = 0; i < s.len; ++i) prompt_slot.push_back(s.at + i);
    placed.push_back(p);
  }
  const auto held = static_cast<int64_t>(prompt_slot.size());
  std::vector<float> out(static_cast<size_t>(slots), 0.0f);
  if (held == 0) return out;

  engine::KvSequence seq = cache.NewSequence();
  KDN_RETURN_IF_ERROR(cache.Reserve(seq, held));
  cache.SetLength(seq, held);
  for (int l = 0; l < c.num_layers; ++l) {
    for (const PlacedSegment& p : placed) {
      KDN_RETURN_IF_ERROR(kvbridge::ChunkLayerToPagedKv(*p.kv, l, cache, seq, p.at));
      KDN_RETURN_IF_ERROR(model.RotateCachedKeys(seq, p.at, p.len, p.delta, l));
    }
  }
  KDN_RETURN_IF_ERROR(seq.SetNextPosition(question_position));
  // The question's queries, before RoPE: [layer][row][q_dim].
  const int64_t qd = c.q_dim(), kvd = c.kv_dim();
  std::vector<std::vector<float>> queries(static_cast<size_t>(c.num_layers));
  std::vector<int32_t> positions;
  engine::PrefillOptions po;
  po.on_queries = [&](int layer, const float* q, int64_t rows, const int32_t* pos) {
    auto& dst = queries[static_cast<size_t>(layer)];
    dst.insert(dst.end(), q, q + rows * qd);
    if (layer == 0) positions.insert(positions.end(), pos, pos + rows);
  };
  std::vector<float> logits;
  KDN_RETURN_IF_ERROR(engine::PrefillInPieces(model, seq, question, po, &logits));

  const int hd = c.head_dim, H = c.num_heads, G = c.num_kv_heads, group = H / G;
  const auto rows = static_cast<int64_t>(question.size()), keys = held + rows;
  const std::vector<float> inv_freq = engine::RopeInvFreq(c);
  const engine::RopeParams rope = engine::RopeParamsFor(c);
  std::vector<float> layer_kv(static_cast<size_t>(2 * keys * kvd)), k(keys * hd), w(rows * keys);
  for (int l = 0; l < c.num_layers; ++l) {
    KDN_RETURN_IF_ERROR(
        cache.Read(seq, l, 0, keys, DType::kF32,
                   {reinterpret_cast<uint8_t*>(layer_kv.data()), layer_kv.size() * sizeof(float)}));
    std::vector<float>& q = queries[static_cast<size_t>(l)];
    engine::ApplyRope(q.data(), rows, H, hd, positions.data(), inv_freq.data(), rope);
    for (int g = 0; g < G; ++g) {
      for (int64_t j = 0; j < keys; ++j) {
        std::copy_n(&layer_kv[j * kvd + int64_t{g} * hd], hd, &k[j * hd]);
      }
      for (int h = g * group; h < (g + 1) * group; ++h) {
        engine::AttentionWeights(&q[int64_t{h} * hd], qd, rows, k.data(), keys, hd, held, w.data());
        for (int64_t r = 0; r < rows; ++r) {
          const float* wr = &w[r * keys];
          for (int64_t j = 0; j < held; ++j) out[static_cast<size_t>(prompt_slot[j])] += wr[j];
        }
      }
    }
  }
  return out;  // `seq` gives its blocks back as it goes
}

}  // namespace kdn::blend
