// libFuzzer harness for kdn-router's OpenAI request validation
// (kdn/router/openai.h), serving models/kdn-qa's config and tokenizer.
//
// The first byte picks the endpoint (completions, chat completions, inject)
// and whether the served model has a document separator; the rest is the
// request body. Whatever the body, parsing must not crash, throw or hit
// undefined behaviour, and:
// - a refusal is a 4xx with a message;
// - an accepted request is one the workers can run: a non-empty prompt of
//   ids inside the vocabulary, max_tokens >= 1 with prompt and completion
//   inside the context, sampling parameters in range, stop strings
//   non-empty, and a blend plan (documents) whose head and segments lie
//   inside the prompt, each segment non-empty and the question after them
//   too, with check_layer one of the model's layers;
// - an accepted inject request has non-empty documents of ids inside the
//   vocabulary, each shorter than the context.
//
// Built with clang's -fsanitize=fuzzer,address,undefined (tests/fuzz); the
// test `openai_fuzz` (label fuzz) runs it over tests/fuzz/corpus/openai.
#include <cstdint>
#include <memory>
#include <string>

#include "fuzz_util.h"
#include "kdn/model/config.h"
#include "kdn/router/openai.h"
#include "kdn/text/tokenizer.h"

using namespace kdn;
using kdn::fuzz::Check;

namespace {

struct Served {
  model::ModelConfig config;
  std::unique_ptr<text::Tokenizer> tokenizer;
  router::ServedModel plain, with_separator;
};

const Served& Model() {
  static const Served* served = [] {
    auto* s = new Served;
    const std::string dir = std::string(KDN_SOURCE_DIR) + "/models/kdn-qa";
    auto config = model::LoadModelConfig(dir);
    Check(config.ok(), "models/kdn-qa/config.json loads");
    s->config = *config;
    auto tok = text::Tokenizer::Load(dir);
    Check(tok.ok(), "models/kdn-qa/tokenizer.json loads");
    s->tokenizer = std::move(tok).value();
    s->plain = {"kdn-qa", &s->config, s->tokenizer.get()};
    s->with_separator = s->plain;
    s->with_separator.separator = "\n---\n";
    return s;
  }();
  return *served;
}

bool InVocab(const std::vector<int32_t>& ids, int vocab) {
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab) return false;
  }
  return true;
}

void CheckError(const router::ApiError& e) {
  Check(e.http_status >= 400 && e.http_status < 500, "a refusal is a 4xx");
  Check(!e.message.empty(), "a refusal says why");
}

void CheckRequest(const router::ApiRequest& r, const model::ModelConfig& c) {
  const int64_t n = static_cast<int64_t>(r.prompt.size());
  Check(n > 0, "the prompt is not empty");
  Check(InVocab(r.prompt, c.vocab_size), "prompt ids inside the vocabulary");
  Check(r.max_tokens >= 1, "max_tokens >= 1");
  Check(n + r.max_tokens <= c.max_context, "prompt and completion inside the context");
  Check(r.sampling.temperature >= 0 && r.sampling.temperature <= 2, "temperature in [0, 2]");
  Check(r.sampling.top_p > 0 && r.sampling.top_p <= 1, "top_p in (0, 1]");
  Check(r.sampling.top_k >= 0 && r.sampling.top_k <= c.vocab_size, "top_k in [0, vocab]");
  for (const std::string& s : r.stop) Check(!s.empty(), "stop strings are not empty");
  Check(InVocab(r.stop_ids, c.vocab_size), "stop ids inside the vocabulary");
  if (r.blend) {
    const router::BlendSpec& b = *r.blend;
    Check(b.head_tokens >= 0, "blend head >= 0");
    int64_t end = b.head_tokens;
    Check(!b.segment_tokens.empty(), "a blend plan has documents");
    for (int s : b.segment_tokens) {
      Check(s > 0, "every document has tokens");
      end += s;
    }
    Check(end < n, "the question after the documents has tokens");
    Check(b.recompute_ratio >= 0 && b.recompute_ratio <= 1, "recompute_ratio in [0, 1]");
    Check(b.check_layer >= 0 && b.check_layer < c.num_layers, "check_layer is a layer");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Served& m = Model();
  const router::ServedModel& served = (data[0] & 4) ? m.with_separator : m.plain;
  const std::string body(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] & 3) {
    case 0:
    case 1: {
      const auto kind = (data[0] & 3) == 0 ? router::ApiKind::kCompletion : router::ApiKind::kChat;
      router::ApiRequest r;
      if (auto e = router::ParseRequest(kind, body, served, &r)) {
        CheckError(*e);
      } else {
        CheckRequest(r, m.config);
      }
      break;
    }
    default: {
      router::InjectApiRequest r;
      if (auto e = router::ParseInjectRequest(body, served, &r)) {
        CheckError(*e);
      } else {
        Check(!r.documents.empty(), "an inject request has documents");
        for (const auto& d : r.documents) {
          Check(!d.empty() && InVocab(d, m.config.vocab_size),
                "a document of ids in the vocabulary");
          Check(static_cast<int64_t>(d.size()) < m.config.max_context,
                "a document inside the context");
        }
      }
      break;
    }
  }
  return 0;
}
