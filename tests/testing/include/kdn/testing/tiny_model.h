#pragma once
// Small generated models for tests, and comparisons of their outputs.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/cpu_engine.h"
#include "kdn/engine/presets.h"

namespace kdn::testing {

// A model built in memory from an engine preset (kdn/engine/presets.h), its
// weights drawn from `seed`; no files. One thread unless `options` says
// otherwise (tests run side by side). A failure is a test failure and null.
std::unique_ptr<engine::CpuEngine> MakeModel(const std::string& preset, uint64_t seed = 7,
                                             engine::EngineOptions options = {});

// A model folder of `preset` in `dir` (config, tokenizer, weights from
// seed 1), as kdn-mkmodel writes it: what a worker is started on.
Status WriteTinyModel(const std::filesystem::path& dir, const std::string& preset = "tiny");

// `n` token ids below `vocab`, drawn from `seed`.
std::vector<int32_t> RandomTokens(int n, int vocab, uint32_t seed);

// max |a - b| / max |b|: the error relative to the scale of the reference.
double RelError(const float* a, const float* b, size_t n);
// max |a - b| (a size mismatch is a test failure).
float MaxDiff(const std::vector<float>& a, const std::vector<float>& b);

// A question's logits over `seq`, one row per token (one prefill of its
// rows), then three decode steps' (tokens 5, 6, 7): what a model answers
// over KV, by both of the CPU engine's kinds of row.
std::vector<float> AnswerOver(engine::CpuEngine& model, engine::KvSequence& seq,
                              const std::vector<int32_t>& question);

// A test name for a preset parameter ("tiny-qwen2" -> "tiny_qwen2").
struct PresetTestName {
  template <typename Param>
  std::string operator()(const ::testing::TestParamInfo<Param>& info) const {
    std::string s = info.param;
    for (char& ch : s) {
      if (ch == '-') ch = '_';
    }
    return s;
  }
};

}  // namespace kdn::testing
