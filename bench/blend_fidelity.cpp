// kdn-bench blend-fidelity: how close CacheBlend's answers come to full
// prefill's on multi-document prompts of real English prose.
//
// The text: every regular file of --text-dir (default
// /usr/share/common-licenses, the licence texts Debian's base-files installs
// on every system; each may be copied verbatim), split into paragraphs,
// consecutive paragraphs of one file joined into documents of at least
// --doc-tokens tokens. Each prompt is a head (computed in full), --docs
// documents drawn from different places of the pool in a fresh order (each
// document's KV computed alone once, at positions 0..n-1, as the KDN holds
// it) and a cue (a question about the passages, or a request to go on),
// in the model's chat format when its tokenizer knows <|im_start|>.
//
// Modes, each against full prefill: full reuse (nothing recomputed), EPIC's
// boundary selection for each --boundary K (each document's first K tokens
// recomputed at every layer, no check), blend by KV deviation at one check
// layer (kdn's choice) at each ratio, the same number of tokens chosen at
// random, progressive filtering over each --check-layers list (CacheBlend's;
// blend::CheckSchedule's default ratios), and boundary+deviation (the
// first --boundary-deviation tokens of each document always, the rest of the
// ratio by deviation) with one check and each schedule, and the question's
// selections (query, query+boundary: the budget by the question's attention,
// its pass counted in the recomputed share). Per mode, over the first --answer-tokens
// positions of the answer, teacher-forced on full prefill's greedy tokens (one pass over them on
// top of the prompt's KV, for the reference and every mode alike): the mean KL(full || mode) of the
// next-token distribution, top-1 agreement with full prefill, the share of prompts whose greedy
// answer equals full prefill's in all those tokens, the mean run of equal greedy tokens, and time
// to first token against full prefill's (the documents' KV already in memory).
//
// With a preset (no tokenizer) the text's bytes are the tokens.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>

#include "bench_util.h"
#include "prose.h"
#include "kdn/blend/blend.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbus/key.h"
#include "kdn/model/gguf.h"
#include "kdn/text/tokenizer.h"

