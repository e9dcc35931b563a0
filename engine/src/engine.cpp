#include "kdn/engine/engine.h"

#include <algorithm>
#include <string>
#include <vector>

namespace kdn::engine {

Status CheckRowPass(const model::ModelConfig& config, const KvSequence& seq,
                    std::span<const int32_t> tokens, std::span<const int64_t> positions,
                    std::span<const int64_t> slot_positions) {
  KDN_RETURN_IF_ERROR(CheckAttentionBias(config, seq));
  if (static_cast<int64_t>(tokens.size()) != seq.length()) {
    return InvalidArgument("row pass: " + std::to_string(tokens.size()) +
                           " tokens for a sequence of " + std::to_string(seq.length()));
  }
  if (positions.empty()) return InvalidArgument("row pass: no positions");
  if (!slot_positions.empty()) {
    if (slot_positions.size() != tokens.size()) {
      return InvalidArgument("row pass: " + std::to_string(slot_positions.size()) +
                             " slot positions for " + std::to_string(tokens.size()) + " slots");
    }
    for (size_t i = 0; i < slot_positions.size(); ++i) {
      if (slot_positions[i] < 0 || slot_positions[i] >= config.max_context ||
          (i > 0 && slot_positions[i] <= slot_positions[i - 1])) {
        return InvalidArgument("row pass: slot positions must ascend inside the context");
      }
    }
  } else if (seq.position_shift() != 0) {
    // Its slots are not its positions: a row's position is not known here.
    return InvalidArgument("row pass: a sequence of pruned KV needs its slots' positions");
  }
  for (size_t i = 0; i < positions.size(); ++i) {
    if (positions[i] < 0 || positions[i] >= seq.length() ||
        (i > 0 && positions[i] <= positions[i - 1])) {
      return InvalidArgument("row pass: positions must be ascending, distinct and below " +
                             std::to_string(seq.length()));
    }
  }
  for (int32_t t : tokens) {
    if (t < 0 || t >= config.vocab_size) {
      return InvalidArgument("token id " + std::to_string(t) + " is outside the vocabulary");
    }
  }
  return Status::Ok();
}

void QueryStats::Add(const model::ModelConfig& c, int layer, const float* q, int64_t rows,
                     const int32_t* positions) {
  const int64_t hd = c.head_dim, per_layer = int64_t{c.num_heads} * hd;
  if (sum.empty()) {
    sum.assign(static_cast<size_t>(c.num_layers * per_layer), 0.0);
    outer.assign(static_cast<size_t>(c.num_layers * per_layer * hd), 0.0);
  }
  int64_t r0 = 0;
  while (r0 < rows && positions[r0] < skip) ++r0;
  if (r0 == rows) return;
  if (layer == 0) count += rows - r0;
  const int64_t qd = c.q_dim();
#pragma omp parallel for schedule(static)
  for (int h = 0; h < c.num_heads; ++h) {
    double* s = &sum[static_cast<size_t>(layer * per_layer + h * hd)];
    double* o = &outer[static_cast<size_t>((layer * per_layer + h * hd) * hd)];
    for (int64_t r = r0; r < rows; ++r) {
      const float* v = q + r * qd + h * hd;
      for (int64_t i = 0; i < hd; ++i) {
        s[i] += v[i];
        const double vi = v[i];
        for (int64_t j = 0; j < hd; ++j) o[i * hd + j] += vi * v[j];
      }
    }
  }
}

QueryHook QueryStats::Hook(const model::ModelConfig& config) {
  return [this, config](int layer, const float* q, int64_t rows, const int32_t* positions) {
    Add(config, layer, q, rows, positions);
  };
}

Status CheckKeep(std::span<const int64_t> rows, size_t current) {
  if (rows.empty()) return InvalidArgument("row pass: keeps no row");
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || rows[i] >= static_cast<int64_t>(current) ||
        (i > 0 && rows[i] <= rows[i - 1])) {
      return InvalidArgument("row pass: rows to keep must be ascending indices of current rows");
    }
  }
  return Status::Ok();
}

Status CheckRotation(const model::ModelConfig& config, const KvSequence& seq, int64_t first,
                     int64_t count, int64_t delta, int layer) {
  if (first < 0 || count < 0 || first + count > seq.length()) {
    return InvalidArgument("rotate: positions [" + std::to_string(first) + ", " +
                           std::to_string(first + count) + ") are not all in a sequence of " +
                           std::to_string(seq.length()));
  }
  if (layer < -1 || layer >= config.num_layers) {
    return InvalidArgument("rotate: no layer " + std::to_string(layer));
  }
  // Under dynamic RoPE a key's frequencies depend on its position once past
  // the threshold, so moving it is no single rotation.
  const int64_t threshold = config.rope_scaling.dynamic_threshold;
  if (config.rope_scaling.type == model::RopeType::kDynamic && delta != 0 &&
      std::max(first + count, first + count + delta) > threshold) {
    return Unimplemented("rotate: cached keys cannot move past position " +
                         std::to_string(threshold) +
                         " under dynamic RoPE (their frequencies change with the position)");
  }
  return Status::Ok();
}

