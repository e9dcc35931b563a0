// kdn-bench quality: exact-match accuracy of a model on its question-answering
// eval set (models/kdn-qa/eval.jsonl, made by tools/train/corpus.py), through
// kdn's own engine, by task family (single, two-hop, coref; see corpus.py).
//
// Each example is {"documents": [...], "question", "answer", "hops",
// "family"} (without "family", hops 1 is "single" and 2 "two-hop"); the
// prompt is BOS + each document and "\n" + "Question: " + question +
// "\nAnswer:", decoded greedily until "\n"; the text, stripped, must equal
// the answer.
//
// Modes: full prefill (the reference); full reuse (every document's KV as
// computed alone, placed and rotated, nothing recomputed: cross-document
// attention is lost); CacheBlend at each --ratios value; and, as its
// baseline, the same number of tokens chosen at random at each
// --random-ratios value; with --check-layers, progressive filtering over
// those layers at each --ratios value. In the reuse
// modes each document ("doc\n") is tokenized and computed on its own once,
// as the serving path stores it under its segment key; BOS is computed and
// the question is the suffix.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <memory>

#include "bench_util.h"
#include "kdn/blend/blend.h"
#include "kdn/text/tokenizer.h"
#include "kdn/kvbus/codec.h"
#include "kdn/model/gguf.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbridge/paged_chunks.h"

namespace kdn::bench {

namespace {

struct Example {
  std::vector<std::string> documents;
  std::string question;
  std::string answer;
  std::string family;
};

// Families in the order of tools/train/corpus.py; others sort after them.
int FamilyRank(const std::string& f) {
  static const char* kOrder[] = {"single", "two-hop", "coref"};
  for (int i = 0; i < 3; ++i) {
    if (f == kOrder[i]) return i;
  }
  return 3;
}

Result<std::vector<Example>> LoadEval(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("cannot open the eval set " + path);
  std::vector<Example> out;
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (line.empty()) continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("documents") ||
        !j["documents"].is_array() || !j.contains("question") || !j.contains("answer")) {
      return Corruption(path + ":" + std::to_string(n) +
                        ": not an example {documents, question, answer, hops}");
    }
    Example e;
    for (const json& d : j["documents"]) e.documents.push_back(d.get<std::string>());
    e.question = j["question"].get<std::string>();
    e.answer = j["answer"].get<std::string>();
    e.family = j.value("family", std::string(j.value("hops", 1) == 1 ? "single" : "two-hop"));
    out.push_back(std::move(e));
  }
  if (out.empty()) return InvalidArgument(path + " holds no example");
  return out;
}

