// Test-only: kdn_forward MODEL_DIR IDS_CSV LOGITS_OUT GREEDY_N
// Prefills IDS (comma-separated token ids), writes the logits of every prompt
// position to LOGITS_OUT (float32, row-major [tokens][vocab]), then prints
// GREEDY_N greedy token ids (no stop token) comma-separated on stdout.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "kdn/engine/generate.h"
#include "kdn/engine/model.h"

int main(int argc, char** argv) {
  using namespace kdn::engine;
  if (argc != 5) {
    std::fprintf(stderr, "usage: kdn_forward MODEL_DIR IDS_CSV LOGITS_OUT GREEDY_N\n");
    return 2;
  }
  auto model = Model::Load(argv[1]);
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

  auto res = Generate(**model, ids, {.max_tokens = std::stoi(argv[4]), .sampling = {.temperature = 0.0f}});
  if (!res.ok()) {
    std::fprintf(stderr, "kdn_forward: %s\n", res.status().ToString().c_str());
    return 1;
  }
  for (size_t i = 0; i < res->tokens.size(); ++i) std::printf("%s%d", i ? "," : "", res->tokens[i]);
  std::printf("\n");
  return 0;
}
