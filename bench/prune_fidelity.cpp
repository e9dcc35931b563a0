// kdn-bench prune-fidelity: how close the answers over pruned KV come to the
// answers over the whole KV, for kdn's question-free pruning (kdn/prune) and
// for kvpress's presses on the same samples (docs/kvbus.md, "Pruned KV").
//
// Documents: real prose (prose.h), --documents of them spread over the
// pool, each a context "<|im_start|>user\n" + document in the model's chat
// format. Each gets --questions questions (about a word of it, a summary, a
// quote), unseen when its KV is pruned. Per sample (document, question): the
// whole KV's greedy answer (--answer-tokens) is the reference; the question
// and answer tokens are then run teacher-forced over the whole KV and over
// each pruned KV, and per position KL(full || pruned) of the next-token
// distribution and top-1 agreement are taken. Per method, granularity and
// keep ratio: the mean KL with a bootstrap 95% interval over samples, top-1
// agreement, the KV stored per document (f32), the first-token time of the
// question over the (pruned) document's KV, and the time pruning took.
// Under kvzip, beside its full scoring at each granularity, its profiled
// scoring (`kvzip/profiled`: the model's head budgets, measured once on
// kdn's calibration texts before the documents, and the ranking of
// prune::ProfiledKvzipScores) and its combined scoring (`kvzip/combined`:
// its global counts, ranked by prune::MeanRanks of KVzip's and Expected
// Attention's scores). Beside the engine's rows (`stored_by:
// engine`), one per method and keep for what a deployment stores
// (`stored_by: deployment`, "<method>/<its default> stored": kvzip
// profiled, the others at their default granularity): the chunk the
// prefill worker writes (prune::PrunedChunkOf, in the engine's KV dtype),
// its bytes parsed and placed as a worker places them; its stored size is
// the whole chunk's, and its prune time includes writing it. Pruning's
// time is set against the document's own prefill (`prefill_ms`, without
// hooks): a score from the prefill's queries (Expected Attention's, and
// so profiled kvzip's) counts what the query hook adds to the prefill.
//
// With --kvpress-python (scripts/kvpress-env.sh), bench/kvpress_peer.py runs
// kvpress's question-free presses on the same token ids in the same run, and
// checks kdn against it twice: kdn's Expected Attention scores of the first
// document against ExpectedAttentionPress's (max difference), and the
// logits of the first sample over the KV kdn kept, computed again by
// transformers over exactly those tokens' KV (the engine's position rule
// against transformers').
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <numeric>
#include <random>

#include "bench_util.h"
#include "kdn/blend/blend.h"
#include "kdn/control/request_spec.h"
#include "kdn/kvbridge/head_pruned.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/prune/prune_text.h"
#include "kdn/prune/expected_attention.h"
#include "kdn/prune/head_budgets.h"
#include "kdn/prune/kvzip.h"
#include "kdn/prune/prune.h"
#include "kdn/text/tokenizer.h"
#include "prose.h"

namespace kdn::bench {

namespace {

struct Sample {
  int doc = 0;
  std::vector<int32_t> question;  // the cue, up to where the answer starts
  std::vector<int32_t> qa;        // question, then the whole KV's greedy answer
  std::vector<float> full;        // [qa][vocab]: the whole KV's logits
};

struct Row {
  std::string method;  // kdn:<score>/<granularity> or kvpress:<press>
  double keep = 0;
  std::vector<double> kl, top1;  // per sample
  std::vector<double> stored;    // tokens per KV head, per document
  double ttft_s = 0;             // summed over samples
  double prune_s = 0;            // summed over documents
  // What a deployment stores (the chunk the prefill worker writes, at the
  // method's default granularity, read back as a decode worker places it),
  // or what the engine holds.
  bool deployment = false;
};

// Mean KL(p || q) and argmax agreement over the rows of two [rows][vocab] sets.
std::pair<double, double> Compare(const std::vector<float>& p, const std::vector<float>& q,
                                  size_t vocab) {
  const size_t rows = p.size() / vocab;
  double kl = 0, agree = 0;
  for (size_t r = 0; r < rows; ++r) {
    std::span<const float> a(&p[r * vocab], vocab), b(&q[r * vocab], vocab);
    kl += blend::KlDivergence(a, b);
    agree += engine::Argmax(a) == engine::Argmax(b);
  }
  return {kl / static_cast<double>(rows), agree / static_cast<double>(rows)};
}

std::vector<float> ReadFloats(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  std::vector<float> v(static_cast<size_t>(in.tellg()) / sizeof(float));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * 4));
  return v;
}

