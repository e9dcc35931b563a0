// libFuzzer harness for the safetensors reader and the weights loader
// (kdn/engine/safetensors.h, kdn/engine/weights.h).
//
// The input is a model.safetensors file. SafetensorsFile::Open must not
// crash, throw or hit undefined behaviour, and a file it opens must describe
// every tensor truthfully: no negative dimension, and exactly the bytes its
// shape and dtype imply (no overflow), all readable. LoadWeights over the
// file, for a one-layer model whose tensors the seeds hold, must then give
// every tensor at its config's shape, or a Status.
//
// Seeds: that model's tensors in each dtype, written by the reader's own
// writer (KDN_FUZZ_WRITE_SEEDS=DIR build/bin/kdn_safetensors_fuzz).
//
// Built with clang's -fsanitize=fuzzer,address,undefined (tests/fuzz); the
// test `safetensors_fuzz` (label fuzz) runs it over
// tests/fuzz/corpus/safetensors.
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "kdn/engine/safetensors.h"
#include "kdn/engine/weights.h"

using namespace kdn;
using kdn::fuzz::Check;

namespace {

model::ModelConfig MicroConfig() {
  model::ModelConfig c;
  c.vocab_size = 6;
  c.hidden_size = 4;
  c.intermediate_size = 6;
  c.num_layers = 1;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 2;
  c.qkv_bias = true;
  c.max_context = 16;
  return c;
}

std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  const auto dir = fuzz::ScratchDir();
  for (engine::DType dt : {engine::DType::kF32, engine::DType::kBF16, engine::DType::kF16}) {
    const auto path = dir / "seed.safetensors";
    engine::SafetensorsWriter w(path);
    const auto specs = engine::ExpectedTensors(MicroConfig());
    for (const auto& s : specs) w.Declare(s.name, dt, s.shape);
    w.Declare("unused.scalar", dt, {});
    Check(w.Begin().ok(), "writer Begin");
    float v = 0.25f;
    for (const auto& s : specs) {
      int64_t n = 1;
      for (int64_t d : s.shape) n *= d;
      std::vector<float> values(n);
      for (float& x : values) x = (v = -v * 1.5f + 0.125f);
      Check(w.Append(values.data(), values.size()).ok(), "writer Append");
    }
    const float one = 1;
    Check(w.Append(&one, 1).ok(), "writer Append");
    Check(w.Finish().ok(), "writer Finish");
    seeds.push_back(fuzz::ReadFile(path));
  }
  return seeds;
}

// a * b, false on overflow.
bool Mul(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::WriteSeedsIfAsked(Seeds());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto dir = fuzz::ScratchDir() / "model";
  std::filesystem::create_directories(dir);
  const auto path = dir / "model.safetensors";
  fuzz::WriteFile(path, std::string_view(reinterpret_cast<const char*>(data), size));

  auto file = engine::SafetensorsFile::Open(path);
  if (!file.ok()) return 0;
  for (const auto& [name, e] : (*file)->tensors()) {
    uint64_t bytes = engine::DTypeSize(e.dtype);
    for (int64_t d : e.shape) {
      Check(d >= 0, "no negative dimension");
      Check(Mul(bytes, static_cast<uint64_t>(d), &bytes), "a shape whose size fits in 64 bits");
    }
    Check(bytes == e.bytes, "exactly the bytes the shape and dtype imply");
    Check(e.bytes <= size, "inside the file");
    uint8_t sum = 0;
    for (size_t i = 0; i < e.bytes; ++i) sum ^= e.data[i];
    (void)sum;
  }

  const model::ModelConfig c = MicroConfig();
  auto w = engine::LoadWeights(dir, c);
  if (!w.ok()) return 0;
  for (const auto& spec : engine::ExpectedTensors(c)) {
    auto it = w->find(spec.name);
    Check(it != w->end(), "every expected tensor");
    Check(it->second.shape == spec.shape, "at its config's shape");
    Check(static_cast<int64_t>(it->second.data.size()) == it->second.numel(), "with its values");
  }
  return 0;
}
