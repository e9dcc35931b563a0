// The model fingerprint that chunk keys cover (kvbridge/fingerprint.h).
#include "kdn/kvbridge/fingerprint.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kdn/testing/temp_dir.h"
#include "kdn/engine/presets.h"

namespace kdn::kvbridge {
namespace {

using kdn::testing::TempDir;
using kvbus::ChunkKey;

std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(ModelFingerprint, MatchesTheSpecsGoldenVectorForTheTinyPreset) {
  // docs/kvbus.md lists the canonical text this hashes.
  auto p = engine::FindPreset("tiny");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(ModelFingerprint(p->config, "BF16", "f32", 0x0123456789abcdefull).ToHex(),
            "1687497894cb9b8d42e8d8798f30e5d8");
}

TEST(ModelFingerprint, ChangesWithEveryFieldThatShapesTheKv) {
  auto p = engine::FindPreset("tiny");
  ASSERT_TRUE(p.ok());
  const model::ModelConfig base = p->config;
  const auto fp = [](const model::ModelConfig& c, std::string_view w = "BF16",
                     std::string_view kv = "f32",
                     uint64_t digest = 42) { return ModelFingerprint(c, w, kv, digest); };
  using Edit = std::pair<const char*, std::function<void(model::ModelConfig&)>>;
  const std::vector<Edit> edits = {
      {"architecture", [](auto& c) { c.architecture = model::Architecture::kMistral; }},
      {"vocab_size", [](auto& c) { c.vocab_size += 1; }},
      {"hidden_size", [](auto& c) { c.hidden_size *= 2; }},
      {"intermediate_size", [](auto& c) { c.intermediate_size += 16; }},
      {"num_layers", [](auto& c) { c.num_layers += 1; }},
      {"num_heads", [](auto& c) { c.num_heads *= 2; }},
      {"num_kv_heads", [](auto& c) { c.num_kv_heads = 1; }},
      {"head_dim", [](auto& c) { c.head_dim = 8; }},
      {"rms_norm_eps", [](auto& c) { c.rms_norm_eps = 1e-6; }},
      {"rope_theta", [](auto& c) { c.rope_theta = 500000.0; }},
      {"rope_scaling.type default",
       [](auto& c) { c.rope_scaling.type = model::RopeType::kDefault; }},
      {"rope_scaling.type linear", [](auto& c) { c.rope_scaling.type = model::RopeType::kLinear; }},
      {"rope_scaling.type yarn", [](auto& c) { c.rope_scaling.type = model::RopeType::kYarn; }},
      {"sliding_window",
       [](auto& c) {
         c.sliding_window = 64;
         c.windowed_layers.assign(c.num_layers, true);
       }},
      {"rope_scaling.factor", [](auto& c) { c.rope_scaling.factor = 8.0; }},
      {"rope_scaling.low_freq_factor", [](auto& c) { c.rope_scaling.low_freq_factor = 2.0; }},
      {"rope_scaling.high_freq_factor", [](auto& c) { c.rope_scaling.high_freq_factor = 8.0; }},
      {"rope_scaling.original_max",
       [](auto& c) { c.rope_scaling.original_max_position_embeddings = 256; }},
      {"qkv_bias", [](auto& c) { c.qkv_bias = true; }},
      {"o_bias", [](auto& c) { c.o_bias = true; }},
      {"tie_word_embeddings", [](auto& c) { c.tie_word_embeddings = false; }},
      // The smallest change a double can make.
      {"rope_theta + 1 ulp", [](auto& c) { c.rope_theta = std::nextafter(c.rope_theta, 1e9); }},
  };
  std::set<ChunkKey> seen{fp(base)};
  for (const auto& [what, edit] : edits) {
    model::ModelConfig c = base;
    edit(c);
    EXPECT_TRUE(seen.insert(fp(c)).second) << what << " does not change the fingerprint";
  }
  EXPECT_TRUE(seen.insert(fp(base, "F16")).second) << "weight dtype";
  EXPECT_TRUE(seen.insert(fp(base, "F32")).second) << "weight dtype";
  EXPECT_TRUE(seen.insert(fp(base, "BF16", "bf16")).second) << "kv dtype";
  EXPECT_TRUE(seen.insert(fp(base, "BF16", "f16")).second) << "kv dtype";
  EXPECT_TRUE(seen.insert(fp(base, "BF16", "f32", 43)).second) << "weights digest";
  EXPECT_TRUE(seen.insert(fp(base, "BF16", "f32", uint64_t{42} << 32)).second) << "weights digest";
}

TEST(ModelFingerprint, IgnoresFieldsThatDoNotShapeTheKv) {
  auto p = engine::FindPreset("tiny");
  ASSERT_TRUE(p.ok());
  model::ModelConfig c = p->config;
  const ChunkKey before = ModelFingerprint(c, "BF16", "f32", 1);
  c.max_context *= 2;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  c.torch_dtype = "float16";
  EXPECT_EQ(ModelFingerprint(c, "BF16", "f32", 1), before);
}

TEST(WeightsDigest, IsStableForOneSeedAndChangesWithTheSeed) {
  auto p = engine::FindPreset("tiny");
  ASSERT_TRUE(p.ok());
  TempDir a, b, c;
  ASSERT_TRUE(engine::WriteModelFolder(a.path(), p->config, 1, p->dtype).ok());
  ASSERT_TRUE(engine::WriteModelFolder(b.path(), p->config, 1, p->dtype).ok());
  ASSERT_TRUE(engine::WriteModelFolder(c.path(), p->config, 2, p->dtype).ok());
  auto da = WeightsDigest(a.path()), db = WeightsDigest(b.path()), dc = WeightsDigest(c.path());
  ASSERT_TRUE(da.ok()) << da.status().ToString();
  ASSERT_TRUE(db.ok() && dc.ok());
  EXPECT_EQ(*da, *db);
  EXPECT_NE(*da, *dc);
  auto again = WeightsDigest(a.path());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *da);
  // The spec: XXH3-64, seed 0, over the one file's bytes.
  const std::string bytes = ReadFile(a.path() / "model.safetensors");
  EXPECT_EQ(*da, XXH3_64bits(bytes.data(), bytes.size()));
}

TEST(WeightsDigest, HashesSafetensorsFilesInNameOrderAndNothingElse) {
  TempDir d;
  const auto write = [&](const char* name, const std::string& text) {
    std::ofstream(d.path() / name, std::ios::binary) << text;
  };
  write("model-00002-of-00002.safetensors", "second");
  write("model-00001-of-00002.safetensors", "first-");
  write("model.safetensors.index.json", "{}");
  write("config.json", "{}");
  auto digest = WeightsDigest(d.path());
  ASSERT_TRUE(digest.ok()) << digest.status().ToString();
  EXPECT_EQ(*digest, XXH3_64bits("first-second", 12));
  write("config.json", "{\"changed\": true}");
  auto same = WeightsDigest(d.path());
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(*same, *digest);
}

TEST(WeightsDigest, FolderWithoutWeightsIsNotFound) {
  TempDir d;
  EXPECT_EQ(WeightsDigest(d.path()).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(WeightsDigest(d.path() / "missing").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kdn::kvbridge
