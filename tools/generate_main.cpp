// kdn-generate: the engine alone, one process, no network. Loads a model
// folder, runs a prompt, prints the continuation (stdout) and timings (stderr).
#include <cstdio>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>

#include "kdn/engine/generate.h"
#include "kdn/engine/cpu_runtime.h"
#include "kdn/engine/open_engine.h"
#include "kdn/text/output_text.h"
#include "kdn/text/tokenizer.h"

int main(int argc, char** argv) {
  using namespace kdn::engine;
  kdn::engine::PrepareCpuRuntime(argv);
  CLI::App app{"Run a prompt through the kdn engine, on the CPU or a GPU, in one process."};
  std::string model_dir, prompt, prompt_ids;
  GenerateOptions gen;
  gen.sampling.temperature = 0.0f;
  bool no_bos = false, print_ids = false, ignore_eos = false;
  int threads = 0;
  std::string device = "cpu";
  app.add_option("--model", model_dir,
                 "Model folder (config.json, *.safetensors, tokenizer.json) or a .gguf file")
      ->required();
  auto* p = app.add_option("--prompt", prompt, "Prompt text");
  app.add_option("--prompt-ids", prompt_ids,
                 "Prompt as comma-separated token ids (instead of --prompt)")
      ->excludes(p);
  app.add_option("--max-tokens", gen.max_tokens, "Tokens to generate")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--temperature", gen.sampling.temperature, "0 = greedy")->capture_default_str();
  app.add_option("--top-k", gen.sampling.top_k, "0 = off")->capture_default_str();
  app.add_option("--top-p", gen.sampling.top_p, "1 = off")->capture_default_str();
  app.add_option("--seed", gen.sampling.seed, "Sampling seed")->capture_default_str();
  app.add_option("--device", device, "Where the engine runs: cpu, cuda (device 0) or cuda:N")
      ->capture_default_str();
  app.add_option("--threads", threads, "CPU threads (0 = all cores)")->capture_default_str();
  app.add_flag("--no-bos", no_bos, "Do not prepend the BOS token");
  app.add_flag("--ignore-eos", ignore_eos, "Keep generating past the EOS token");
  app.add_flag("--print-ids", print_ids, "Print generated token ids instead of text");
  CLI11_PARSE(app, argc, argv);

  if (prompt.empty() && prompt_ids.empty()) {
    std::fprintf(stderr, "kdn-generate: give --prompt or --prompt-ids\n");
    return 2;
  }
  if (auto st = kdn::model::ValidateSamplingParams(gen.sampling); !st.ok()) {
    std::fprintf(stderr, "kdn-generate: %s\n", st.message().c_str());
    return 2;
  }
  auto dev = ParseDevice(device);
  if (!dev.ok()) {
    std::fprintf(stderr, "kdn-generate: --device: %s\n", dev.status().message().c_str());
    return 2;
  }
  auto tok = kdn::text::Tokenizer::Load(model_dir);
  if (!tok.ok()) {
    std::fprintf(stderr, "kdn-generate: %s\n", tok.status().ToString().c_str());
    return 1;
  }
  std::vector<int32_t> ids;
  if (!prompt_ids.empty()) {
    std::stringstream ss(prompt_ids);
    std::string item;
    while (std::getline(ss, item, ',')) {
      try {
        ids.push_back(std::stoi(item));
      } catch (...) {
        std::fprintf(stderr, "kdn-generate: --prompt-ids: \"%s\" is not a token id\n",
                     item.c_str());
        return 2;
      }
    }
  } else {
    ids = (*tok)->Encode(prompt, !no_bos);
  }
  // The KV pool holds the prompt and every token generated.
  OpenOptions opts{.device = *dev,
                   .kv_tokens = static_cast<int64_t>(ids.size()) + gen.max_tokens + kKvBlockTokens,
                   .threads = threads};
  opts.max_batch = 1;
  auto model = OpenEngine(model_dir, opts);
  if (!model.ok()) {
    std::fprintf(stderr, "kdn-generate: %s\n", model.status().ToString().c_str());
    return 1;
  }
  if (!ignore_eos) gen.stop_ids = kdn::text::ModelStopIds(**tok, (*model)->config());
  auto res = Generate(**model, ids, gen);
  if (!res.ok()) {
    std::fprintf(stderr, "kdn-generate: %s\n", res.status().ToString().c_str());
    return 1;
  }
  if (print_ids) {
    for (size_t i = 0; i < res->tokens.size(); ++i)
      std::printf("%s%d", i ? "," : "", res->tokens[i]);
    std::printf("\n");
  } else {
    std::printf("%s\n", (*tok)->Decode(res->tokens).c_str());
  }
  const size_t n = res->tokens.size();
  std::fprintf(stderr,
               "kdn-generate: prompt %zu tokens in %.3f s (%.1f tok/s); %zu tokens generated, "
               "%.1f tok/s decode; finish: %s\n",
               ids.size(), res->prefill_seconds, ids.size() / std::max(res->prefill_seconds, 1e-9),
               n, n > 1 ? (n - 1) / std::max(res->decode_seconds, 1e-9) : 0.0,
               res->finish_reason.c_str());
  return 0;
}
