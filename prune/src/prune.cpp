#include "kdn/prune/prune.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kdn::prune {

double KeptTokens::stored_tokens() const {
  if (counts.empty()) return static_cast<double>(kept);
  double sum = 0.0;
  for (int32_t n : counts) sum += n;
  return sum / static_cast<double>(counts.size());
}

int64_t KeptCount(int64_t tokens, double keep, int sinks) {
  const auto n = static_cast<int64_t>(std::floor(static_cast<double>(tokens) * keep));
  return std::min(tokens, std::max<int64_t>(n, sinks + 1));
}

namespace {

// Adds one (layer, head)'s non-sink scores into `sum`, shifted to start at
// 0 and scaled to sum 1, so that every layer and head weighs alike.
void AddNormalized(const Scores& s, int l, int h, int sinks, std::vector<double>* sum) {
  double lo = INFINITY, total = 0.0;
  for (int64_t t = sinks; t < s.tokens; ++t) lo = std::min(lo, double{s.at(l, h, t)});
  for (int64_t t = sinks; t < s.tokens; ++t) total += s.at(l, h, t) - lo;
  for (int64_t t = sinks; t < s.tokens; ++t) {
    (*sum)[t] += total > 0 ? (s.at(l, h, t) - lo) / total : 0.0;
  }
}

// The sinks, then the best `kept - sinks` others by `score`, ascending.
void Pick(const std::vector<double>& score, int64_t kept, int sinks, int32_t* out) {
  const auto tokens = static_cast<int64_t>(score.size());
  std::vector<int32_t> order(tokens - sinks);
  std::iota(order.begin(), order.end(), sinks);
  const int64_t rest = kept - sinks;
  // Ties go to the earlier token, so a choice never depends on the sort.
  std::partial_sort(order.begin(), order.begin() + rest, order.end(), [&](int32_t a, int32_t b) {
    return score[a] != score[b] ? score[a] > score[b] : a < b;
  });
  std::vector<int32_t> pick(order.begin(), order.begin() + rest);
  for (int32_t t = 0; t < sinks; ++t) pick.push_back(t);
  std::sort(pick.begin(), pick.end());
  std::copy(pick.begin(), pick.end(), out);
}

// kGlobal: each head's sinks, then the best of every (layer, head, token)
// past them until `per_head` tokens a head on average are kept.
KeptTokens SelectGlobal(const Scores& s, int64_t per_head, int sinks) {
  const int64_t heads = int64_t{s.layers} * s.kv_heads, rest = s.tokens - sinks;
  std::vector<int64_t> order(heads * rest);  // (head, token - sinks) flattened
  std::iota(order.begin(), order.end(), 0);
  auto score = [&](int64_t i) { return s.v[(i / rest) * s.tokens + sinks + i % rest]; };
  const int64_t take = heads * (per_head - sinks);
  std::partial_sort(order.begin(), order.begin() + take, order.end(), [&](int64_t a, int64_t b) {
    const float x = score(a), y = score(b);
    return x != y ? x > y : a < b;
  });
  std::vector<std::vector<int32_t>> picked(heads);
  for (int64_t i = 0; i < take; ++i) {
    picked[order[i] / rest].push_back(static_cast<int32_t>(sinks + order[i] % rest));
  }
  KeptTokens k{s.layers, s.kv_heads, s.tokens, 0, Granularity::kGlobal, {}, {}};
  for (auto& p : picked) {
    for (int32_t t = 0; t < sinks; ++t) p.push_back(t);
    std::sort(p.begin(), p.end());
    k.kept = std::max<int64_t>(k.kept, static_cast<int64_t>(p.size()));
    k.counts.push_back(static_cast<int32_t>(p.size()));
  }
  k.index.assign(heads * k.kept, -1);
  for (int64_t i = 0; i < heads; ++i)
    std::copy(picked[i].begin(), picked[i].end(), &k.index[i * k.kept]);
  return k;
}

}  // namespace

Status CheckSelection(const Scores& s, double keep, int sinks) {
  if (!(keep > 0.0 && keep <= 1.0)) {
    return InvalidArgument("prune: keep ratio " + std::to_string(keep) + " outside (0, 1]");
  }
  if (sinks < 0 || s.tokens <= sinks) {
    return InvalidArgument("prune: " + std::to_string(s.tokens) + " tokens, " +
                           std::to_string(sinks) + " of them sinks: nothing to choose from");
  }
  return Status::Ok();
}

