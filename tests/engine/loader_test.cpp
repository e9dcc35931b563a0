// Loading model folders: what kdn-mkmodel writes loads back exactly, sharded
// folders load, and every broken folder is a Status naming file and tensor.
#include <gtest/gtest.h>

#include <fstream>

#include "kdn/engine/cpu_engine.h"
#include "kdn/engine/safetensors.h"
#include "kdn/engine/weights.h"
#include "kdn/engine/presets.h"
#include "kdn/testing/temp_dir.h"

namespace kdn::engine {
namespace {

using kdn::testing::TempDir;

model::ModelConfig TinyConfig() { return FindPreset("tiny").value().config; }

void WriteFile(const std::filesystem::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void ExpectMentions(const Status& st, std::initializer_list<std::string> words) {
  EXPECT_FALSE(st.ok());
  for (const std::string& w : words) {
    EXPECT_NE(st.message().find(w), std::string::npos)
        << "\"" << w << "\" not in: " << st.message();
  }
}

class LoaderDTypeTest : public ::testing::TestWithParam<DType> {};

TEST_P(LoaderDTypeTest, LoadsExactlyWhatMkmodelWrote) {
  TempDir dir;
  const model::ModelConfig c = TinyConfig();
  ASSERT_TRUE(WriteModelFolder(dir.path(), c, 5, GetParam()).ok());
  auto cfg = model::LoadModelConfig(dir.path());
  ASSERT_TRUE(cfg.ok()) << cfg.status().ToString();
  auto loaded = LoadWeights(dir.path(), *cfg);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const ModelWeights expected = GenerateWeights(c, 5, GetParam());
  ASSERT_EQ(loaded->size(), expected.size());
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(loaded->count(name)) << name;
    EXPECT_EQ(loaded->at(name).shape, t.shape) << name;
    EXPECT_EQ(loaded->at(name).data, t.data) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, LoaderDTypeTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(Loader, MkmodelIsDeterministicForAPresetAndSeed) {
  TempDir a, b;
  ASSERT_TRUE(WriteModelFolder(a.path(), TinyConfig(), 9, DType::kBF16).ok());
  ASSERT_TRUE(WriteModelFolder(b.path(), TinyConfig(), 9, DType::kBF16).ok());
  EXPECT_TRUE(ReadFile(a.path() / "model.safetensors") == ReadFile(b.path() / "model.safetensors"));
  TempDir c;
  ASSERT_TRUE(WriteModelFolder(c.path(), TinyConfig(), 10, DType::kBF16).ok());
  EXPECT_FALSE(ReadFile(a.path() / "model.safetensors") ==
               ReadFile(c.path() / "model.safetensors"));
}

TEST(Loader, LoadsShardedSafetensorsThroughTheIndex) {
  TempDir dir;
  const model::ModelConfig c = TinyConfig();
  ASSERT_TRUE(WriteModelFolder(dir.path(), c, 5, DType::kF32).ok());
  std::filesystem::remove(dir.path() / "model.safetensors");
  // Two shards: the embedding alone, then everything else.
  const ModelWeights w = GenerateWeights(c, 5, DType::kF32);
  std::string index = "{\"metadata\": {}, \"weight_map\": {";
  SafetensorsWriter s1(dir.path() / "model-00001-of-00002.safetensors");
  SafetensorsWriter s2(dir.path() / "model-00002-of-00002.safetensors");
  bool first = true;
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    const bool one = spec.name == "model.embed_tokens.weight";
    (one ? s1 : s2).Declare(spec.name, DType::kF32, spec.shape);
    index += std::string(first ? "" : ",") + "\"" + spec.name + "\": \"model-0000" +
             (one ? "1" : "2") + "-of-00002.safetensors\"";
    first = false;
  }
  WriteFile(dir.path() / "model.safetensors.index.json", index + "}}");
  ASSERT_TRUE(s1.Begin().ok());
  ASSERT_TRUE(s2.Begin().ok());
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    const auto& t = w.at(spec.name);
    ASSERT_TRUE((spec.name == "model.embed_tokens.weight" ? s1 : s2)
                    .Append(t.data.data(), t.data.size())
                    .ok());
  }
  ASSERT_TRUE(s1.Finish().ok());
  ASSERT_TRUE(s2.Finish().ok());
  auto model = CpuEngine::Load(dir.path());
  ASSERT_TRUE(model.ok()) << model.status().ToString();
}

TEST(Loader, MissingFolderNamesConfigJson) {
  auto m = CpuEngine::Load("/nonexistent/kdn-model");
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  ExpectMentions(m.status(), {"/nonexistent/kdn-model/config.json"});
}

TEST(Loader, MissingWeightsFileNamesTheFolder) {
  TempDir dir;
  ASSERT_TRUE(WriteModelFolder(dir.path(), TinyConfig(), 1, DType::kBF16).ok());
  std::filesystem::remove(dir.path() / "model.safetensors");
  auto m = CpuEngine::Load(dir.path());
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  ExpectMentions(m.status(), {dir.path().string(), "model.safetensors"});
}

TEST(Loader, MissingTensorNamesFileAndTensor) {
  TempDir dir;
  const model::ModelConfig c = TinyConfig();
  ASSERT_TRUE(WriteModelFolder(dir.path(), c, 1, DType::kBF16).ok());
  SafetensorsWriter w(dir.path() / "model.safetensors");
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    if (spec.name != "model.layers.1.mlp.up_proj.weight")
      w.Declare(spec.name, DType::kBF16, spec.shape);
  }
  ASSERT_TRUE(w.Begin().ok());
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    if (spec.name == "model.layers.1.mlp.up_proj.weight") continue;
    std::vector<float> zeros(HostTensor{spec.shape, {}}.numel(), 0.0f);
    ASSERT_TRUE(w.Append(zeros.data(), zeros.size()).ok());
  }
  ASSERT_TRUE(w.Finish().ok());
  auto m = CpuEngine::Load(dir.path());
  EXPECT_EQ(m.status().code(), StatusCode::kNotFound);
  ExpectMentions(m.status(), {"model.safetensors", "model.layers.1.mlp.up_proj.weight"});
}

