// Test-only: what kdn reads from a GGUF file, for test_gguf.py to compare
// with the `gguf` package and transformers.
//   kdn_gguf_dump --types               {"Q4_1": [32, 20], ...}: the block sizes kdn knows
//   kdn_gguf_dump --config FILE         the ModelConfig read, as config.json text
//   kdn_gguf_dump --weights FILE        loads every weight through LoadWeights; prints "ok"
//   kdn_gguf_dump FILE OUT_DIR NAME...  each tensor NAME dequantized (ggml's order,
//                                       nothing permuted) to OUT_DIR/NAME.f32
// A Status is printed on stderr with exit code 1.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdn/engine/gguf_weights.h"
#include "kdn/engine/weights.h"
#include "kdn/model/config.h"
#include "kdn/model/gguf.h"

namespace {

int Fail(const kdn::Status& s) {
  std::fprintf(stderr, "%s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kdn;
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 1 && args[0] == "--types") {
    nlohmann::json j = nlohmann::json::object();
    for (uint32_t t = 0; t < 64; ++t) {
      if (const model::GgmlTypeInfo* info = model::FindGgmlType(t)) {
        j[info->name] = {t, info->block_elements, info->block_bytes};
      }
    }
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  if (args.size() == 2 && args[0] == "--config") {
    auto c = model::LoadModelConfig(args[1]);
    if (!c.ok()) return Fail(c.status());
    std::printf("%s\n", model::ModelConfigToJson(*c).c_str());
    return 0;
  }
  if (args.size() == 2 && args[0] == "--weights") {
    auto c = model::LoadModelConfig(args[1]);
    if (!c.ok()) return Fail(c.status());
    auto w = engine::LoadWeights(args[1], *c);
    if (!w.ok()) return Fail(w.status());
    std::printf("ok\n");
    return 0;
  }
  if (args.size() < 3) {
    std::fprintf(
        stderr,
        "usage: kdn_gguf_dump --types | --config FILE | --weights FILE | FILE OUT_DIR NAME...\n");
    return 2;
  }
  auto file = model::GgufFile::Open(args[0]);
  if (!file.ok()) return Fail(file.status());
  for (size_t i = 2; i < args.size(); ++i) {
    const model::GgufTensor* t = (*file)->FindTensor(args[i]);
    if (t == nullptr) return Fail(NotFound(args[i] + ": no such tensor"));
    std::vector<float> values(static_cast<size_t>(t->numel()));
    Status s = engine::DequantizeGguf(t->type, t->data, t->numel(), values.data());
    if (!s.ok()) return Fail(s);
    std::ofstream(args[1] + "/" + args[i] + ".f32", std::ios::binary)
        .write(reinterpret_cast<const char*>(values.data()),
               static_cast<std::streamsize>(values.size() * sizeof(float)));
  }
  return 0;
}
