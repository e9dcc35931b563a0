// kdn-bench kv-codec: the KV codec (kdn/kvbus/codec.h) on one request's KV,
// computed by the model from real text (the documents of an eval set).
//
// - Size: bytes per token of each level against raw, against plain 8-bit
//   quantization (1 byte per element plus a scale and offset per channel and
//   plane) and against zstd on the raw chunk, all in this run.
// - Error: the relative RMS error of the KV, and, downstream, the KL of the
//   next-token distribution and the agreement of the greedy token at each
//   position of a suffix computed on top of the decoded KV, against the raw
//   chunk's.
// - Speed: encode and decode GB/s of raw KV (one thread), beside zstd's.
// - End to end: time to first token of the suffix with the prefix's chunks
//   loaded from the disk tier (cold: dropped from the page cache first) and
//   from a kdn-store over TCP loopback, raw against encoded.
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <unistd.h>

#include "bench_util.h"
#include "kdn/blend/blend.h"
#include "kdn/text/tokenizer.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbus/codec.h"
#include "kdn/kvbus/disk_tier.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/store_service.h"

namespace kdn::bench {

using namespace kdn::kvbus;

namespace {

using Chunks = std::vector<std::shared_ptr<const Chunk>>;

// Tokens of the eval set's documents (TEXT_DIR/eval.jsonl), one after another,
// at least `n`, by the tokenizer of `tokenizer_from` (a model folder or GGUF).
Result<std::vector<int32_t>> TextTokens(const std::string& tokenizer_from,
                                        const std::string& text_dir, size_t n) {
  KDN_ASSIGN_OR_RETURN(auto tok, text::Tokenizer::Load(tokenizer_from));
  const std::string path = (std::filesystem::path(text_dir) / "eval.jsonl").string();
  std::ifstream in(path);
  if (!in) return NotFound("cannot open " + path + " (the text the KV is computed from)");
  std::vector<int32_t> out;
  std::string line;
  while (out.size() < n && std::getline(in, line)) {
    const json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("documents")) continue;
    for (const json& d : j["documents"]) {
      for (int32_t t : tok->Encode(d.get<std::string>() + "\n", false)) out.push_back(t);
    }
  }
  if (out.size() < n) {
    return InvalidArgument(path + " holds " + std::to_string(out.size()) +
                           " tokens of documents, " + std::to_string(n) + " needed");
  }
  out.resize(n);
  return out;
}

// Writes the chunks' KV into a new sequence of `model` and computes `suffix`
// on top: every position's logits.
Result<std::vector<float>> SuffixLogits(engine::Engine& model, const Chunks& chunks,
                                        std::span<const int32_t> suffix) {
  engine::KvCache& cache = model.kv_cache();
  engine::KvSequence seq = cache.NewSequence();
  int64_t at = 0;
  for (const auto& c : chunks) at += c->info().tokens;
  KDN_RETURN_IF_ERROR(cache.Reserve(seq, at));
  at = 0;
  for (const auto& c : chunks) {
    KDN_RETURN_IF_ERROR(kvbridge::ChunkToPagedKv(*c, cache, seq, at));
    at += c->info().tokens;
  }
  cache.SetLength(seq, at);
  std::vector<float> logits;
  KDN_RETURN_IF_ERROR(model.Prefill(seq, suffix, {.all_logits = true}, &logits));
  seq.Reset();
  return logits;
}

double Sq(double x) { return x * x; }

// The chunks' elements widened to float, one after another.
std::vector<float> Elements(const Chunks& chunks) {
  std::vector<float> out;
  for (const auto& c : chunks) {
    const size_t n = c->payload().size() / DTypeSize(c->info().dtype);
    out.resize(out.size() + n);
    engine::ToFloat(c->info().dtype, c->payload().data(), n, out.data() + out.size() - n);
  }
  return out;
}

struct Timed {
  Chunks out;
  double seconds = 0;  // best of reps
};

// Runs `f` on every chunk, `reps` times; the best pass's time.
Result<Timed> EachChunk(
    const Chunks& in, int reps,
    const std::function<Result<std::shared_ptr<const Chunk>>(std::shared_ptr<const Chunk>)>& f) {
  Timed t;
  t.seconds = 1e30;
  for (int r = 0; r < reps; ++r) {
    Chunks out;
    const auto t0 = Clock::now();
    for (const auto& c : in) {
      KDN_ASSIGN_OR_RETURN(auto o, f(c));
      out.push_back(std::move(o));
    }
    t.seconds = std::min(t.seconds, Seconds(t0, Clock::now()));
    t.out = std::move(out);
  }
  return t;
}

}  // namespace

