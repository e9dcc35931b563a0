// kdn-mkmodel: writes a generated model folder (config.json, model.safetensors,
// tokenizer files) from a preset and a seed. Same preset and seed, same bytes.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <CLI/CLI.hpp>

#include "kdn/engine/presets.h"

int main(int argc, char** argv) {
  using namespace kdn::engine;
  CLI::App app{"Write a deterministic generated model folder in the Hugging Face layout."};
  std::string preset_name, out, dtype_name;
  uint64_t seed = 0;
  bool list = false, config_only = false;
  app.add_flag("--list", list, "List the presets and exit");
  app.add_flag("--config-only", config_only,
               "Write only config.json (the shape, for a peer such as bench/hf_peer.py)");
  app.add_option("--preset", preset_name, "Preset name (see --list)");
  app.add_option("--seed", seed, "Seed of the weights")->capture_default_str();
  app.add_option("--out", out, "Folder to write (created if missing)");
  app.add_option("--dtype", dtype_name, "Stored dtype: bf16, fp16 or fp32 (default: the preset's)")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  CLI11_PARSE(app, argc, argv);

  if (list) {
    for (const Preset& p : Presets()) {
      std::printf("%-14s %6.1fM params  %s\n", p.name.c_str(), p.config.ParameterCount() / 1e6,
                  p.description.c_str());
    }
    return 0;
  }
  if (preset_name.empty() || out.empty()) {
    std::fprintf(stderr, "kdn-mkmodel: --preset and --out are required (see --help, --list)\n");
    return 2;
  }
  auto preset = FindPreset(preset_name);
  if (!preset.ok()) {
    std::fprintf(stderr, "kdn-mkmodel: %s\n", preset.status().message().c_str());
    return 2;
  }
  DType dtype = preset->dtype;
  if (dtype_name == "bf16") dtype = DType::kBF16;
  if (dtype_name == "fp16") dtype = DType::kF16;
  if (dtype_name == "fp32") dtype = DType::kF32;

  if (config_only) {
    std::error_code ec;
    std::filesystem::create_directories(out, ec);
    std::ofstream f(std::filesystem::path(out) / "config.json");
    f << kdn::model::ModelConfigToJson(preset->config);
    if (ec || !f.good()) {
      std::fprintf(stderr, "kdn-mkmodel: cannot write %s/config.json\n", out.c_str());
      return 1;
    }
    std::printf("wrote %s/config.json: preset %s\n", out.c_str(), preset_name.c_str());
    return 0;
  }
  const bool tty = isatty(fileno(stderr));
  int last_pct = -1;
  auto progress = [&](int64_t done, int64_t total) {
    // Every percent on a terminal (one line, redrawn), every 10% in a log.
    const int step = tty ? 1 : 10;
    const int pct = static_cast<int>(100 * done / std::max<int64_t>(total, 1)) / step * step;
    if (pct != last_pct && total > (64 << 20)) {
      last_pct = pct;
      std::fprintf(stderr,
                   tty ? "\rkdn-mkmodel: %3d%% of %.1f GB" : "kdn-mkmodel: %3d%% of %.1f GB\n", pct,
                   total / 1e9);
    }
  };
  kdn::Status st = WriteModelFolder(out, preset->config, seed, dtype, progress);
  if (last_pct >= 0 && tty) std::fprintf(stderr, "\n");
  if (!st.ok()) {
    std::fprintf(stderr, "kdn-mkmodel: %s\n", st.ToString().c_str());
    return 1;
  }
  std::printf("wrote %s: preset %s, seed %llu, %s, %.1fM parameters\n", out.c_str(),
              preset_name.c_str(), static_cast<unsigned long long>(seed), DTypeName(dtype),
              preset->config.ParameterCount() / 1e6);
  return 0;
}
