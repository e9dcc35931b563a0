// kdn-bench quality: exact-match accuracy of a model on its question-answering
// eval set (models/kdn-qa/eval.jsonl, made by tools/train/corpus.py), through
// kdn's own engine, by the number of documents a question needs (hops).
//
// Each example is {"documents": [...], "question", "answer", "hops"}; the
// prompt is BOS + each document and "\n" + "Question: " + question +
// "\nAnswer:", decoded greedily until "\n"; the text, stripped, must equal
// the answer. Modes: full prefill (the reference). Blend modes join when
// CacheBlend exists.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>

#include "bench_util.h"
#include "kdn/engine/generate.h"
#include "kdn/engine/tokenizer.h"

namespace kdn::bench {

namespace {

struct Example {
  std::vector<std::string> documents;
  std::string question;
  std::string answer;
  int hops = 1;
};

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
    e.hops = j.value("hops", 1);
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

}  // namespace

std::string QaPrompt(const std::vector<std::string>& documents, const std::string& question) {
  std::string p;
  for (const std::string& d : documents) p += d + "\n";
  return p + "Question: " + question + "\nAnswer:";
}

int RunQuality(const Common& c, const std::string& eval_path, int limit, int max_tokens) {
  if (c.model_dir.empty()) {
    std::fprintf(stderr, "kdn-bench quality: give --model (e.g. models/kdn-qa)\n");
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
  auto model = MakeModel(c, 4096, &what);
  auto tok = engine::Tokenizer::Load(c.model_dir);
  if (!model.ok() || !tok.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n",
                 (!model.ok() ? model.status() : tok.status()).ToString().c_str());
    return 1;
  }
  std::printf("quality of %s on %s (%zu examples), full prefill, greedy\n", what.c_str(),
              path.c_str(), examples->size());
  struct Tally {
    int n = 0, right = 0;
    int64_t prompt_tokens = 0;
  };
  std::map<int, Tally> by_hops;
  const auto t0 = Clock::now();
  for (size_t i = 0; i < examples->size(); ++i) {
    const Example& e = (*examples)[i];
    const std::vector<int32_t> prompt = (*tok)->Encode(QaPrompt(e.documents, e.question), true);
    engine::GenerateOptions g;
    g.max_tokens = max_tokens;
    g.sampling.temperature = 0;
    if ((*tok)->eos_id() >= 0) g.stop_ids.push_back((*tok)->eos_id());
    std::string text;
    g.on_token = [&](int32_t t) {
      text += (*tok)->Decode(std::span<const int32_t>(&t, 1));
      return text.find('\n') == std::string::npos;
    };
    auto res = engine::Generate(**model, prompt, g);
    if (!res.ok()) {
      std::fprintf(stderr, "kdn-bench: example %zu: %s\n", i, res.status().ToString().c_str());
      return 1;
    }
    const std::string got = Strip(text.substr(0, text.find('\n')));
    Tally& t = by_hops[e.hops];
    ++t.n;
    t.right += got == e.answer;
    t.prompt_tokens += static_cast<int64_t>(prompt.size());
    if ((i + 1) % 50 == 0) {
      std::fprintf(stderr, "quality: %zu/%zu examples\n", i + 1, examples->size());
    }
  }
  const double secs = Seconds(t0, Clock::now());
  std::printf("%6s %8s %10s %14s\n", "hops", "examples", "exact", "prompt tokens");
  json rows = json::array();
  for (const auto& [hops, t] : by_hops) {
    const double acc = static_cast<double>(t.right) / t.n;
    std::printf("%6d %8d %9.1f%% %14.0f\n", hops, t.n, 100.0 * acc,
                static_cast<double>(t.prompt_tokens) / t.n);
    rows.push_back({{"mode", "full_prefill"}, {"hops", hops}, {"examples", t.n},
                    {"exact_match", acc}, {"mean_prompt_tokens", static_cast<double>(t.prompt_tokens) / t.n}});
  }
  std::printf("(%.1f s)\n", secs);
  Emit(c, {{"workload", "quality"}, {"model", what}, {"eval", path}, {"rows", rows},
           {"seconds", secs}, {"machine", Machine(c)}});
  return 0;
}

}  // namespace kdn::bench