int RunKvCodec(const Common& c, const KvCodecOptions& o) {
  std::vector<CodecLevel> levels;
  for (const std::string& name : o.levels) {
    auto l = ParseCodecLevel(name);
    if (!l.ok() || l->raw()) {
      std::fprintf(stderr, "kdn-bench kv-codec: --levels: %s\n",
                   l.ok() ? "raw is the baseline, always measured" : l.status().message().c_str());
      return 2;
    }
    levels.push_back(*l);
  }
  std::vector<CodecLevel> ttft_levels;  // raw first: the others are compared with it
  if (!o.ttft_levels.empty()) ttft_levels.push_back(CodecLevel{});
  for (const std::string& name : o.ttft_levels) {
    auto l = ParseCodecLevel(name);
    if (!l.ok()) {
      std::fprintf(stderr, "kdn-bench kv-codec: --ttft-levels: %s\n", l.status().message().c_str());
      return 2;
    }
    if (!l->raw()) ttft_levels.push_back(*l);
  }
  if (o.tokens < o.chunk_tokens || o.chunk_tokens <= 0 || o.suffix_tokens <= 0) {
    std::fprintf(stderr,
                 "kdn-bench kv-codec: --tokens must hold at least one chunk of --chunk-tokens\n");
    return 2;
  }
  const int n_chunks = o.tokens / o.chunk_tokens;
  const int64_t prefix = int64_t{n_chunks} * o.chunk_tokens;
  const std::string text_dir = o.text_dir.empty() ? c.model_dir : o.text_dir;
  // The model's own tokenizer where it has one (a preset has none: the text's).
  auto text = TextTokens(c.model_dir.empty() ? text_dir : c.model_dir, text_dir,
                         static_cast<size_t>(prefix + o.suffix_tokens));
  std::string what;
  auto model_r = MakeModel(c, 2 * (prefix + o.suffix_tokens) + 64, &what);
  if (!text.ok() || !model_r.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n",
                 (!text.ok() ? text.status() : model_r.status()).ToString().c_str());
    return 1;
  }
  engine::Engine& model = **model_r;
  for (int32_t t : *text) {
    if (t >= model.config().vocab_size) {
      std::fprintf(stderr,
                   "kdn-bench kv-codec: the text of %s has token %d, past %s's vocabulary\n",
                   text_dir.c_str(), t, what.c_str());
      return 2;
    }
  }
  const DType dtype = ParseDType(o.dtype);
  const std::span<const int32_t> prompt(text->data(), static_cast<size_t>(prefix));
  const std::span<const int32_t> suffix(text->data() + prefix,
                                        static_cast<size_t>(o.suffix_tokens));
  const int reps = std::max(c.reps, 1);

  // The request's KV: one prefill, cut into chunks of the dtype asked for.
  std::fprintf(stderr, "kv-codec: prefill of %lld tokens\n", static_cast<long long>(prefix));
  Chunks raw;
  {
    engine::KvCache& cache = model.kv_cache();
    engine::KvSequence seq = cache.NewSequence();
    std::vector<float> unused;
    const auto t0 = Clock::now();
    Status st = model.Prefill(seq, prompt, {}, &unused);
    if (!st.ok()) {
      std::fprintf(stderr, "kdn-bench: %s\n", st.ToString().c_str());
      return 1;
    }
    std::fprintf(stderr, "kv-codec: prefill took %.1f s\n", Seconds(t0, Clock::now()));
    const KeyContext ctx{{7, 7}, "kv-codec", o.chunk_tokens};
    const std::vector<ChunkKey> keys =
        PrefixKeys(ctx, std::vector<int32_t>(prompt.begin(), prompt.end()));
    for (int i = 0; i < n_chunks; ++i) {
      auto ch = kvbridge::ChunkFromPagedKv(cache, seq, int64_t{i} * o.chunk_tokens, o.chunk_tokens,
                                           keys[i], ctx.model_fingerprint, dtype);
      if (!ch.ok()) {
        std::fprintf(stderr, "kdn-bench: %s\n", ch.status().ToString().c_str());
        return 1;
      }
      raw.push_back(*ch);
    }
    seq.Reset();
  }
  const ChunkInfo& shape = raw[0]->info();
  const double raw_payload = static_cast<double>(raw[0]->payload().size()) * n_chunks;
  const double elements = raw_payload / DTypeSize(dtype);
  const double channels_planes = 2.0 * shape.layers * shape.kv_heads * shape.head_dim;
  auto ref_logits = SuffixLogits(model, raw, suffix);
  if (!ref_logits.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", ref_logits.status().ToString().c_str());
    return 1;
  }
  const std::vector<float> ref_kv = Elements(raw);
  double ref_norm = 0;
  for (float v : ref_kv) ref_norm += Sq(v);
  const int vocab = model.config().vocab_size;

  std::printf(
      "kv-codec: %s, %lld tokens of %s KV (%u layers x %u KV heads x %u), %d chunks of %d; "
      "text %s; suffix %d tokens; best of %d\n",
      what.c_str(), static_cast<long long>(prefix), DTypeName(dtype), shape.layers, shape.kv_heads,
      shape.head_dim, n_chunks, o.chunk_tokens, text_dir.c_str(), o.suffix_tokens, reps);
  std::printf("%-10s %10s %9s %9s %10s %10s %10s %10s %8s\n", "codec", "B/token", "vs raw",
              "vs int8", "enc GB/s", "dec GB/s", "KV rel err", "KL", "top-1");
  json rows = json::array();
  const double int8_bytes = elements + 8 * channels_planes * n_chunks;  // + scales
  auto row = [&](const std::string& name, double bytes, double enc_s, double dec_s, double err,
                 double kl, double agree) {
    std::printf("%-10s %10.1f %8.2fx %8.2fx", name.c_str(), bytes / prefix, raw_payload / bytes,
                int8_bytes / bytes);
    auto num = [](double v, const char* fmt) {
      if (v < 0) {
        std::printf(" %10s", "-");
      } else {
        std::printf(fmt, v);
      }
    };
    num(enc_s > 0 ? raw_payload / enc_s / 1e9 : -1, " %10.3f");
    num(dec_s > 0 ? raw_payload / dec_s / 1e9 : -1, " %10.3f");
    num(err, " %10.2e");
    num(kl, " %10.2e");
    if (agree < 0) {
      std::printf(" %8s\n", "-");
    } else {
      std::printf(" %7.1f%%\n", 100 * agree);
    }
    json r = {{"codec", name},
              {"bytes_per_token", bytes / prefix},
              {"ratio_vs_raw", raw_payload / bytes},
              {"ratio_vs_int8", int8_bytes / bytes}};
    if (enc_s > 0) r["encode_gbytes_per_s"] = raw_payload / enc_s / 1e9;
    if (dec_s > 0) r["decode_gbytes_per_s"] = raw_payload / dec_s / 1e9;
    if (err >= 0) r["kv_relative_rms_error"] = err;
    if (kl >= 0) r["kl"] = kl;
    if (agree >= 0) r["top1_agreement"] = agree;
    rows.push_back(std::move(r));
  };
  row(std::string("raw ") + DTypeName(dtype), raw_payload, -1, -1, 0, 0, 1);
  row("int8", int8_bytes, -1, -1, -1, -1, -1);

  // zstd on the raw payloads, level 3 (its default).
  {
    double bytes = 0, enc_s = 1e30, dec_s = 1e30;
    for (int r = 0; r < reps; ++r) {
      std::vector<std::vector<uint8_t>> packed;
      bytes = 0;
      auto t0 = Clock::now();
      for (const auto& ch : raw) {
        std::vector<uint8_t> out(ZSTD_compressBound(ch->payload().size()));
        const size_t n =
            ZSTD_compress(out.data(), out.size(), ch->payload().data(), ch->payload().size(), 3);
        out.resize(ZSTD_isError(n) ? 0 : n);
        bytes += static_cast<double>(out.size());
        packed.push_back(std::move(out));
      }
      enc_s = std::min(enc_s, Seconds(t0, Clock::now()));
      std::vector<uint8_t> back(raw[0]->payload().size());
      t0 = Clock::now();
      for (const auto& p : packed) {
        if (ZSTD_isError(ZSTD_decompress(back.data(), back.size(), p.data(), p.size()))) {
          std::fprintf(stderr, "kdn-bench: zstd failed\n");
          return 1;
        }
      }
      dec_s = std::min(dec_s, Seconds(t0, Clock::now()));
    }
    row("zstd-3", bytes, enc_s, dec_s, 0, 0, 1);
  }

  for (const CodecLevel& level : levels) {
    const std::string name = CodecLevelName(level);
    std::fprintf(stderr, "kv-codec: %s\n", name.c_str());
    auto enc = EachChunk(raw, reps, [&](auto ch) { return EncodeChunk(std::move(ch), level); });
    auto dec = enc.ok()
                   ? EachChunk(enc->out, reps, [](auto ch) { return DecodeChunk(std::move(ch)); })
                   : Result<Timed>(enc.status());
    if (!dec.ok()) {
      std::fprintf(stderr, "kdn-bench: %s: %s\n", name.c_str(), dec.status().ToString().c_str());
      return 1;
    }
    double bytes = 0;
    for (const auto& ch : enc->out) bytes += static_cast<double>(ch->payload().size());
    const std::vector<float> kv = Elements(dec->out);
    double err = 0;
    for (size_t i = 0; i < kv.size(); ++i) err += Sq(kv[i] - ref_kv[i]);
    auto logits = SuffixLogits(model, dec->out, suffix);
    if (!logits.ok()) {
      std::fprintf(stderr, "kdn-bench: %s\n", logits.status().ToString().c_str());
      return 1;
    }
    double kl = 0;
    int agree = 0;
    for (int i = 0; i < o.suffix_tokens; ++i) {
      const std::span<const float> p(ref_logits->data() + static_cast<size_t>(i) * vocab, vocab);
      const std::span<const float> q(logits->data() + static_cast<size_t>(i) * vocab, vocab);
      kl += blend::KlDivergence(p, q);
      agree += std::max_element(p.begin(), p.end()) - p.begin() ==
               std::max_element(q.begin(), q.end()) - q.begin();
    }
    row(name, bytes, enc->seconds, dec->seconds, std::sqrt(err / ref_norm), kl / o.suffix_tokens,
        static_cast<double>(agree) / o.suffix_tokens);
  }

  // Time to first token of the suffix, its prefix's chunks loaded from a tier.
  json ttft_rows = json::array();
  if (!ttft_levels.empty()) {
    std::printf("\ntime to first token of %d new tokens on %lld cached ones, best of %d\n",
                o.suffix_tokens, static_cast<long long>(prefix), reps);
    std::printf("%-10s %-10s %12s %10s %10s %10s\n", "tier", "codec", "stored MiB", "load ms",
                "TTFT ms", "vs raw");
    double full_s = 1e30;
    for (int r = 0; r < reps; ++r) {
      engine::KvSequence seq = model.kv_cache().NewSequence();
      std::vector<float> logits;
      const auto t0 = Clock::now();
      if (!model.Prefill(seq, *text, {}, &logits).ok()) return 1;
      full_s = std::min(full_s, Seconds(t0, Clock::now()));
      seq.Reset();
    }
    for (const char* tier_name : {"disk", "kdn-store"}) {
      double raw_ttft = 0;
      for (const CodecLevel& level : ttft_levels) {
        const std::filesystem::path dir =
            std::filesystem::path(o.disk_dir) / ("kdn-bench-codec-" + std::to_string(::getpid()));
        std::filesystem::remove_all(dir);
        HostTier store_host(0);
        std::unique_ptr<StoreServer> server;
        std::unique_ptr<ChunkStore> inner;
        if (std::string(tier_name) == "disk") {
          auto d = DiskTier::Open(dir, 0);
          if (!d.ok()) {
            std::fprintf(stderr, "kdn-bench: %s\n", d.status().ToString().c_str());
            return 1;
          }
          inner = std::move(d).value();
        } else {
          auto s = StoreServer::Start(store_host, "tcp://127.0.0.1:0");
          auto remote = s.ok() ? RemoteStore::Connect((*s)->endpoint())
                               : Result<std::unique_ptr<RemoteStore>>(s.status());
          if (!remote.ok()) {
            std::fprintf(stderr, "kdn-bench: %s\n", remote.status().ToString().c_str());
            return 1;
          }
          server = std::move(s).value();
          inner = std::move(remote).value();
        }
        CodecTier tier(std::move(inner), {.level = level});
        for (const auto& ch : raw) {
          if (Status st = tier.Put(ch); !st.ok()) {
            std::fprintf(stderr, "kdn-bench: %s\n", st.ToString().c_str());
            return 1;
          }
        }
        const double stored = static_cast<double>(tier.Stats().bytes);
        double load_s = 1e30, ttft_s = 1e30;
        for (int r = 0; r < reps; ++r) {
          if (std::string(tier_name) == "disk") DropFromPageCache(dir);
          const auto t0 = Clock::now();
          Chunks got;
          for (const auto& ch : raw) {
            auto g = tier.Get(ch->key());
            if (!g.ok()) {
              std::fprintf(stderr, "kdn-bench: %s\n", g.status().ToString().c_str());
              return 1;
            }
            got.push_back(*g);
          }
          const double loaded = Seconds(t0, Clock::now());
          engine::KvCache& cache = model.kv_cache();
          engine::KvSequence seq = cache.NewSequence();
          bool ok = cache.Reserve(seq, prefix).ok();
          for (int i = 0; ok && i < n_chunks; ++i) {
            ok = kvbridge::ChunkToPagedKv(*got[i], cache, seq, int64_t{i} * o.chunk_tokens).ok();
          }
          cache.SetLength(seq, prefix);
          std::vector<float> logits;
          ok = ok && model.Prefill(seq, suffix, {}, &logits).ok();
          const double total = Seconds(t0, Clock::now());
          seq.Reset();
          if (!ok) {
            std::fprintf(stderr, "kdn-bench: loading the prefix failed\n");
            return 1;
          }
          load_s = std::min(load_s, loaded);
          ttft_s = std::min(ttft_s, total);
        }
        if (level.raw()) raw_ttft = ttft_s;
        const std::string name = CodecLevelName(level);
        std::printf("%-10s %-10s %12.1f %10.1f %10.1f", tier_name, name.c_str(), stored / 1048576.0,
                    1e3 * load_s, 1e3 * ttft_s);
        if (raw_ttft > 0) {
          std::printf(" %9.2fx\n", raw_ttft / ttft_s);
        } else {
          std::printf(" %10s\n", "-");
        }
        json r = {{"tier", tier_name},
                  {"codec", name},
                  {"stored_bytes", stored},
                  {"load_ms", 1e3 * load_s},
                  {"ttft_ms", 1e3 * ttft_s}};
        if (raw_ttft > 0) r["speedup_vs_raw"] = raw_ttft / ttft_s;
        ttft_rows.push_back(std::move(r));
        if (server) server->Stop();
        std::filesystem::remove_all(dir);
      }
    }
    std::printf("%-10s %-10s %12s %10s %10.1f  (no cache: the whole prompt computed)\n", "none",
                "-", "-", "-", 1e3 * full_s);
    ttft_rows.push_back({{"tier", "none"}, {"ttft_ms", 1e3 * full_s}});
  }
  Emit(c, {{"workload", "kv-codec"},
           {"model", what},
           {"text", text_dir},
           {"tokens", prefix},
           {"chunk_tokens", o.chunk_tokens},
           {"dtype", DTypeName(dtype)},
           {"suffix_tokens", o.suffix_tokens},
           {"rows", rows},
           {"ttft", ttft_rows},
           {"machine", Machine(c)}});
  return 0;
}

}  // namespace kdn::bench
