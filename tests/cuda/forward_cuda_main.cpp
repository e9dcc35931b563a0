// Test-only: kdn_forward_cuda MODEL_DIR IDS_CSV LOGITS_OUT GREEDY_N
// The GPU twin of tests/parity/forward_main.cpp: prefills IDS on CudaEngine
// (bf16), writes the logits of every prompt position (float32, [tokens][vocab])
// to LOGITS_OUT, then prints GREEDY_N greedy token ids comma-separated.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "kdn/engine/cuda/cuda_engine.h"
#include "kdn/engine/sampler.h"

int main(int argc, char** argv) {
  using namespace kdn::engine;
  if (argc != 5) {
    std::fprintf(stderr, "usage: kdn_forward_cuda MODEL_DIR IDS_CSV LOGITS_OUT GREEDY_N\n");
    return 2;
  }
  auto fail = [](const kdn::Status& st) {
    std::fprintf(stderr, "kdn_forward_cuda: %s\n", st.ToString().c_str());
    return 1;
  };
  std::vector<int32_t> ids;
  std::stringstream ss(argv[2]);
  for (std::string item; std::getline(ss, item, ',');) ids.push_back(std::stoi(item));
  auto cfg = kdn::model::LoadModelConfig(argv[1]);
  if (!cfg.ok()) return fail(cfg.status());
  auto weights = LoadWeights(argv[1], *cfg);
  if (!weights.ok()) return fail(weights.status());
  cuda::CudaEngineOptions o;
  o.kv_tokens = static_cast<int64_t>(ids.size()) + 256;
  o.max_prefill_tokens = static_cast<int64_t>(ids.size());
  o.max_batch = 1;
  auto model = cuda::CudaEngine::Create(*cfg, *weights, o);
  if (!model.ok()) return fail(model.status());
  KvSequence seq = (*model)->kv_cache().NewSequence();
  std::vector<float> logits;
  if (auto st = (*model)->Prefill(seq, ids, {.all_logits = true}, &logits); !st.ok())
    return fail(st);
  std::ofstream(argv[3], std::ios::binary)
      .write(reinterpret_cast<const char*>(logits.data()), logits.size() * sizeof(float));
  const int n = std::stoi(argv[4]);
  std::vector<float> last(logits.end() - cfg->vocab_size, logits.end());
  for (int i = 0; i < n; ++i) {
    int32_t t = Argmax(last);
    std::printf("%s%d", i ? "," : "", t);
    KvSequence* s = &seq;
    if (auto st = (*model)->DecodeStep({&s, 1}, {&t, 1}, &last); !st.ok()) return fail(st);
  }
  std::printf("\n");
  return 0;
}