TEST(Loader, WrongShapeNamesTensorAndBothShapes) {
  TempDir dir;
  model::ModelConfig c = TinyConfig();
  ASSERT_TRUE(WriteModelFolder(dir.path(), c, 1, DType::kBF16).ok());
  // config.json now claims a wider MLP than the weights have.
  c.intermediate_size = 200;
  WriteFile(dir.path() / "config.json", model::ModelConfigToJson(c));
  auto m = CpuEngine::Load(dir.path());
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  ExpectMentions(m.status(), {"model.safetensors", "model.layers.0.mlp.gate_proj.weight",
                              "[176, 64]", "[200, 64]"});
}

TEST(Loader, TruncatedSafetensorsIsCorruptionNamingFileAndTensor) {
  TempDir dir;
  ASSERT_TRUE(WriteModelFolder(dir.path(), TinyConfig(), 1, DType::kBF16).ok());
  const auto path = dir.path() / "model.safetensors";
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 1000);
  auto m = CpuEngine::Load(dir.path());
  EXPECT_EQ(m.status().code(), StatusCode::kCorruption);
  ExpectMentions(m.status(), {path.string(), "truncated", "tensor \""});
}

TEST(Loader, FileCutInsideItsHeaderIsCorruption) {
  TempDir dir;
  ASSERT_TRUE(WriteModelFolder(dir.path(), TinyConfig(), 1, DType::kBF16).ok());
  const auto path = dir.path() / "model.safetensors";
  std::filesystem::resize_file(path, 100);
  auto m = CpuEngine::Load(dir.path());
  EXPECT_EQ(m.status().code(), StatusCode::kCorruption);
  ExpectMentions(m.status(), {path.string(), "header"});
  std::filesystem::resize_file(path, 3);
  EXPECT_EQ(CpuEngine::Load(dir.path()).status().code(), StatusCode::kCorruption);
}

TEST(Loader, GarbageHeaderIsCorruption) {
  TempDir dir;
  ASSERT_TRUE(WriteModelFolder(dir.path(), TinyConfig(), 1, DType::kBF16).ok());
  std::string bytes("\x10\0\0\0\0\0\0\0{not json at all", 24);
  WriteFile(dir.path() / "model.safetensors", bytes);
  auto m = CpuEngine::Load(dir.path());
  EXPECT_EQ(m.status().code(), StatusCode::kCorruption);
  ExpectMentions(m.status(), {"model.safetensors", "JSON"});
}

// Found by tests/fuzz/safetensors_fuzz.cpp: a shape whose size overflowed
// 64 bits wrapped to 0 bytes, which an empty data range matched, and a
// dimension past INT64_MAX became a negative one.
TEST(Loader, AShapeWhoseSizeOverflowsIsCorruption) {
  TempDir dir;
  for (const char* shape :
       {"[4611686018427387904,4]", "[9223372036854775808]", "[4294967296,4294967296]"}) {
    const std::string header =
        std::string(R"({"t":{"dtype":"F32","shape":)") + shape + R"(,"data_offsets":[0,0]}})";
    std::string bytes(8, '\0');
    bytes[0] = static_cast<char>(header.size());
    WriteFile(dir.path() / "x.safetensors", bytes + header);
    auto f = SafetensorsFile::Open(dir.path() / "x.safetensors");
    EXPECT_EQ(f.status().code(), StatusCode::kCorruption) << shape;
    ExpectMentions(f.status(), {"x.safetensors", "\"t\"", "shape"});
  }
}

TEST(Loader, UnknownArchitectureIsRefusedNamingIt) {
  TempDir dir;
  ASSERT_TRUE(WriteModelFolder(dir.path(), TinyConfig(), 1, DType::kBF16).ok());
  std::string cfg = ReadFile(dir.path() / "config.json");
  cfg.replace(cfg.find("LlamaForCausalLM"), 16, "GPT2LMHeadModel");
  WriteFile(dir.path() / "config.json", cfg);
  auto m = CpuEngine::Load(dir.path());
  EXPECT_EQ(m.status().code(), StatusCode::kUnimplemented);
  ExpectMentions(m.status(), {"config.json", "GPT2LMHeadModel", "not supported"});
}

TEST(Loader, UnsupportedDTypeNamesTensor) {
  TempDir dir;
  const std::string header =
      R"({"model.embed_tokens.weight":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}})";
  std::string bytes(8, '\0');
  bytes[0] = static_cast<char>(header.size());
  WriteFile(dir.path() / "x.safetensors", bytes + header + "ab");
  auto f = SafetensorsFile::Open(dir.path() / "x.safetensors");
  EXPECT_EQ(f.status().code(), StatusCode::kUnimplemented);
  ExpectMentions(f.status(), {"x.safetensors", "model.embed_tokens.weight", "I8"});
}

}  // namespace
}  // namespace kdn::engine
