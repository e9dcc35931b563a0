// llama_logits_ref: llama.cpp's next-token logits on a GGUF file, the peer
// reference for kdn's CPU engine on the same file (tests/parity/
// test_llama_cpp_logits.py). Built by tests/parity/llama_cpp_refs/build.sh
// beside llama_tokenize_ref, against one static libllama and ggml CPU
// backend (never part of kdn's build).
//
//   llama_logits_ref MODEL.gguf THREADS PROMPTS OUT
//
// PROMPTS holds one prompt per line as comma-separated token ids (no BOS is
// added: the ids are the whole prompt). For each prompt, in a fresh context,
// llama.cpp decodes it in one batch and the logits of its last position
// (n_vocab floats, little-endian f32) are appended to OUT. llama.cpp's
// context defaults otherwise (f16 KV cache, flash attention auto).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

namespace {

void Quiet(ggml_log_level level, const char* text, void*) {
  if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

int Fail(const std::string& why) {
  std::fprintf(stderr, "llama_logits_ref: %s\n", why.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: llama_logits_ref MODEL.gguf THREADS PROMPTS OUT\n");
    return 2;
  }
  std::vector<std::vector<llama_token>> prompts;
  {
    std::ifstream in(argv[3]);
    if (!in) return Fail(std::string("cannot read ") + argv[3]);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      std::vector<llama_token> ids;
      std::stringstream ss(line);
      std::string id;
      while (std::getline(ss, id, ',')) ids.push_back(std::atoi(id.c_str()));
      prompts.push_back(std::move(ids));
    }
  }
  llama_log_set(Quiet, nullptr);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) return Fail(std::string("cannot load ") + argv[1]);
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  size_t longest = 1;
  for (const auto& p : prompts) longest = std::max(longest, p.size());

  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(longest + 16);
  cp.n_batch = cp.n_ctx;
  cp.n_ubatch = cp.n_ctx;
  cp.n_threads = cp.n_threads_batch = std::atoi(argv[2]);
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) return Fail("cannot create a context");

  std::ofstream out(argv[4], std::ios::binary);
  for (auto& p : prompts) {
    if (p.empty()) return Fail("an empty prompt");
    llama_memory_clear(llama_get_memory(ctx), true);
    if (llama_decode(ctx, llama_batch_get_one(p.data(), static_cast<int32_t>(p.size()))) != 0) {
      return Fail("llama_decode failed");
    }
    const float* logits = llama_get_logits_ith(ctx, -1);
    out.write(reinterpret_cast<const char*>(logits), sizeof(float) * n_vocab);
  }
  if (!out) return Fail(std::string("cannot write ") + argv[4]);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