Status PrefillInPieces(Engine& model, KvSequence& seq, std::span<const int32_t> tokens,
                       const PrefillOptions& options, std::vector<float>* logits) {
  const auto piece = static_cast<size_t>(model.max_prefill_tokens());
  for (size_t at = 0; at < tokens.size(); at += piece) {
    KDN_RETURN_IF_ERROR(model.Prefill(seq, tokens.subspan(at, std::min(piece, tokens.size() - at)),
                                      options, logits));
  }
  return Status::Ok();
}

Status CheckDecodeBatch(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                        size_t samplers) {
  if (seqs.size() != tokens.size() || seqs.size() != samplers) {
    return InvalidArgument("decode: " + std::to_string(seqs.size()) + " sequences but " +
                           std::to_string(tokens.size()) + " tokens and " +
                           std::to_string(samplers) + " samplers");
  }
  if (seqs.empty()) return InvalidArgument("decode: empty batch");
  for (size_t b = 0; b < seqs.size(); ++b) {
    for (size_t c = 0; c < b; ++c) {
      if (seqs[c] == seqs[b]) return InvalidArgument("decode: a sequence appears twice in a batch");
    }
  }
  return Status::Ok();
}

Status Engine::DecodeSampleWith(std::span<KvSequence* const> seqs, std::span<const int32_t> tokens,
                                std::span<Sampler* const> samplers, std::vector<int32_t>* next,
                                std::span<const Piece> pieces) {
  KDN_RETURN_IF_ERROR(CheckDecodeBatch(seqs, tokens, samplers.size()));
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto twice = [&](const KvSequence* s) { return s == pieces[i].seq; };
    if (std::any_of(seqs.begin(), seqs.end(), twice) ||
        std::any_of(pieces.begin(), pieces.begin() + i,
                    [&](const Piece& p) { return twice(p.seq); })) {
      return InvalidArgument("decode: a sequence appears twice in a step");
    }
  }
  std::vector<int64_t> lengths;
  const auto undo = [&] {
    for (size_t i = 0; i < lengths.size(); ++i) pieces[i].seq->Truncate(lengths[i]);
  };
  std::vector<float> unused;
  for (const Piece& p : pieces) {
    const int64_t length = p.seq->length();
    if (Status st = Prefill(*p.seq, p.tokens, {}, p.logits ? p.logits : &unused); !st.ok()) {
      undo();
      return st;
    }
    lengths.push_back(length);
  }
  if (Status st = DecodeSample(seqs, tokens, samplers, next); !st.ok()) {
    undo();
    return st;
  }
  return Status::Ok();
}

Status RefuseHoles(const KvSequence& seq, const char* what) {
  if (!seq.has_holes()) return Status::Ok();
  return Unimplemented(std::string(what) +
                       ": pruned KV with holes (heads that kept different numbers of tokens) "
                       "on this engine");
}

Status CheckAttentionBias(const model::ModelConfig& config, const KvSequence& seq) {
  const KvSequence::AttentionBias* b = seq.attention_bias();
  if (b == nullptr || b->heads == config.num_heads) return Status::Ok();
  return InvalidArgument("an attention bias for " + std::to_string(b->heads) +
                         " query heads, on a model of " + std::to_string(config.num_heads));
}

BatchBias LayOutBias(std::span<const KvSequence* const> seqs, int layers, int heads) {
  BatchBias out;
  const size_t per_row = static_cast<size_t>(layers) * heads;
  out.head_bias.assign(seqs.size() * per_row, 0.0f);
  out.span_first.push_back(0);
  for (size_t b = 0; b < seqs.size(); ++b) {
    const KvSequence::AttentionBias* a = seqs[b]->attention_bias();
    // CheckAttentionBias has held its heads to the model's.
    if (a != nullptr && a->bias.size() == per_row) {
      out.any = true;
      std::copy(a->bias.begin(), a->bias.end(), out.head_bias.begin() + b * per_row);
      for (const auto& [begin, end] : a->spans) {
        out.spans.push_back(begin);
        out.spans.push_back(end);
      }
    }
    out.span_first.push_back(static_cast<int32_t>(out.spans.size() / 2));
  }
  return out;
}

}  // namespace kdn::engine