std::string Strip(std::string s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  const auto e = s.find_last_not_of(" \t\r\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// Greedy decoding from `seq` (whose prompt gave `logits`) until a newline,
// EOS or max_tokens; the text before the newline.
Result<std::string> DecodeLine(engine::Engine& model, engine::KvSequence& seq,
                               const text::Tokenizer& tok, std::vector<float> logits,
                               int max_tokens) {
  auto piece = [&](int32_t t) { return tok.Decode(std::span<const int32_t>(&t, 1)); };
  KDN_ASSIGN_OR_RETURN(std::vector<int32_t> tokens,
                       GreedyTokens(model, seq, std::move(logits), max_tokens, [&](int32_t t) {
                         return t == tok.eos_id() || piece(t).find('\n') != std::string::npos;
                       }));
  std::string text;
  for (int32_t t : tokens) {
    if (t != tok.eos_id()) text += piece(t);
  }
  return text.substr(0, text.find('\n'));
}

struct Mode {
  std::string name;
  double ratio = -1;         // < 0: full prefill; 0: full reuse; else CacheBlend
  bool random = false;       // recompute tokens chosen at random, not by deviation
  bool progressive = false;  // progressive filtering over the check layers
  // Another selection policy (--selections), in place of deviation.
  std::optional<blend::BlendSelection> selection;
};

}  // namespace

std::string QaPrompt(const std::vector<std::string>& documents, const std::string& question) {
  std::string p;
  for (const std::string& d : documents) p += d + "\n";
  return p + "Question: " + question + "\nAnswer:";
}

int RunQuality(const Common& c, const std::string& eval_path, int limit, int max_tokens,
               const std::vector<double>& ratios, const std::vector<double>& random_ratios,
               int check_layer, const std::string& kv_codec, const std::vector<int>& check_layers,
               const std::vector<std::string>& selections) {
  auto codec = kvbus::ParseCodecLevel(kv_codec);
  if (!codec.ok()) {
    std::fprintf(stderr, "kdn-bench quality: --kv-codec: %s\n", codec.status().message().c_str());
    return 2;
  }
  if (c.model_dir.empty()) {
    std::fprintf(stderr, "kdn-bench quality: give --model (e.g. models/kdn-qa)\n");
    return 2;
  }
  if (eval_path.empty() && model::IsGgufPath(c.model_dir)) {
    std::fprintf(stderr, "kdn-bench quality: with a .gguf file, give --eval\n");
    return 2;
  }
  const std::string path =
      eval_path.empty() ? (std::filesystem::path(c.model_dir) / "eval.jsonl").string() : eval_path;
  auto examples = LoadEval(path);
  if (!examples.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", examples.status().ToString().c_str());
    return 1;
  }
  if (limit > 0 && static_cast<size_t>(limit) < examples->size()) examples->resize(limit);
  std::string what;
  auto model_r = MakeModel(c, 4096, &what);
  auto tok_r = text::Tokenizer::Load(c.model_dir);
  if (!model_r.ok() || !tok_r.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n",
                 (!model_r.ok() ? model_r.status() : tok_r.status()).ToString().c_str());
    return 1;
  }
  engine::Engine& model = **model_r;
  const text::Tokenizer& tok = **tok_r;
  engine::KvCache& cache = model.kv_cache();
  std::vector<Mode> modes{{"full prefill", -1}};
  if (!ratios.empty() || !random_ratios.empty()) modes.push_back({"full reuse", 0});
  for (bool random : {false, true}) {
    for (double r : random ? random_ratios : ratios) {
      if (r <= 0 || r > 1) {
        std::fprintf(stderr, "kdn-bench quality: --%sratios values must be in (0, 1], got %g\n",
                     random ? "random-" : "", r);
        return 2;
      }
      char name[32];
      std::snprintf(name, sizeof(name), "%s %.2f", random ? "random" : "blend", r);
      modes.push_back({name, r, random});
    }
  }
  if (!check_layers.empty()) {
    for (double r : ratios) {
      char name[32];
      std::snprintf(name, sizeof(name), "progr. %.2f", r);
      modes.push_back({name, r, false, true});
    }
  }
  for (const std::string& text : selections) {
    auto s = blend::ParseBlendSelection(text);
    if (!s.ok()) {
      std::fprintf(stderr, "kdn-bench quality: --selections: %s\n", s.status().message().c_str());
      return 2;
    }
    for (double r : ratios) {
      char name[64];
      std::snprintf(name, sizeof(name), "%s %.2f", text.c_str(), r);
      modes.push_back({name, r, false, false, *s});
    }
  }
  std::printf("quality of %s on %s (%zu examples), greedy, check layer %d, documents' KV %s\n",
              what.c_str(), path.c_str(), examples->size(), check_layer,
              kvbus::CodecLevelName(*codec).c_str());

  // Each document's KV computed alone (positions 0..n-1), once per example
  // (kept across that example's modes only: memory stays bounded).
  const kvbus::KeyContext ctx{{0, 42}, "", 256};
  std::map<std::string, std::shared_ptr<const kvbus::Chunk>> doc_kv;
  auto kv_of =
      [&](const std::string& doc,
          const std::vector<int32_t>& tokens) -> Result<std::shared_ptr<const kvbus::Chunk>> {
    if (auto it = doc_kv.find(doc); it != doc_kv.end()) return it->second;
    engine::KvSequence seq = cache.NewSequence();
    std::vector<float> logits;
    KDN_RETURN_IF_ERROR(model.Prefill(seq, tokens, {}, &logits));
    KDN_ASSIGN_OR_RETURN(
        auto chunk, kvbridge::ChunkFromPagedKv(cache, seq, 0, static_cast<int64_t>(tokens.size()),
                                               kvbus::SegmentKey(ctx, tokens),
                                               ctx.model_fingerprint, kdn::DType::kF32));
    std::shared_ptr<const kvbus::Chunk> shared = std::move(chunk);
    if (!codec->raw()) {
      KDN_ASSIGN_OR_RETURN(auto encoded, kvbus::EncodeChunk(shared, *codec));
      KDN_ASSIGN_OR_RETURN(shared, kvbus::DecodeChunk(encoded));
    }
    doc_kv.emplace(doc, shared);
    return shared;
  };
  uint64_t seed = 0;  // of random selection: one per example, shared by its modes
  auto answer = [&](const Example& e, const Mode& mode,
                    int64_t* recomputed) -> Result<std::string> {
    engine::KvSequence seq = cache.NewSequence();
    std::vector<float> logits;
    if (mode.ratio < 0) {
      const std::vector<int32_t> prompt = tok.Encode(QaPrompt(e.documents, e.question), true);
      KDN_RETURN_IF_ERROR(model.Prefill(seq, prompt, {}, &logits));
    } else {
      std::vector<blend::Segment> segments;
      segments.push_back({{tok.bos_id() >= 0 ? tok.bos_id() : 0}, nullptr});
      for (const std::string& d : e.documents) {
        std::vector<int32_t> tokens = tok.Encode(d + "\n", false);
        KDN_ASSIGN_OR_RETURN(auto kv, kv_of(d, tokens));
        segments.push_back({std::move(tokens), std::move(kv)});
      }
      const std::vector<int32_t> suffix = tok.Encode(QaPrompt({}, e.question), false);
      KDN_ASSIGN_OR_RETURN(
          blend::BlendResult res,
          blend::BlendPrefill(
              model, seq, segments, suffix,
              {.spec =
                   {.recompute_ratio = mode.ratio,
                    .check_layer = check_layer,
                    .check_layers = mode.progressive ? check_layers : std::vector<int>{},
                    .selection =
                        mode.selection
                            ? *mode.selection
                            : blend::BlendSelection{.kind =
                                                        mode.random
                                                            ? blend::BlendSelection::Kind::kRandom
                                                            : blend::BlendSelection::Kind::
                                                                  kDeviation}},
               .seed = seed}));
      // A query selection's pass over the question counts as recomputed.
      *recomputed += res.recomputed_tokens + res.question_pass_tokens;
      logits = std::move(res.logits);
    }
    return DecodeLine(model, seq, tok, std::move(logits), max_tokens);
  };

  struct Tally {
    int n = 0, right = 0;
    int64_t prompt_tokens = 0, cached = 0, recomputed = 0;
  };
  // Per mode, per family (in FamilyRank order).
  std::vector<std::map<std::pair<int, std::string>, Tally>> tallies(modes.size());
  const auto t0 = Clock::now();
  for (size_t i = 0; i < examples->size(); ++i) {
    const Example& e = (*examples)[i];
    doc_kv.clear();
    seed = i + 1;
    const int64_t prompt_tokens =
        static_cast<int64_t>(tok.Encode(QaPrompt(e.documents, e.question), true).size());
    int64_t doc_tokens = 0;
    for (const std::string& d : e.documents) {
      doc_tokens += static_cast<int64_t>(tok.Encode(d + "\n", false).size());
    }
    for (size_t m = 0; m < modes.size(); ++m) {
      int64_t recomputed = 0;
      auto got = answer(e, modes[m], &recomputed);
      if (!got.ok()) {
        std::fprintf(stderr, "kdn-bench: example %zu, %s: %s\n", i, modes[m].name.c_str(),
                     got.status().ToString().c_str());
        return 1;
      }
      Tally& t = tallies[m][{FamilyRank(e.family), e.family}];
      ++t.n;
      t.right += Strip(*got) == e.answer;
      t.prompt_tokens += prompt_tokens;
      if (modes[m].ratio >= 0) t.cached += doc_tokens;
      t.recomputed += recomputed;
    }
    if ((i + 1) % 25 == 0 || i + 1 == examples->size()) {
      std::fprintf(stderr, "quality: %zu/%zu examples, %zu modes\n", i + 1, examples->size(),
                   modes.size());
    }
  }
  const double secs = Seconds(t0, Clock::now());
  std::printf("%-14s %-8s %9s %8s %14s %18s\n", "mode", "family", "examples", "exact",
              "prompt tokens", "cached recomputed");
  json rows = json::array();
  for (size_t m = 0; m < modes.size(); ++m) {
    for (const auto& [key, t] : tallies[m]) {
      const std::string& family = key.second;
      const double acc = static_cast<double>(t.right) / t.n;
      const double share = t.cached > 0 ? static_cast<double>(t.recomputed) / t.cached : 0;
      std::printf("%-14s %-8s %9d %7.1f%% %14.0f %17.1f%%\n", modes[m].name.c_str(), family.c_str(),
                  t.n, 100.0 * acc, static_cast<double>(t.prompt_tokens) / t.n, 100.0 * share);
      json row = {{"mode", modes[m].ratio < 0     ? "full_prefill"
                           : modes[m].ratio == 0  ? "full_reuse"
                           : modes[m].random      ? "random"
                           : modes[m].progressive ? "progressive"
                           : modes[m].selection   ? blend::BlendSelectionName(*modes[m].selection)
                                                  : "blend"},
                  {"family", family},
                  {"examples", t.n},
                  {"exact_match", acc},
                  {"mean_prompt_tokens", static_cast<double>(t.prompt_tokens) / t.n}};
      if (modes[m].ratio >= 0) {
        row["recompute_ratio"] = modes[m].ratio;
        row["recomputed_share"] = share;
      }
      rows.push_back(std::move(row));
    }
  }
  std::printf("(%.1f s)\n", secs);
  Emit(c, {{"workload", "quality"},
           {"model", what},
           {"eval", path},
           {"check_layer", check_layer},
           {"check_layers", check_layers},
           {"kv_codec", kvbus::CodecLevelName(*codec)},
           {"rows", rows},
           {"seconds", secs},
           {"machine", Machine(c)}});
  return 0;
}

}  // namespace kdn::bench
