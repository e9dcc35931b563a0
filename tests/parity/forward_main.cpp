// Test-only: kdn_forward MODEL_DIR IDS_CSV LOGITS_OUT GREEDY_N
//            kdn_forward --next MODEL PROMPTS LOGITS_OUT f32|native
//            kdn_forward --tokenize MODEL_DIR TEXT
// Prefills IDS (comma-separated token ids), writes the logits of every prompt
// position to LOGITS_OUT (float32, row-major [tokens][vocab]), then prints
// GREEDY_N greedy token ids (no stop token) comma-separated on stdout; the
// weights widened to f32, the arithmetic of transformers' fp32 reference.
// --next prefills each line of PROMPTS (comma-separated ids) in a fresh
// sequence, as a worker does, and writes the next-token logits of each
// ([prompts][vocab]), with the weights as the last argument says.
// --tokenize prints the ids of TEXT (no BOS) and the text decoded back.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "kdn/engine/generate.h"
#include "kdn/engine/cpu_runtime.h"
#include "kdn/engine/cpu_engine.h"
#include "kdn/text/tokenizer.h"

int main(int argc, char** argv) {
  using namespace kdn::engine;
  kdn::engine::PrepareCpuRuntime(argv);
  if (argc == 4 && std::string(argv[1]) == "--tokenize") {
    auto tok = kdn::text::Tokenizer::Load(argv[2]);
    if (!tok.ok()) {
      std::fprintf(stderr, "kdn_forward: %s\n", tok.status().ToString().c_str());
      return 1;
    }
    const auto ids = (*tok)->Encode(argv[3], false);
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? "," : "", ids[i]);
    std::printf("\n%s", (*tok)->Decode(ids).c_str());
    return 0;
  }
  if (argc == 6 && std::string(argv[1]) == "--next") {
    auto dtype = ParseWeightsDType(argv[5]);
    if (!dtype.ok()) {
      std::fprintf(stderr, "kdn_forward: %s\n", dtype.status().ToString().c_str());
      return 2;
    }
    auto model = CpuEngine::Load(argv[2], {.weights_dtype = *dtype});
    if (!model.ok()) {
      std::fprintf(stderr, "kdn_forward: %s\n", model.status().ToString().c_str());
      return 1;
    }
    std::ifstream in(argv[3]);
    std::ofstream out(argv[4], std::ios::binary);
    for (std::string line; std::getline(in, line);) {
      if (line.empty()) continue;
      std::vector<int32_t> ids;
      std::stringstream ss(line);
      for (std::string item; std::getline(ss, item, ',');) ids.push_back(std::stoi(item));
      KvSequence seq = (*model)->kv_cache().NewSequence();
      std::vector<float> logits;
      kdn::Status st = (*model)->Prefill(seq, ids, {}, &logits);
      if (!st.ok()) {
        std::fprintf(stderr, "kdn_forward: %s\n", st.ToString().c_str());
        return 1;
      }
      out.write(reinterpret_cast<const char*>(logits.data()), logits.size() * sizeof(float));
    }
    return out ? 0 : 1;
  }
  if (argc != 5) {
    std::fprintf(stderr,
                 "usage: kdn_forward MODEL_DIR IDS_CSV LOGITS_OUT GREEDY_N\n"
                 "       kdn_forward --next MODEL PROMPTS LOGITS_OUT f32|native\n");
    return 2;
  }
  auto model = CpuEngine::Load(argv[1], {.weights_dtype = WeightsDType::kF32});
  if (!model.ok()) {
    std::fprintf(stderr, "kdn_forward: %s\n", model.status().ToString().c_str());
    return 1;
  }
  std::vector<int32_t> ids;
  std::stringstream ss(argv[2]);
  for (std::string item; std::getline(ss, item, ',');) ids.push_back(std::stoi(item));

  KvSequence seq = (*model)->kv_cache().NewSequence();
  std::vector<float> logits;
  kdn::Status st = (*model)->Prefill(seq, ids, {.all_logits = true}, &logits);
  if (!st.ok()) {
    std::fprintf(stderr, "kdn_forward: %s\n", st.ToString().c_str());
    return 1;
  }
  seq.Reset();
  std::ofstream(argv[3], std::ios::binary)
      .write(reinterpret_cast<const char*>(logits.data()), logits.size() * sizeof(float));

  auto res =
      Generate(**model, ids, {.max_tokens = std::stoi(argv[4]), .sampling = {.temperature = 0.0f}});
  if (!res.ok()) {
    std::fprintf(stderr, "kdn_forward: %s\n", res.status().ToString().c_str());
    return 1;
  }
  for (size_t i = 0; i < res->tokens.size(); ++i) std::printf("%s%d", i ? "," : "", res->tokens[i]);
  std::printf("\n");
  return 0;
}