Result<KeptTokens> SelectKept(const Scores& s, double keep, int sinks, Granularity granularity) {
  KDN_RETURN_IF_ERROR(CheckSelection(s, keep, sinks));
  if (granularity == Granularity::kGlobal) {
    return SelectGlobal(s, KeptCount(s.tokens, keep, sinks), sinks);
  }
  KeptTokens k{s.layers,    s.kv_heads, s.tokens, KeptCount(s.tokens, keep, sinks),
               granularity, {},         {}};
  k.index.resize(size_t(s.layers) * s.kv_heads * k.kept);
  auto fill = [&](int l, int h, const int32_t* picked) {
    std::copy(picked, picked + k.kept, &k.index[(int64_t{l} * s.kv_heads + h) * k.kept]);
  };
  std::vector<double> score(s.tokens);
  std::vector<int32_t> picked(k.kept);
  if (granularity == Granularity::kToken) {
    for (int l = 0; l < s.layers; ++l) {
      for (int h = 0; h < s.kv_heads; ++h) AddNormalized(s, l, h, sinks, &score);
    }
    Pick(score, k.kept, sinks, picked.data());
  }
  for (int l = 0; l < s.layers; ++l) {
    if (granularity == Granularity::kLayer) {
      std::fill(score.begin(), score.end(), 0.0);
      for (int h = 0; h < s.kv_heads; ++h) AddNormalized(s, l, h, sinks, &score);
      Pick(score, k.kept, sinks, picked.data());
    }
    for (int h = 0; h < s.kv_heads; ++h) {
      if (granularity == Granularity::kHead) {
        for (int64_t t = 0; t < s.tokens; ++t) score[t] = s.at(l, h, t);
        Pick(score, k.kept, sinks, picked.data());
      }
      fill(l, h, picked.data());
    }
  }
  return k;
}

Result<KeptTokens> Rerank(const KeptTokens& kept, const Scores& ranking, int sinks) {
  const int heads = kept.layers * kept.kv_heads;
  if (ranking.layers != kept.layers || ranking.kv_heads != kept.kv_heads ||
      ranking.tokens != kept.logical || sinks < 0 || sinks >= ranking.tokens) {
    return InvalidArgument("prune: a ranking of " + std::to_string(ranking.tokens) +
                           " tokens for kept tokens of a text of " + std::to_string(kept.logical));
  }
  KeptTokens out = kept;
  std::vector<double> score(ranking.tokens);
  for (int h = 0; h < heads; ++h) {
    const int64_t count = kept.count(h / kept.kv_heads, h % kept.kv_heads);
    if (count < sinks) return InvalidArgument("prune: a head keeps fewer tokens than its sinks");
    std::copy_n(&ranking.v[size_t(h) * ranking.tokens], ranking.tokens, score.begin());
    Pick(score, count, sinks, &out.index[size_t(h) * kept.kept]);
  }
  return out;
}

Result<Scores> MeanRanks(const Scores& a, const Scores& b) {
  if (a.layers != b.layers || a.kv_heads != b.kv_heads || a.tokens != b.tokens) {
    return InvalidArgument("prune: the mean ranks of scores of different shapes");
  }
  Scores out{a.layers, a.kv_heads, a.tokens, std::vector<float>(a.v.size(), 0.0f)};
  std::vector<int32_t> order(a.tokens);
  for (int h = 0; h < a.layers * a.kv_heads; ++h) {
    float* sum = &out.v[size_t(h) * a.tokens];
    for (const Scores* s : {&a, &b}) {
      const float* v = &s->v[size_t(h) * a.tokens];
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t x, int32_t y) { return v[x] > v[y]; });
      // Minus the rank, so that higher is kept first; halved, the mean.
      for (int64_t r = 0; r < a.tokens; ++r) sum[order[r]] -= 0.5f * static_cast<float>(r);
    }
  }
  return out;
}

