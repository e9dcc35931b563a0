// libFuzzer harness for the GGUF reader and everything that reads a GGUF
// file (kdn/model/gguf.h, ModelConfigFromGguf, the GGUF tokenizer and chat
// template, LoadGgufWeights).
//
// The input is a .gguf file. GgufFile::Open must not crash, throw, hit
// undefined behaviour or allocate without bound, and a file it opens must
// describe every tensor truthfully: 1 to 4 positive dimensions, exactly the
// bytes its type's blocks imply, all inside the file. Every typed read of
// every key gives a value or a Status. The config, the tokenizer (which then
// encodes and decodes a text), the chat template and the weights read from
// the file give a value or a Status.
//
// Seeds: micro Llama models the gguf package writes (F32 and Q8_0 tensors,
// a gpt2 tokenizer with merges and a chat template; a llama tokenizer with
// scores): tests/fuzz/corpus/gguf, made by tests/fuzz/make_gguf_seeds.py.
//
// Built with clang's -fsanitize=fuzzer,address,undefined (tests/fuzz); the
// test `gguf_fuzz` (label fuzz) runs it over tests/fuzz/corpus/gguf.
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "kdn/engine/gguf_weights.h"
#include "kdn/engine/weights.h"
#include "kdn/model/config.h"
#include "kdn/model/gguf.h"
#include "kdn/text/chat_template.h"
#include "kdn/text/tokenizer.h"

using namespace kdn;
using kdn::fuzz::Check;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = fuzz::ScratchDir() / "model.gguf";
  fuzz::WriteFile(path, std::string_view(reinterpret_cast<const char*>(data), size));

  auto file = model::GgufFile::Open(path);
  if (!file.ok()) return 0;
  const model::GgufFile& f = **file;
  for (const model::GgufTensor& t : f.tensors()) {
    const model::GgmlTypeInfo* info = model::FindGgmlType(t.type);
    Check(info != nullptr, "a known type");
    Check(!t.dims.empty() && t.dims.size() <= 4, "1 to 4 dimensions");
    uint64_t bytes = 0;
    for (size_t d = 0; d < t.dims.size(); ++d) {
      Check(t.dims[d] > 0, "positive dimensions");
      if (d == 0) {
        Check(t.dims[0] % info->block_elements == 0, "rows of whole blocks");
        Check(!__builtin_mul_overflow(static_cast<uint64_t>(t.dims[0] / info->block_elements),
                                      static_cast<uint64_t>(info->block_bytes), &bytes),
              "a row size that fits in 64 bits");
      } else {
        Check(!__builtin_mul_overflow(bytes, static_cast<uint64_t>(t.dims[d]), &bytes),
              "a size that fits in 64 bits");
      }
    }
    Check(bytes == t.bytes, "exactly the bytes the type and shape imply");
    Check(t.bytes <= size, "no larger than the file");
    uint8_t sum = 0;
    for (size_t i = 0; i < t.bytes; ++i) sum ^= t.data[i];
    (void)sum;
  }
  for (const auto& [key, value] : f.metadata()) {
    (void)f.Int(key);
    (void)f.Float(key);
    (void)f.Bool(key);
    (void)f.String(key);
    (void)f.Strings(key);
    (void)f.Ints(key);
    (void)f.Floats(key);
  }

  auto config = model::ModelConfigFromGguf(f);
  if (config.ok()) {
    auto weights = engine::LoadGgufWeights(f, *config);
    if (weights.ok()) {
      for (const auto& spec : engine::ExpectedTensors(*config)) {
        auto it = weights->find(spec.name);
        Check(it != weights->end() && it->second.shape == spec.shape, "every tensor, at its shape");
      }
    }
  }
  auto tok = text::Tokenizer::Load(path);
  if (tok.ok()) {
    const auto ids = (*tok)->Encode("Hi <|im_start|> 12345 caf\xc3\xa9 \xf0\x9f\x99\x82", true);
    (void)(*tok)->Decode(ids);
  }
  auto chat = text::ChatTemplate::Load(path, model::Architecture::kLlama);
  if (chat.ok()) (void)chat->Render({{"user", "hello"}});
  return 0;
}