int Fail(const Status& st) {
  std::fprintf(stderr, "kdn-bench prune-fidelity: %s\n", st.ToString().c_str());
  return 1;
}

}  // namespace

int RunPruneFidelity(const Common& c, const PruneFidelityOptions& o) {
  for (double k : o.keeps) {
    if (!(k > 0 && k <= 1)) {
      std::fprintf(stderr, "kdn-bench prune-fidelity: --keep %g: each in (0, 1]\n", k);
      return 2;
    }
  }
  std::vector<prune::Granularity> grans;
  for (const std::string& g : o.granularities) {
    auto p = prune::ParseGranularity(g);
    if (!p.ok()) return Fail(p.status());
    grans.push_back(*p);
  }
  for (const std::string& m : o.methods) {
    if (m != "expected_attention" && m != "knorm" && m != "kvzip") {
      std::fprintf(stderr,
                   "kdn-bench prune-fidelity: --methods %s: expected_attention, knorm or kvzip\n",
                   m.c_str());
      return 2;
    }
  }
  std::string what;
  // The whole document, the question and answer, and a compacted copy.
  const int64_t kv_tokens =
      std::max<int64_t>(8192, 3 * (2 * int64_t{o.doc_tokens} + 256 + 2 * int64_t{o.answer_tokens}));
  auto model_r = MakeModel(c, kv_tokens, &what);
  if (!model_r.ok()) return Fail(model_r.status());
  engine::Engine& model = **model_r;
  const model::ModelConfig& cfg = model.config();
  const size_t vocab = static_cast<size_t>(cfg.vocab_size);
  std::unique_ptr<text::Tokenizer> tok;
  auto encode_r = ProseEncoder(c.model_dir, cfg.vocab_size, &tok);
  if (!encode_r.ok()) return Fail(encode_r.status());
  const Encoder encode = *std::move(encode_r);
  size_t nfiles = 0;
  auto pool_r = ProseDocuments(o.text_dir, o.doc_tokens, encode, &nfiles);
  if (!pool_r.ok()) return Fail(pool_r.status());
  const std::vector<ProseDocument>& pool = *pool_r;
  if (static_cast<int>(pool.size()) < o.documents) {
    std::fprintf(stderr, "kdn-bench prune-fidelity: %zu documents under %s, fewer than %d\n",
                 pool.size(), o.text_dir.c_str(), o.documents);
    return 1;
  }
  const bool chat = tok && encode("<|im_start|>").size() == 1;
  // KVzip's repeat prompts (prune::kKvzipFirstPrompt: as kvpress words
  // them, ending as kvpress ends them for a tokenizer without a chat
  // template, the peer's), as kdn-router sends them.
  prune::PruneSpec kvzip{.method = "kvzip"};
  prune::TokenizeKvzipPrompts(encode, &kvzip);
  const prune::KvzipPrompts kvzip_prompts{kvzip.kvzip_first, kvzip.kvzip_next, kvzip.kvzip_suffix};
  const std::vector<std::string> cues = {
      "What does the text above say about \"%s\"?",
      "Summarize the text above in one sentence.",
      "Quote the sentence of the text above that mentions \"%s\".",
      "Who may do what under the text above?",
  };
  // Documents spread evenly over the pool; their contexts.
  std::vector<int> docs;
  std::vector<std::vector<int32_t>> contexts;
  for (int d = 0; d < o.documents; ++d) {
    docs.push_back(static_cast<int>(static_cast<size_t>(d) * pool.size() / o.documents));
    std::vector<int32_t> ctx =
        tok ? tok->Encode(chat ? "<|im_start|>user\n" : "", true) : std::vector<int32_t>{};
    const auto& body = pool[docs.back()].tokens;
    ctx.insert(ctx.end(), body.begin(), body.end());
    if (static_cast<int>(ctx.size()) <= o.sinks) {
      std::fprintf(stderr, "kdn-bench prune-fidelity: a document of %zu tokens\n", ctx.size());
      return 1;
    }
    contexts.push_back(std::move(ctx));
  }
  std::printf(
      "prune-fidelity on %s: %d documents of %d+ tokens (pool of %zu from %zu files under %s), "
      "%d questions each, %d answer tokens, %d sinks%s\n",
      what.c_str(), o.documents, o.doc_tokens, pool.size(), nfiles, o.text_dir.c_str(), o.questions,
      o.answer_tokens, o.sinks, chat ? ", chat format" : "");
  std::fflush(stdout);

  // What a deployment stores by default (prefill worker: the spec's
  // defaults).
  // Without kvzip's profiled scoring measured: kvzip's full scoring (a
  // deployment's with `scoring: full`).
  auto deployed = [&](const std::string& m) {
    const prune::PruneSpec spec{.method = m};
    return o.kvzip_profiled && prune::ScoringOf(spec) == prune::KvzipScoring::kProfiled
               ? std::string("kvzip/profiled")
               : m + "/" + prune::GranularityName(prune::GranularityOf(spec));
  };
  // Rows: kdn's, then kvpress's.
  std::vector<Row> rows;
  std::map<std::tuple<std::string, int, double>, size_t> row_of;  // (method, granularity, keep)
  for (const std::string& m : o.methods) {
    for (prune::Granularity g : grans) {
      for (double k : o.keeps) {
        row_of[{m, static_cast<int>(g), k}] = rows.size();
        rows.push_back({"kdn:" + m + "/" + prune::GranularityName(g), k, {}, {}, {}, 0, 0});
      }
    }
    if (m == "kvzip") {
      for (double k : o.keeps) {
        row_of[{m, -3, k}] = rows.size();
        rows.push_back({"kdn:kvzip/combined", k, {}, {}, {}, 0, 0});
      }
    }
    if (m == "kvzip" && o.kvzip_profiled) {
      for (double k : o.keeps) {
        row_of[{m, -2, k}] = rows.size();
        rows.push_back({"kdn:kvzip/profiled", k, {}, {}, {}, 0, 0});
      }
    }
    for (double k : o.keeps) {
      row_of[{m, -1, k}] = rows.size();
      rows.push_back({"kdn:" + deployed(m) + " stored", k, {}, {}, {}, 0, 0, true});
    }
  }
  Row full_row{"full", 1.0, {}, {}, {}, 0, 0};
  std::vector<Sample> samples;
  // For the peer's checks: kdn's scores of the first document, and what it
  // kept of it (Expected Attention per head, at the keep nearest 0.25).
  prune::Scores first_scores, first_kvzip_scores;
  prune::KeptTokens first_kept;
  std::vector<float> first_pruned_logits;
  double check_keep = o.keeps[0];
  for (double k : o.keeps) {
    if (std::fabs(k - 0.25) < std::fabs(check_keep - 0.25)) check_keep = k;
  }

  engine::KvCache& cache = model.kv_cache();
  // kvzip's head budgets, as a prefill worker measures them (once).
  std::optional<prune::HeadBudgets> budgets;
  double budgets_s = 0;
  if (o.kvzip_profiled &&
      std::find(o.methods.begin(), o.methods.end(), "kvzip") != o.methods.end()) {
    std::vector<std::vector<int32_t>> texts;
    for (const std::string& t : prune::CalibrationTexts()) texts.push_back(encode(t));
    const auto t0 = Clock::now();
    auto b = prune::MeasureHeadBudgets(model, texts, kvzip_prompts);
    if (!b.ok()) return Fail(b.status());
    budgets_s = Seconds(t0, Clock::now());
    budgets = *std::move(b);
    std::fprintf(stderr, "prune-fidelity: kvzip's head budgets measured on %zu texts (%.1f s)\n",
                 texts.size(), budgets_s);
  }
  double prefill_s = 0;  // the documents' own prefills, without hooks
  const auto t_start = Clock::now();
  std::vector<float> logits;
  for (size_t d = 0; d < docs.size(); ++d) {
    const std::vector<int32_t>& ctx = contexts[d];
    const auto L = static_cast<int64_t>(ctx.size());
    engine::KvSequence whole = cache.NewSequence();
    engine::QueryStats stats{.skip = o.sinks};
    Status st = Status::Ok();
    // The document's own prefill, then again with the query hook: what
    // the hook adds is scoring's.
    double hook_s = 0;
    {
      engine::KvSequence plain = cache.NewSequence();
      auto t0 = Clock::now();
      if (!(st = model.Prefill(plain, ctx, {}, &logits)).ok()) return Fail(st);
      const double plain_s = Seconds(t0, Clock::now());
      prefill_s += plain_s;
      plain.Reset();
      t0 = Clock::now();
      st = model.Prefill(whole, ctx, {.on_queries = stats.Hook(cfg)}, &logits);
      if (!st.ok()) return Fail(st);
      hook_s = std::max(0.0, Seconds(t0, Clock::now()) - plain_s);
    }
    full_row.stored.push_back(static_cast<double>(L));
    // This document's questions: the whole KV's answers and logits.
    const size_t first_sample = samples.size();
    for (int q = 0; q < o.questions; ++q) {
      std::string cue = cues[(d * o.questions + q) % cues.size()];
      if (cue.find("%s") != std::string::npos) {
        cue.replace(cue.find("%s"), 2, KeyWord(pool[docs[d]].text));
      }
      Sample s;
      s.doc = static_cast<int>(d);
      s.question = encode(chat ? cue + "<|im_end|>\n<|im_start|>assistant\n" : cue + "\nAnswer:");
      auto t0 = Clock::now();
      if (!(st = model.Prefill(whole, s.question, {}, &logits)).ok()) return Fail(st);
      full_row.ttft_s += Seconds(t0, Clock::now());
      auto answer = GreedyTokens(model, whole, logits, o.answer_tokens);
      if (!answer.ok()) return Fail(answer.status());
      whole.Truncate(L);
      s.qa = s.question;
      s.qa.insert(s.qa.end(), answer->begin(), answer->end());
      if (!(st = model.Prefill(whole, s.qa, {.all_logits = true}, &s.full)).ok()) return Fail(st);
      whole.Truncate(L);
      full_row.kl.push_back(0);
      full_row.top1.push_back(1);
      samples.push_back(std::move(s));
    }
    // Each method's scores once per document, then each granularity and keep.
    for (const std::string& m : o.methods) {
      auto t0 = Clock::now();
      auto scores =
          m == "expected_attention"
              ? prune::ExpectedAttentionScores(cfg, cache, whole, L, stats, {.sinks = o.sinks})
          : m == "kvzip" ? prune::KvzipScores(model, whole, ctx, kvzip_prompts,
                                              {.sinks = o.sinks, .chunk_tokens = o.kvzip_chunk})
                         : prune::KeyNormScores(cache, whole, L);
      if (!scores.ok()) return Fail(scores.status());
      const double score_s = Seconds(t0, Clock::now()) + (m == "expected_attention" ? hook_s : 0.0);
      // kvzip's profiled ranking, the hook's time counted.
      Result<prune::Scores> ranked = prune::Scores{};
      double ranked_s = 0;
      if (m == "kvzip" && budgets) {
        t0 = Clock::now();
        ranked = prune::ProfiledKvzipScores(model, whole, ctx, stats, kvzip_prompts, o.sinks);
        if (!ranked.ok()) return Fail(ranked.status());
        ranked_s = Seconds(t0, Clock::now()) + hook_s;
      }
      if (d == 0 && m == "expected_attention") first_scores = *scores;
      if (d == 0 && m == "kvzip") first_kvzip_scores = *scores;
      // The samples of this document over `pruned` (`slots` slots).
      auto measure = [&](Row& row, engine::KvSequence& pruned, int64_t slots,
                         std::vector<float>* first_logits) -> Status {
        for (size_t i = first_sample; i < samples.size(); ++i) {
          const Sample& s = samples[i];
          const auto t1 = Clock::now();
          KDN_RETURN_IF_ERROR(model.Prefill(pruned, s.question, {}, &logits));
          row.ttft_s += Seconds(t1, Clock::now());
          pruned.Truncate(slots);
          std::vector<float> got;
          KDN_RETURN_IF_ERROR(model.Prefill(pruned, s.qa, {.all_logits = true}, &got));
          pruned.Truncate(slots);
          const auto [kl, top1] = Compare(s.full, got, vocab);
          row.kl.push_back(kl);
          row.top1.push_back(top1);
          if (first_logits != nullptr && i == 0) *first_logits = std::move(got);
        }
        return Status::Ok();
      };
      // `kept` of the whole KV, the row's samples over it; pruning took
      // `scored_s` and the choice since `t0`.
      auto measure_kept = [&](Row& row, const Result<prune::KeptTokens>& kept, double scored_s,
                              Clock::time_point t0,
                              std::vector<float>* first_logits = nullptr) -> Status {
        KDN_RETURN_IF_ERROR(kept.status());
        engine::KvSequence pruned = cache.NewSequence();
        KDN_RETURN_IF_ERROR(prune::CompactKv(cache, whole, *kept, &pruned));
        row.prune_s += scored_s + Seconds(t0, Clock::now());
        row.stored.push_back(kept->stored_tokens());
        return measure(row, pruned, kept->kept, first_logits);
      };
      for (prune::Granularity g : grans) {
        for (double k : o.keeps) {
          t0 = Clock::now();
          auto kept = prune::SelectKept(*scores, k, o.sinks, g);
          const bool check = d == 0 && m == "expected_attention" &&
                             g == prune::Granularity::kHead && k == check_keep;
          if (check && kept.ok()) first_kept = *kept;
          st = measure_kept(rows[row_of[{m, static_cast<int>(g), k}]], kept, score_s, t0,
                            check ? &first_pruned_logits : nullptr);
          if (!st.ok()) return Fail(st);
        }
      }
      // kvzip's combined scoring: its global counts, ranked by KVzip's and
      // Expected Attention's ranks (the hook's time and Expected
      // Attention's counted).
      if (m == "kvzip") {
        t0 = Clock::now();
        auto ea = prune::ExpectedAttentionScores(cfg, cache, whole, L, stats, {.sinks = o.sinks});
        if (!ea.ok()) return Fail(ea.status());
        auto ranking = prune::MeanRanks(*scores, *ea);
        if (!ranking.ok()) return Fail(ranking.status());
        const double combined_s = score_s + hook_s + Seconds(t0, Clock::now());
        for (double k : o.keeps) {
          t0 = Clock::now();
          auto kept = prune::SelectKept(*scores, k, o.sinks, prune::Granularity::kGlobal);
          if (!kept.ok()) return Fail(kept.status());
          st = measure_kept(rows[row_of[{m, -3, k}]], prune::Rerank(*kept, *ranking, o.sinks),
                            combined_s, t0);
          if (!st.ok()) return Fail(st);
        }
      }
      for (double k : o.keeps) {
        if (!(m == "kvzip" && budgets)) break;
        t0 = Clock::now();
        st = measure_kept(rows[row_of[{m, -2, k}]],
                          prune::SelectBudgeted(*ranked, k, o.sinks, *budgets), ranked_s, t0);
        if (!st.ok()) return Fail(st);
      }
      // What a deployment stores: the chunk the method's defaults give,
      // its bytes parsed and placed as a worker places them.
      const bool profiled = deployed(m) == "kvzip/profiled";
      for (double k : o.keeps) {
        Row& row = rows[row_of[{m, -1, k}]];
        t0 = Clock::now();
        auto kept =
            profiled ? prune::SelectBudgeted(*ranked, k, o.sinks, *budgets)
                     : prune::SelectKept(*scores, k, o.sinks, prune::GranularityOf({.method = m}));
        if (!kept.ok()) return Fail(kept.status());
        engine::KvSequence pruned = cache.NewSequence();
        if (!(st = prune::CompactKv(cache, whole, *kept, &pruned)).ok()) return Fail(st);
        auto chunk = prune::PrunedChunkOf(cache, pruned, *kept, {}, {}, model.kv_dtype());
        if (!chunk.ok()) return Fail(chunk.status());
        row.prune_s += (profiled ? ranked_s : score_s) + Seconds(t0, Clock::now());
        pruned.Reset();
        auto read = kvbus::Chunk::Parse(
            std::vector<uint8_t>((*chunk)->bytes().begin(), (*chunk)->bytes().end()));
        if (!read.ok()) return Fail(read.status());
        const kvbus::Chunk& stored = **read;
        // Every byte of the chunk, in whole tokens' f32 KV.
        row.stored.push_back(static_cast<double>(stored.size()) /
                             (2.0 * cfg.num_layers * cfg.kv_dim() * 4));
        engine::KvSequence placed = cache.NewSequence();
        if (stored.info().per_head()) {
          st = kvbridge::HeadPrunedChunkToPagedKv(stored, cache, placed);
        } else if ((st = cache.Reserve(placed, stored.info().tokens)).ok() &&
                   (st = kvbridge::ChunkToPagedKv(stored, cache, placed, 0)).ok()) {
          cache.SetLength(placed, stored.info().tokens);
          st = placed.SetNextPosition(L);
        }
        if (!st.ok()) return Fail(st);
        if (!(st = measure(row, placed, stored.info().tokens, nullptr)).ok()) return Fail(st);
      }
    }
    std::fprintf(stderr, "prune-fidelity: %zu/%zu documents (%.0f s)\n", d + 1, docs.size(),
                 Seconds(t_start, Clock::now()));
  }

  // kvpress on the same samples.
  json checks = json::object();
  std::string peer_name;
  if (!o.kvpress_python.empty()) {
    std::filesystem::create_directories(o.work_dir);
    json job = {{"gguf", c.model_dir},
                {"work", o.work_dir},
                {"threads", c.threads},
                {"keeps", o.keeps},
                {"sinks", o.sinks},
                {"presses", o.kvpress_presses},
                {"scores_sample", first_scores.tokens > 0 ? 0 : -1},
                {"kvzip_scores_sample", first_kvzip_scores.tokens > 0 ? 0 : -1},
                {"kvzip_chunk", o.kvzip_chunk},
                {"kvzip_prompts",
                 {{"first", kvzip_prompts.first},
                  {"next", kvzip_prompts.next},
                  {"suffix", kvzip_prompts.suffix}}}};
    json js = json::array();
    for (const Sample& s : samples) js.push_back({{"doc", contexts[s.doc]}, {"qa", s.qa}});
    job["samples"] = std::move(js);
    // Replays of the first sample: every token kept (the whole KV through
    // transformers), and what kdn kept.
    json replays = json::array();
    auto kept_json = [](const prune::KeptTokens& k) {
      json layers = json::array();
      for (int l = 0; l < k.layers; ++l) {
        json heads = json::array();
        for (int h = 0; h < k.kv_heads; ++h) {
          heads.push_back(std::vector<int32_t>(k.of(l, h), k.of(l, h) + k.kept));
        }
        layers.push_back(std::move(heads));
      }
      return layers;
    };
    if (first_kept.kept > 0) {
      prune::KeptTokens all = first_kept;
      all.kept = all.logical;
      all.index.clear();
      for (int i = 0; i < all.layers * all.kv_heads; ++i) {
        for (int32_t t = 0; t < all.logical; ++t) all.index.push_back(t);
      }
      replays.push_back({{"sample", 0}, {"kept", kept_json(all)}});
      replays.push_back({{"sample", 0}, {"kept", kept_json(first_kept)}});
    }
    job["replays"] = std::move(replays);
    const std::string in = o.work_dir + "/peer-in.json", out = o.work_dir + "/peer-out.json";
    std::ofstream(in) << job.dump();
    std::filesystem::remove(out);
    const std::string cmd = "'" + o.kvpress_python + "' '" + o.kvpress_script + "' --in '" + in +
                            "' --out '" + out + "'";
    std::fprintf(stderr, "prune-fidelity: %s\n", cmd.c_str());
    if (std::system(cmd.c_str()) != 0 || !std::filesystem::exists(out)) {
      std::fprintf(stderr, "kdn-bench prune-fidelity: the kvpress peer failed\n");
      return 1;
    }
    std::ifstream pin(out);
    const json peer = json::parse(pin);
    peer_name = peer.value("peer", "kvpress");
    for (const json& r : peer["rows"]) {
      Row row{r["method"],
              r["keep"],
              r["kl"].get<std::vector<double>>(),
              r["top1"].get<std::vector<double>>(),
              r["stored_tokens"].get<std::vector<double>>(),
              0,
              0};
      rows.push_back(std::move(row));
    }
    // kdn's scores of document 0 against the press's.
    auto check_scores = [&](const char* key, const char* name, const prune::Scores& ours) {
      if (!peer.contains(key) || ours.tokens == 0) return true;
      const std::vector<float> theirs = ReadFloats(peer[key]["file"]);
      std::ofstream(o.work_dir + "/kdn_" + key + ".f32", std::ios::binary)
          .write(reinterpret_cast<const char*>(ours.v.data()),
                 static_cast<std::streamsize>(ours.v.size() * sizeof(float)));
      double max_abs = 0, scale = 0;
      if (theirs.size() != ours.v.size()) {
        std::fprintf(stderr, "kdn-bench prune-fidelity: kvpress scored %zu values, kdn %zu\n",
                     theirs.size(), ours.v.size());
        return false;
      }
      for (size_t i = 0; i < theirs.size(); ++i) {
        max_abs = std::max(max_abs, std::fabs(double{theirs[i]} - ours.v[i]));
        scale = std::max(scale, std::fabs(double{theirs[i]}));
      }
      const std::string by = peer[key].value("by", "kvpress");
      checks[std::string(key)] = {{"against", by},
                                  {"values", theirs.size()},
                                  {"max_abs_diff", max_abs},
                                  {"max_abs_score", scale},
                                  {"within_1e-4", max_abs <= 1e-4}};
      std::printf(
          "%s scores of document 0 (%zu values, largest %.4g): max |kdn - %s| = %.3g (%s "
          "1e-4)\n",
          name, theirs.size(), scale, by.c_str(), max_abs,
          max_abs <= 1e-4 ? "within" : "NOT within");
      return true;
    };
    if (!check_scores("expected_attention_scores", "Expected Attention", first_scores) ||
        !check_scores("kvzip_scores", "KVzip", first_kvzip_scores)) {
      return 1;
    }
    if (peer["replays"].size() == 2) {
      const std::vector<float> hf_full = ReadFloats(peer["replays"][0]["file"]);
      const std::vector<float> hf_pruned = ReadFloats(peer["replays"][1]["file"]);
      if (hf_full.size() != samples[0].full.size() ||
          hf_pruned.size() != first_pruned_logits.size()) {
        std::fprintf(stderr, "kdn-bench prune-fidelity: the replays' logits do not fit\n");
        return 1;
      }
      const auto [kl_full, agree_full] = Compare(samples[0].full, hf_full, vocab);
      const auto [kl_pruned, agree_pruned] = Compare(first_pruned_logits, hf_pruned, vocab);
      checks["transformers_replay"] = {{"keep", check_keep},
                                       {"kl_whole_kv", kl_full},
                                       {"top1_whole_kv", agree_full},
                                       {"kl_pruned_kv", kl_pruned},
                                       {"top1_pruned_kv", agree_pruned}};
      std::printf(
          "sample 0 through transformers over the same KV: KL(kdn || transformers) %.2e whole, "
          "%.2e pruned to kdn's kept tokens (keep %.3g); top-1 agreement %.3f, %.3f\n",
          kl_full, kl_pruned, check_keep, agree_full, agree_pruned);
    }
  }

  // The table.
  const double per_token_bytes = 2.0 * cfg.num_layers * cfg.kv_dim() * 4;  // f32 K and V
  std::printf("%-34s %6s %9s %21s %7s %12s %9s %9s\n", "method", "keep", "KL", "95% interval",
              "top-1", "stored KiB", "TTFT ms", "prune ms");
  json out_rows = json::array();
  const double prefill_ms = 1e3 * prefill_s / static_cast<double>(docs.size());
  auto emit = [&](const Row& r, uint64_t seed) {
    const Interval iv = Bootstrap(r.kl, o.bootstrap, seed);
    const double stored = Mean(r.stored) * per_token_bytes;
    const bool timed = r.method == "full" || r.method.rfind("kdn:", 0) == 0;
    const double ttft_ms = timed ? 1e3 * r.ttft_s / static_cast<double>(samples.size()) : 0;
    const double prune_ms = timed ? 1e3 * r.prune_s / static_cast<double>(docs.size()) : 0;
    std::printf("%-34s %6.3f %9.4f   [%8.4f, %8.4f] %7.3f %12.1f %9s %9s\n", r.method.c_str(),
                r.keep, iv.mean, iv.lo, iv.hi, Mean(r.top1), stored / 1024,
                timed ? std::to_string(ttft_ms).substr(0, 7).c_str() : "-",
                timed && r.method != "full" ? std::to_string(prune_ms).substr(0, 7).c_str() : "-");
    out_rows.push_back(
        {{"method", r.method},
         {"keep", r.keep},
         {"kl", iv.mean},
         {"kl_lo", iv.lo},
         {"kl_hi", iv.hi},
         {"top1_agreement", Mean(r.top1)},
         {"stored_by", r.method.rfind("kvpress:", 0) == 0 ? "kvpress"
                       : r.deployment                     ? "deployment"
                                                          : "engine"},
         {"stored_tokens", Mean(r.stored)},
         {"stored_bytes", stored},
         {"ttft_ms", timed ? json(ttft_ms) : json(nullptr)},
         {"prune_ms", timed && r.method != "full" ? json(prune_ms) : json(nullptr)},
         {"prune_per_prefill",
          timed && r.method != "full" ? json(prune_ms / prefill_ms) : json(nullptr)}});
    return iv;
  };
  emit(full_row, c.seed + 1);
  std::map<std::string, Interval> at_quarter;  // method -> interval at check_keep
  for (size_t i = 0; i < rows.size(); ++i) {
    const Interval iv = emit(rows[i], c.seed + 2 + i);
    if (rows[i].keep == check_keep) at_quarter[rows[i].method] = iv;
  }
  // The aim at the keep nearest 0.25: kdn's best row against each press.
  json aim = nullptr;
  const bool pressed = std::any_of(rows.begin(), rows.end(),
                                   [](const Row& r) { return r.method.rfind("kvpress:", 0) == 0; });
  if (pressed) {
    std::string best;
    for (const auto& [m, iv] : at_quarter) {
      if (m.rfind("kdn:", 0) == 0 && (best.empty() || iv.mean < at_quarter[best].mean)) best = m;
    }
    const Interval b = at_quarter[best];
    json versus = json::object();
    bool beats_all = true, ties_kvzip = true;
    for (const auto& [m, iv] : at_quarter) {
      if (m.rfind("kvpress:", 0) != 0) continue;
      const bool beats = b.hi < iv.lo, overlaps = !(b.hi < iv.lo || iv.hi < b.lo);
      const std::string verdict = beats ? "beats" : overlaps ? "ties" : "loses";
      versus[m] = verdict;
      if (m == "kvpress:kvzip") {
        ties_kvzip = verdict != "loses";
      } else {
        beats_all = beats_all && beats;
      }
      std::printf("keep %.3g: %s against %s: %s\n", check_keep, best.c_str(), m.c_str(),
                  verdict.c_str());
    }
    const auto kvzip_press = at_quarter.find("kvpress:kvzip");
    aim = {
        {"keep", check_keep},
        {"kdn_best", best},
        {"kl", b.mean},
        {"kl_ratio_to_kvzip_press",
         kvzip_press == at_quarter.end() ? json(nullptr) : json(b.mean / kvzip_press->second.mean)},
        {"versus", versus},
        {"beats_every_question_free_press", beats_all},
        {"ties_or_beats_kvzip", ties_kvzip}};
  }
  const double secs = Seconds(t_start, Clock::now());
  std::printf("a document's own prefill: %.1f ms on average; kvzip's head budgets: %.0f ms once\n",
              prefill_ms, 1e3 * budgets_s);
  std::printf("(%.0f s)\n", secs);
  Emit(c, {{"workload", "prune-fidelity"},
           {"model", what},
           {"peer", peer_name.empty() ? json(nullptr) : json(peer_name)},
           {"text_dir", o.text_dir},
           {"documents", o.documents},
           {"questions", o.questions},
           {"samples", samples.size()},
           {"doc_tokens_min", o.doc_tokens},
           {"answer_tokens", o.answer_tokens},
           {"sinks", o.sinks},
           {"prefill_ms", prefill_ms},
           {"head_budgets_ms", budgets ? json(1e3 * budgets_s) : json(nullptr)},
           {"rows", out_rows},
           {"checks", checks},
           {"aim", aim},
           {"seconds", secs},
           {"machine", Machine(c)}});
  return 0;
}

}  // namespace kdn::bench
