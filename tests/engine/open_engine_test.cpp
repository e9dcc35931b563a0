// OpenEngine: device names, the CPU backend through it, and a clear refusal
// of a GPU that is not there (no device on this machine, no ordinal 99, or a
// build without CUDA), before any weights are read.
#include <gtest/gtest.h>

#include "kdn/engine/open_engine.h"
#include "kdn/engine/presets.h"
#include "kdn/testing/temp_dir.h"
#include "kdn/testing/tiny_model.h"

namespace kdn::engine {
namespace {

using kdn::testing::TempDir;
using testing::MakeModel;
using testing::RandomTokens;

TEST(ParseDevice, NamesTheBackendAndOrdinal) {
  auto cpu = ParseDevice("cpu");
  ASSERT_TRUE(cpu.ok());
  EXPECT_FALSE(cpu->cuda());
  EXPECT_EQ(cpu->ToString(), "cpu");
  auto cuda = ParseDevice("cuda");
  ASSERT_TRUE(cuda.ok());
  EXPECT_TRUE(cuda->cuda());
  EXPECT_EQ(cuda->ToString(), "cuda:0");
  auto three = ParseDevice("cuda:3");
  ASSERT_TRUE(three.ok());
  EXPECT_EQ(three->index, 3);
  EXPECT_EQ(three->ToString(), "cuda:3");
  for (const char* bad : {"", "gpu", "CPU", "cuda:", "cuda:-1", "cuda:1x", "cuda:0:1", "cuda 0"}) {
    auto d = ParseDevice(bad);
    EXPECT_FALSE(d.ok()) << bad;
    if (!d.ok()) {
      EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument) << bad;
    }
  }
}

TEST(OpenEngine, LoadsAFolderOnTheCpu) {
  TempDir dir;
  const Preset p = FindPreset("tiny").value();
  const model::ModelConfig& c = p.config;
  ASSERT_TRUE(WriteModelFolder(dir.path(), c, 3, p.dtype).ok());
  // Widened to f32 at load: the model MakeModel builds from the same values.
  auto e =
      OpenEngine(dir.path(), {.kv_tokens = 256, .threads = 1, .weights_dtype = WeightsDType::kF32});
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ((*e)->device(), "cpu");
  EXPECT_EQ((*e)->kv_dtype(), DType::kF32);
  EXPECT_GE((*e)->kv_cache().num_blocks() * kKvBlockTokens, 256);
  // The same model as CpuEngine::Load gives.
  auto ref = MakeModel("tiny", 3);
  KvSequence a = (*e)->kv_cache().NewSequence(), b = ref->kv_cache().NewSequence();
  std::vector<float> la, lb;
  const std::vector<int32_t> tokens = RandomTokens(20, c.vocab_size, 5);
  ASSERT_TRUE((*e)->Prefill(a, tokens, {}, &la).ok());
  ASSERT_TRUE(ref->Prefill(b, tokens, {}, &lb).ok());
  EXPECT_EQ(la, lb);
  // Kept bf16 (the default): the same values, summed in another order.
  auto native = OpenEngine(dir.path(), {.kv_tokens = 256, .threads = 1});
  ASSERT_TRUE(native.ok()) << native.status().ToString();
  KvSequence n = (*native)->kv_cache().NewSequence();
  std::vector<float> ln;
  ASSERT_TRUE((*native)->Prefill(n, tokens, {}, &ln).ok());
  EXPECT_LT(testing::RelError(ln.data(), lb.data(), lb.size()), 1e-5);
}

TEST(OpenEngine, RefusesBadOptions) {
  TempDir dir;
  ASSERT_TRUE(WriteModelFolder(dir.path(), FindPreset("tiny").value().config, 3, DType::kF32).ok());
  EXPECT_EQ(OpenEngine(dir.path(), {.kv_tokens = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OpenEngine(dir.path(), {.gpu_mem_fraction = 1.5}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(OpenEngine, ACudaDeviceThatIsNotThereIsAClearError) {
  TempDir dir;
  ASSERT_TRUE(WriteModelFolder(dir.path(), FindPreset("tiny").value().config, 3, DType::kF32).ok());
  auto e = OpenEngine(dir.path(), {.device = {Device::Kind::kCuda, 99}, .kv_tokens = 256});
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kFailedPrecondition);
  const std::string& m = e.status().message();
  const bool says_why = m.find("no CUDA device is visible") != std::string::npos ||
                        m.find("no device 99") != std::string::npos ||
                        m.find("no CUDA backend") != std::string::npos;
  EXPECT_TRUE(says_why) << m;
}

}  // namespace
}  // namespace kdn::engine