namespace kdn::bench {

namespace {

struct Mode {
  std::string name;
  // full_reuse, deviation, random, progressive, boundary:K, boundary+deviation, query,
  // query+boundary
  std::string kind;
  double ratio = 0;
  std::vector<int> check_layers;  // progressive schedules only
  blend::BlendSelection selection;
  double max_kl = 0;
};

struct Tally {
  double kl = 0;     // summed over positions
  int64_t top1 = 0;  // positions agreeing
  int64_t positions = 0;
  int all_equal = 0;      // prompts whose whole greedy answer agrees
  int64_t equal_run = 0;  // summed leading runs of agreeing greedy tokens
  double seconds = 0;     // summed TTFT
  int64_t recomputed = 0, cached = 0;
  // Per prompt: the residual deviation at the first check and the mean KL.
  std::vector<std::pair<double, double>> residual_kl;
};

std::string JoinLayers(const std::vector<int>& layers) {
  std::string s;
  for (int l : layers) s += (s.empty() ? "" : ",") + std::to_string(l);
  return s;
}

}  // namespace

int RunBlendFidelity(const Common& c, const BlendFidelityOptions& o) {
  std::string what;
  // Room for the longest prompt (documents are at most twice --doc-tokens)
  // and its answer, twice over.
  const int64_t kv_tokens =
      std::max<int64_t>(8192, 2 * (2 * int64_t{o.docs} * o.doc_tokens + 512 + o.answer_tokens));
  auto model_r = MakeModel(c, kv_tokens, &what);
  if (!model_r.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", model_r.status().ToString().c_str());
    return 1;
  }
  engine::Engine& model = **model_r;
  const model::ModelConfig& cfg = model.config();
  std::unique_ptr<text::Tokenizer> tok;
  auto encode_r = ProseEncoder(c.model_dir, cfg.vocab_size, &tok);
  if (!encode_r.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", encode_r.status().ToString().c_str());
    return 1;
  }
  const Encoder encode = *std::move(encode_r);

  // The pool of documents.
  size_t nfiles = 0;
  auto pool_r = ProseDocuments(o.text_dir, o.doc_tokens, encode, &nfiles);
  if (!pool_r.ok()) {
    std::fprintf(stderr, "kdn-bench blend-fidelity: %s\n", pool_r.status().message().c_str());
    return 1;
  }
  const std::vector<ProseDocument>& pool = *pool_r;
  if (static_cast<int>(pool.size()) < o.docs) {
    std::fprintf(stderr, "kdn-bench blend-fidelity: %zu documents under %s, fewer than --docs\n",
                 pool.size(), o.text_dir.c_str());
    return 1;
  }

  const bool chat = tok && encode("<|im_start|>").size() == 1;
  const std::string head_text = chat ? "<|im_start|>user\nRead the following passages.\n\n"
                                     : "Read the following passages.\n\n";
  const std::vector<std::string> cues = {
      "Summarize the passages above in a few sentences.",
      "What do the passages above say about \"%s\"?",
      "Which of the passages above mentions \"%s\", and what does it say?",
      "Continue the last passage above.",
      "List the main points of each passage above.",
  };

  using Kind = blend::BlendSelection::Kind;
  std::vector<Mode> modes{{"full reuse", "full_reuse", 0, {}, {}}};
  for (int k : o.boundary) {
    if (k <= 0) continue;  // --boundary 0: no boundary rows
    const std::string kind = "boundary:" + std::to_string(k);
    modes.push_back({kind, kind, 0, {}, {Kind::kBoundary, k}});
  }
  for (double r : o.ratios) {
    char name[64];
    std::snprintf(name, sizeof(name), "deviation %.2f", r);
    modes.push_back({name, "deviation", r, {}, {}});
    std::snprintf(name, sizeof(name), "random %.2f", r);
    modes.push_back({name, "random", r, {}, {Kind::kRandom, 0}});
    for (const auto& layers : o.check_layers) {
      std::snprintf(name, sizeof(name), "progressive %.2f @%s", r, JoinLayers(layers).c_str());
      modes.push_back({name, "progressive", r, layers, {}});
    }
    if (r == o.ratios.front()) {
      for (double kl : o.max_kl) {
        std::snprintf(name, sizeof(name), "max_kl %.3g from %.2f", kl, r);
        Mode m{
            name, "max_kl", r, o.check_layers.empty() ? std::vector<int>{} : o.check_layers[0], {}};
        m.max_kl = kl;
        modes.push_back(std::move(m));
      }
    }
    if (o.query) {
      const int k = o.boundary_deviation > 0 ? o.boundary_deviation : blend::kDefaultBoundaryTokens;
      std::snprintf(name, sizeof(name), "query %.2f", r);
      modes.push_back({name, "query", r, {}, {Kind::kQuery, 0}});
      std::snprintf(name, sizeof(name), "query+bound:%d %.2f", k, r);
      modes.push_back({name, "query+boundary", r, {}, {Kind::kQueryBoundary, k}});
    }
    if (o.boundary_deviation > 0) {
      const blend::BlendSelection bd{Kind::kBoundaryDeviation, o.boundary_deviation};
      std::snprintf(name, sizeof(name), "bound:%d+dev %.2f", o.boundary_deviation, r);
      modes.push_back({name, "boundary+deviation", r, {}, bd});
      for (const auto& layers : o.check_layers) {
        std::snprintf(name, sizeof(name), "bound:%d+dev %.2f @%s", o.boundary_deviation, r,
                      JoinLayers(layers).c_str());
        modes.push_back({name, "boundary+deviation", r, layers, bd});
      }
    }
  }
  for (const Mode& m : modes) {
    for (int l : m.check_layers) {
      if (l < 0 || l >= cfg.num_layers) {
        std::fprintf(stderr, "kdn-bench blend-fidelity: check layer %d: the model has %d\n", l,
                     cfg.num_layers);
        return 2;
      }
    }
  }
  std::printf(
      "blend-fidelity on %s: %d prompts of %d documents (pool of %zu from %zu files "
      "under %s), %d answer tokens teacher-forced on full prefill's, check layer %d%s\n",
      what.c_str(), o.prompts, o.docs, pool.size(), nfiles, o.text_dir.c_str(), o.answer_tokens,
      o.check_layer, chat ? ", chat format" : "");

  // Each document's KV computed alone, once.
  engine::KvCache& cache = model.kv_cache();
  const kvbus::KeyContext ctx{{0, 42}, "", 256};
  std::map<int, std::shared_ptr<const kvbus::Chunk>> doc_kv;
  auto kv_of = [&](int d) -> Result<std::shared_ptr<const kvbus::Chunk>> {
    if (auto it = doc_kv.find(d); it != doc_kv.end()) return it->second;
    engine::KvSequence seq = cache.NewSequence();
    std::vector<float> logits;
    const auto& t = pool[d].tokens;
    KDN_RETURN_IF_ERROR(model.Prefill(seq, t, {}, &logits));
    KDN_ASSIGN_OR_RETURN(
        auto chunk, kvbridge::ChunkFromPagedKv(cache, seq, 0, static_cast<int64_t>(t.size()),
                                               kvbus::SegmentKey(ctx, t), ctx.model_fingerprint,
                                               model.kv_dtype()));
    std::shared_ptr<const kvbus::Chunk> shared = std::move(chunk);
    doc_kv.emplace(d, shared);
    return shared;
  };

  std::fflush(stdout);
  std::vector<Tally> tallies(modes.size());
  double full_seconds = 0;
  int64_t ref_path_flips = 0;  // reference argmaxes that differ between the two paths
  int64_t prompt_tokens = 0;
  std::mt19937_64 rng(c.seed + 39);
  const auto t_start = Clock::now();
  for (int p = 0; p < o.prompts; ++p) {
    // Documents from different files where there are enough, in a fresh order.
    std::vector<int> picked;
    std::vector<int> order(pool.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::set<int> sources;
    for (int d : order) {
      if (static_cast<int>(picked.size()) == o.docs) break;
      if (sources.insert(pool[d].source).second || sources.size() >= nfiles) {
        picked.push_back(d);
      }
    }
    for (int d : order) {
      if (static_cast<int>(picked.size()) == o.docs) break;
      if (std::find(picked.begin(), picked.end(), d) == picked.end()) picked.push_back(d);
    }
    std::string cue = cues[p % cues.size()];
    if (cue.find("%s") != std::string::npos) {
      const std::string word = KeyWord(pool[picked[rng() % picked.size()]].text);
      cue.replace(cue.find("%s"), 2, word);
    }
    const std::string suffix_text =
        chat ? cue + "<|im_end|>\n<|im_start|>assistant\n" : cue + "\nAnswer:";
    std::vector<int32_t> head = tok ? tok->Encode(head_text, true) : encode(head_text);
    if (head.empty()) head.push_back(cfg.bos_token_id >= 0 ? cfg.bos_token_id : 0);
    const std::vector<int32_t> suffix = encode(suffix_text);
    std::vector<int32_t> prompt = head;
    for (int d : picked) prompt.insert(prompt.end(), pool[d].tokens.begin(), pool[d].tokens.end());
    prompt.insert(prompt.end(), suffix.begin(), suffix.end());
    prompt_tokens += static_cast<int64_t>(prompt.size());

    // Full prefill: the reference answer (greedy, step by step), then its
    // distributions at each answer position, teacher-forced in one pass on
    // top of the prompt's KV as every mode's are.
    std::vector<std::vector<float>> ref_logits;
    std::vector<int32_t> ref_tokens;
    {
      engine::KvSequence seq = cache.NewSequence();
      std::vector<float> logits;
      const auto t0 = Clock::now();
      if (!model.Prefill(seq, prompt, {}, &logits).ok()) return 1;
      full_seconds += Seconds(t0, Clock::now());
      auto greedy = GreedyTokens(model, seq, logits, o.answer_tokens);
      if (!greedy.ok()) return 1;
      ref_tokens = *std::move(greedy);
      seq.Reset();
      if (!model.Prefill(seq, prompt, {}, &logits).ok()) return 1;
      auto forced = TeacherForced(model, seq, std::move(logits), ref_tokens);
      if (!forced.ok()) return 1;
      ref_logits = *std::move(forced);
      for (size_t i = 0; i < ref_tokens.size(); ++i) {
        ref_path_flips += engine::Argmax(ref_logits[i]) != ref_tokens[i];
      }
    }
    std::vector<blend::Segment> segments;
    segments.push_back({head, nullptr});
    int64_t cached_tokens = 0;
    for (int d : picked) {
      auto kv = kv_of(d);
      if (!kv.ok()) {
        std::fprintf(stderr, "kdn-bench: %s\n", kv.status().ToString().c_str());
        return 1;
      }
      segments.push_back({pool[d].tokens, *kv});
      cached_tokens += static_cast<int64_t>(pool[d].tokens.size());
    }
    for (size_t m = 0; m < modes.size(); ++m) {
      const Mode& mode = modes[m];
      blend::BlendOptions bo{.spec = {.recompute_ratio = mode.ratio,
                                      .check_layer = o.check_layer,
                                      .check_layers = mode.check_layers,
                                      .selection = mode.selection,
                                      .max_kl = mode.max_kl},
                             .seed = static_cast<uint64_t>(p) + 1};
      engine::KvSequence seq = cache.NewSequence();
      const auto t0 = Clock::now();
      auto res = blend::BlendPrefill(model, seq, segments, suffix, bo);
      if (!res.ok()) {
        std::fprintf(stderr, "kdn-bench: %s: %s\n", mode.name.c_str(),
                     res.status().ToString().c_str());
        return 1;
      }
      Tally& t = tallies[m];
      t.seconds += Seconds(t0, Clock::now());
      // The query selections' pass over the question counts as recomputed.
      t.recomputed += res->recomputed_tokens + res->question_pass_tokens;
      const double residual = res->residual;
      t.cached += cached_tokens;
      auto forced = TeacherForced(model, seq, std::move(res->logits), ref_tokens);
      if (!forced.ok()) {
        std::fprintf(stderr, "kdn-bench: %s\n", forced.status().ToString().c_str());
        return 1;
      }
      bool equal_so_far = true;
      double prompt_kl = 0;
      for (size_t i = 0; i < ref_tokens.size(); ++i) {
        const double kl = blend::KlDivergence(ref_logits[i], (*forced)[i]);
        prompt_kl += kl;
        t.kl += kl;
        const bool agree = engine::Argmax((*forced)[i]) == ref_tokens[i];
        t.top1 += agree;
        ++t.positions;
        // Teacher-forced on the reference, a run of agreeing argmaxes is
        // exactly the greedy answer's run of equal tokens.
        equal_so_far = equal_so_far && agree;
        t.equal_run += equal_so_far;
      }
      t.all_equal += equal_so_far;
      t.residual_kl.emplace_back(residual, prompt_kl / static_cast<double>(ref_tokens.size()));
    }
    if ((p + 1) % 5 == 0 || p + 1 == o.prompts || p == 0) {
      std::fprintf(stderr, "blend-fidelity: %d/%d prompts (%.0f s)\n", p + 1, o.prompts,
                   Seconds(t_start, Clock::now()));
    }
  }

  const double full_ttft = full_seconds / o.prompts;
  std::printf(
      "mean prompt: %.0f tokens; full prefill TTFT %.1f ms; %lld of %lld reference "
      "tokens not the teacher-forced pass's argmax\n",
      static_cast<double>(prompt_tokens) / o.prompts, full_ttft * 1e3,
      static_cast<long long>(ref_path_flips), static_cast<long long>(o.prompts) * o.answer_tokens);
  std::printf("%-28s %10s %9s %10s %8s %12s %10s %9s\n", "mode", "recomputed", "KL", "KL/reuse",
              "top-1", "greedy equal", "equal run", "TTFT x");
  const double reuse_kl = tallies[0].kl / static_cast<double>(tallies[0].positions);
  json rows = json::array();
  rows.push_back({{"mode", "full_prefill"}, {"ttft_s", full_ttft}});
  for (size_t m = 0; m < modes.size(); ++m) {
    const Tally& t = tallies[m];
    const double kl = t.kl / static_cast<double>(t.positions);
    const double top1 = static_cast<double>(t.top1) / static_cast<double>(t.positions);
    const double all_equal = static_cast<double>(t.all_equal) / o.prompts;
    const double run = static_cast<double>(t.equal_run) / o.prompts;
    const double ttft = t.seconds / o.prompts;
    const double share = static_cast<double>(t.recomputed) / static_cast<double>(t.cached);
    std::printf("%-28s %9.1f%% %9.4f %10.3f %8.3f %11.0f%% %10.1f %8.2fx\n", modes[m].name.c_str(),
                100 * share, kl, reuse_kl > 0 ? kl / reuse_kl : 0, top1, 100 * all_equal, run,
                full_ttft / ttft);
    json row = {{"mode", modes[m].kind},
                {"ratio", modes[m].selection.checks() ? json(modes[m].ratio) : json(nullptr)},
                {"recomputed_share", share},
                {"kl", kl},
                {"kl_vs_full_reuse", reuse_kl > 0 ? kl / reuse_kl : 0},
                {"top1_agreement", top1},
                {"greedy_equal", all_equal},
                {"greedy_equal_run", run},
                {"ttft_s", ttft},
                {"speedup", full_ttft / ttft},
                {"ttft_speedup", full_ttft / ttft}};
    if (!modes[m].check_layers.empty()) row["check_layers"] = modes[m].check_layers;
    if (modes[m].max_kl > 0) row["max_kl"] = modes[m].max_kl;
    double residual = 0;
    for (const auto& rk : t.residual_kl) residual += rk.first;
    if (modes[m].selection.checks() && modes[m].kind != "full_reuse") {
      row["residual"] = residual / static_cast<double>(t.residual_kl.size());
    }
    rows.push_back(std::move(row));
  }
  // The quality target's slope: each prompt's KL against its residual
  // deviation at the first check, over the deviation rows (one check and
  // progressive), fitted through the origin.
  json calibration = nullptr;
  if (o.calibrate) {
    double rk = 0, rr = 0, kk = 0, sr = 0, sk = 0;
    size_t n = 0;
    for (size_t m = 0; m < modes.size(); ++m) {
      if (modes[m].kind != "deviation" && modes[m].kind != "progressive") continue;
      for (const auto& [r, k] : tallies[m].residual_kl) {
        rk += r * k;
        rr += r * r;
        kk += k * k;
        sr += r;
        sk += k;
        ++n;
      }
    }
    const double slope = rr > 0 ? rk / rr : 0;
    const double dn = static_cast<double>(n);
    const double cov = rk / dn - (sr / dn) * (sk / dn);
    const double corr =
        cov / std::sqrt((rr / dn - (sr / dn) * (sr / dn)) * (kk / dn - (sk / dn) * (sk / dn)));
    std::printf(
        "calibration: KL = %.4f x residual deviation (%zu prompt-rows; correlation %.3f)"
        " -> --blend-kl-per-residual %.4f\n",
        slope, n, corr, slope);
    calibration = {{"kl_per_residual", slope}, {"points", n}, {"correlation", corr}};
  }
  const double secs = Seconds(t_start, Clock::now());
  std::printf("(%.0f s)\n", secs);
  Emit(c, {{"workload", "blend-fidelity"},
           {"model", what},
           {"text_dir", o.text_dir},
           {"prompts", o.prompts},
           {"documents", o.docs},
           {"doc_tokens_min", o.doc_tokens},
           {"answer_tokens", o.answer_tokens},
           {"check_layer", o.check_layer},
           {"reference_path_flips", ref_path_flips},
           {"mean_prompt_tokens", static_cast<double>(prompt_tokens) / o.prompts},
           {"rows", rows},
           {"calibration", calibration},
           {"seconds", secs},
           {"machine", Machine(c)}});
  return 0;
}

}  // namespace kdn::bench
