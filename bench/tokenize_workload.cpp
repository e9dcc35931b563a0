// tokenize: how fast a tokenizer folder encodes a long prompt and decodes it
// back (kdn/text/tokenizer.h), against the budget of 1 ms per 1000 tokens
// that a 32K-token prompt must stay well under to be no part of its TTFT.
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "kdn/text/tokenizer.h"

namespace kdn::bench {

namespace {

// A text of about `tokens` tokens for `tok`: seeded sentences of English,
// code, numbers, German, Russian, Chinese and Japanese, so that the regexes,
// merges and byte paths are all exercised; not a repetition of one paragraph.
std::string SyntheticText(const text::Tokenizer& tok, int tokens) {
  static const char* kWords[] = {
      "the",
      "of",
      "and",
      "a",
      "to",
      "in",
      "is",
      "you",
      "that",
      "it",
      "he",
      "was",
      "for",
      "on",
      "are",
      "as",
      "with",
      "his",
      "they",
      "I",
      "at",
      "be",
      "this",
      "have",
      "from",
      "or",
      "one",
      "had",
      "by",
      "word",
      "but",
      "not",
      "what",
      "all",
      "were",
      "we",
      "when",
      "your",
      "can",
      "said",
      "there",
      "use",
      "an",
      "each",
      "which",
      "she",
      "do",
      "how",
      "their",
      "if",
      "will",
      "cache",
      "prefill",
      "decode",
      "tokenizer",
      "network",
      "delivery",
      "document",
      "question",
      "answer",
      "server",
      "latency",
      "throughput",
      "request",
      "response",
      "attention",
      "layer",
      "don't",
      "it's",
      "we'll",
      "they're",
      "I've",
      "HTTP/2",
      "JSON",
      "GPU",
      "KV-cache",
      "def",
      "return",
      "self",
      "None",
      "for i in range(n):",
      "x += 1;",
      "std::vector<int>",
      "{\"key\": [1, 2, 3]}",
      "#include <cstdio>",
      "if (a && b) {",
      "}",
      "=>",
      "//",
      "/* */",
      "Straße",
      "Größe",
      "über",
      "Mädchen",
      "schön",
      "Привет",
      "мир",
      "сеть",
      "данные",
      "模型",
      "缓存",
      "请求",
      "网络",
      "数据",
      "東京",
      "ありがとう",
      "データ",
      "🙂",
      "🚀",
  };
  std::mt19937 rng(7);
  std::uniform_int_distribution<size_t> word(0, std::size(kWords) - 1);
  std::uniform_int_distribution<int> len(5, 18), num(0, 99999), kind(0, 9);
  std::string text;
  while (true) {
    for (int s = 0; s < 64; ++s) {
      std::string sentence;
      const int n = len(rng);
      for (int i = 0; i < n; ++i) {
        if (i > 0) sentence += kind(rng) == 0 ? "  " : " ";
        sentence += kind(rng) == 1 ? std::to_string(num(rng)) : kWords[word(rng)];
      }
      sentence += kind(rng) < 2 ? ".\n\n" : kind(rng) < 4 ? "!\n" : ". ";
      text += sentence;
    }
    const size_t have = tok.Encode(text, false).size();
    if (have >= static_cast<size_t>(tokens)) break;
  }
  return text;
}

}  // namespace

int RunTokenize(const Common& c, const std::string& tokenizer_dir, const std::string& text_path,
                int tokens) {
  auto tok_r = text::Tokenizer::Load(tokenizer_dir);
  if (!tok_r.ok()) {
    std::fprintf(stderr, "kdn-bench tokenize: %s\n", tok_r.status().ToString().c_str());
    return 1;
  }
  const text::Tokenizer& tok = **tok_r;
  std::string text;
  if (!text_path.empty()) {
    std::ifstream in(text_path);
    if (!in) {
      std::fprintf(stderr, "kdn-bench tokenize: cannot read %s\n", text_path.c_str());
      return 1;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  } else {
    text = SyntheticText(tok, tokens);
  }

  // Best of --reps: the first run also warms the caches and the PCRE2 JIT.
  std::vector<int32_t> ids;
  double encode_s = 1e30, decode_s = 1e30, stream_s = 1e30;
  std::string decoded, streamed;
  for (int r = 0; r < std::max(1, c.reps); ++r) {
    auto t0 = Clock::now();
    ids = tok.Encode(text, true);
    auto t1 = Clock::now();
    decoded = tok.Decode(ids);
    auto t2 = Clock::now();
    auto stream = tok.NewDecodeStream();
    streamed.clear();
    for (int32_t id : ids) streamed += stream->Next(id);
    streamed += stream->Finish();
    auto t3 = Clock::now();
    encode_s = std::min(encode_s, Seconds(t0, t1));
    decode_s = std::min(decode_s, Seconds(t1, t2));
    stream_s = std::min(stream_s, Seconds(t2, t3));
  }
  const double n = static_cast<double>(ids.size());
  const double encode_us_per_k = encode_s * 1e6 / n * 1000;
  const double decode_us_per_k = decode_s * 1e6 / n * 1000;
  const double stream_us_per_k = stream_s * 1e6 / n * 1000;
  constexpr double kBudgetUsPerK = 1000;  // 1 ms per 1000 tokens
  std::printf("tokenize  %s  (%zu bytes of %s -> %zu tokens)\n", tokenizer_dir.c_str(), text.size(),
              text_path.empty() ? "synthetic text" : text_path.c_str(), ids.size());
  std::printf("  %-22s %14s %16s %18s\n", "", "tokens/s", "us/1000 tokens", "vs 1 ms/1000 budget");
  std::printf("  %-22s %14.0f %16.1f %17.3fx\n", "encode", n / encode_s, encode_us_per_k,
              encode_us_per_k / kBudgetUsPerK);
  std::printf("  %-22s %14.0f %16.1f %17.3fx\n", "decode (whole)", n / decode_s, decode_us_per_k,
              decode_us_per_k / kBudgetUsPerK);
  std::printf("  %-22s %14.0f %16.1f %17.3fx\n", "decode (token by token)", n / stream_s,
              stream_us_per_k, stream_us_per_k / kBudgetUsPerK);
  std::printf("  streaming decode equals whole decode: %s\n", streamed == decoded ? "yes" : "NO");
  Emit(c, {{"workload", "tokenize"},
           {"tokenizer", tokenizer_dir},
           {"text_bytes", text.size()},
           {"tokens", ids.size()},
           {"encode_tokens_per_s", n / encode_s},
           {"encode_us_per_1000_tokens", encode_us_per_k},
           {"decode_us_per_1000_tokens", decode_us_per_k},
           {"stream_decode_us_per_1000_tokens", stream_us_per_k},
           {"encode_vs_budget", encode_us_per_k / kBudgetUsPerK},
           {"stream_equals_decode", streamed == decoded}});
  return streamed == decoded ? 0 : 1;
}

}  // namespace kdn::bench