Result<Scores> KeyNormScores(const engine::KvCache& kv, const engine::KvSequence& seq,
                             int64_t tokens) {
  if (tokens <= 0 || tokens > seq.length()) {
    return InvalidArgument("key norm: " + std::to_string(tokens) + " tokens of a sequence of " +
                           std::to_string(seq.length()));
  }
  const int G = kv.num_kv_heads(), hd = kv.head_dim();
  const int64_t kvd = kv.token_stride();
  Scores out{kv.num_layers(), G, tokens, std::vector<float>(size_t(kv.num_layers()) * G * tokens)};
  std::vector<float> layer(2 * tokens * kvd);
  for (int l = 0; l < kv.num_layers(); ++l) {
    KDN_RETURN_IF_ERROR(
        kv.Read(seq, l, 0, tokens, engine::DType::kF32,
                {reinterpret_cast<uint8_t*>(layer.data()), layer.size() * sizeof(float)}));
    for (int g = 0; g < G; ++g) {
      for (int64_t t = 0; t < tokens; ++t) {
        const float* k = &layer[t * kvd + int64_t{g} * hd];
        double n = 0.0;
        for (int i = 0; i < hd; ++i) n += double{k[i]} * k[i];
        out.at(l, g, t) = -static_cast<float>(std::sqrt(n));
      }
    }
  }
  return out;
}

Status CompactKv(engine::KvCache& kv, const engine::KvSequence& src, const KeptTokens& k,
                 engine::KvSequence* dst) {
  if (dst->length() != 0 || !dst->blocks().empty()) {
    return InvalidArgument("prune: compacting into a sequence that holds KV");
  }
  if (src.has_holes()) return InvalidArgument("prune: compacting KV that is already pruned");
  if (k.layers != kv.num_layers() || k.kv_heads != kv.num_kv_heads() || k.logical > src.length() ||
      k.kept <= 0 || k.kept > k.logical ||
      k.index.size() != size_t(k.layers) * k.kv_heads * k.kept ||
      !(k.counts.empty() || k.counts.size() == size_t(k.layers) * k.kv_heads)) {
    return InvalidArgument("prune: kept tokens of " + std::to_string(k.logical) +
                           " do not fit a sequence of " + std::to_string(src.length()));
  }
  for (int l = 0; l < k.layers; ++l) {
    for (int g = 0; g < k.kv_heads; ++g) {
      const int64_t n = k.count(l, g);
      if (n < 0 || n > k.kept) return InvalidArgument("prune: a head's count out of range");
      for (int64_t j = 0; j < n; ++j) {
        const int32_t t = k.of(l, g)[j];
        if (t < 0 || t >= k.logical) return InvalidArgument("prune: a kept token out of range");
      }
    }
  }
  KDN_RETURN_IF_ERROR(kv.Reserve(*dst, k.kept));
  const int G = k.kv_heads, hd = kv.head_dim();
  const int64_t kvd = kv.token_stride();
  std::vector<float> in(2 * k.logical * kvd), out(2 * k.kept * kvd);
  for (int l = 0; l < k.layers; ++l) {
    Status st = kv.Read(src, l, 0, k.logical, engine::DType::kF32,
                        {reinterpret_cast<uint8_t*>(in.data()), in.size() * sizeof(float)});
    if (st.ok()) {
      for (int g = 0; g < G; ++g) {
        const int32_t* idx = k.of(l, g);
        const int64_t n = k.count(l, g);
        for (int64_t j = n; j < k.kept; ++j) {  // holes: zeros, never read
          std::fill_n(&out[j * kvd + int64_t{g} * hd], hd, 0.0f);
          std::fill_n(&out[k.kept * kvd + j * kvd + int64_t{g} * hd], hd, 0.0f);
        }
        for (int64_t j = 0; j < n; ++j) {
          const int64_t from = int64_t{idx[j]} * kvd + int64_t{g} * hd,
                        to = j * kvd + int64_t{g} * hd;
          std::copy_n(&in[from], hd, &out[to]);
          std::copy_n(&in[k.logical * kvd + from], hd, &out[k.kept * kvd + to]);
        }
      }
      st = kv.Write(*dst, l, 0, k.kept, engine::DType::kF32,
                    {reinterpret_cast<const uint8_t*>(out.data()), out.size() * sizeof(float)});
    }
    if (!st.ok()) {
      dst->Reset();
      return st;
    }
  }
  kv.SetLength(*dst, k.kept);
  // SetHeadTokens leaves no holes where every head kept every slot.
  Status st = k.counts.empty() ? Status::Ok() : dst->SetHeadTokens(k.kept, k.counts);
  if (st.ok()) st = dst->SetNextPosition(src.position_shift() + k.logical);
  if (!st.ok()) dst->Reset();
  return st;
}

}  // namespace kdn::prune
