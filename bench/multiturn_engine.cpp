// kdn-bench multiturn --device: conversations through the prefill worker's
// own request logic (prefill_worker::Prefiller) in this process, on the CPU or
// a GPU, over a host-memory KDN tier, with no router or decode worker. Each
// turn's prompt is the previous one plus an answer and a new user message;
// the first turn computes everything, later turns take what the KDN holds
// (full chunks and tail pieces) and compute the rest. TTFT is Prefiller::Run:
// lookup, placing the cached KV in the engine's cache, computing the new
// tokens and drawing the first token. Storing a turn's new chunks happens
// after, off the clock, as in the worker (after the first token is sent).
//
// The same conversations run twice in one run: with the pool's resident KV
// (the last turn's blocks attached by reference) and with residency off
// (every hit copied in from the host tier, as before the pool was a tier),
// each with its own namespace and an empty index. A third run takes them
// through the decode worker's local prefill (decode_worker::Decoder;
// docs/serving.md, "Two paths"): each turn prepared on the conversation its
// pool kept from the turn before, its answer generated and kept with it;
// TTFT is Prepare to the first token drawn.
//
// With a preset on a GPU the model is materialised in device memory (the
// llama3-8b shape needs no weights file).
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>

#include "bench_util.h"
#include "kdn/common/job_thread.h"
#include "kdn/decode_worker/decoder.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/tiered_store.h"
#include "kdn/prefill_worker/prefiller.h"

namespace kdn::bench {

namespace {

// The median; of an even count, the mean of the middle two.
double MedianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0.0;
  const size_t h = v.size() / 2;
  return v.size() % 2 == 1 ? v[h] : (v[h - 1] + v[h]) / 2;
}

struct Mode {
  const char* name;
  bool resident;
  // [turn][conversation]
  std::vector<std::vector<double>> ttft, cached, resident_tok, loaded, prompt_len;
  double ratio = 0;
};

// The conversations through the decode worker's local prefill, into `m`:
// the answers are the Decoder's own (greedy), kept resident with the
// conversation for the next turn.
Status LocalPrefillTurns(engine::Engine& e, kvbus::ChunkStore& store, const MultiturnOptions& o,
                         uint64_t seed, Mode* m) {
  e.kv_cache().DropResident();
  const int vocab = e.config().vocab_size;
  // Answers are ids, never shown: bytes 0..255 and the rest specials.
  std::vector<int32_t> byte_ids(256);
  std::iota(byte_ids.begin(), byte_ids.end(), 0);
  const text::ByteTokenizer tokenizer(byte_ids, std::max(vocab, 258), 256, 257);
  kvbus::HostTier staging(uint64_t{1} << 20);
  JobThread io(decode_worker::kStoreLanes);
  decode_worker::Decoder decoder(e, tokenizer, kvbus::ChunkKey{0, 42}, store, staging, io,
                                 {.chunk_tokens = o.chunk_tokens, .max_batch = 1});
  std::mt19937_64 rng(seed);
  auto add_random = [&](std::vector<int32_t>& to, int n) {
    for (int i = 0; i < n; ++i) to.push_back(static_cast<int32_t>(rng() % vocab));
  };
  for (auto* v : {&m->ttft, &m->cached, &m->resident_tok, &m->loaded, &m->prompt_len}) {
    v->assign(o.turns, {});
  }
  // One turn: its TTFT, what it held, and the answer it generated.
  struct Turn {
    double ttft_ms = 0;
    decode_worker::LocalPrefillDone done;
    std::vector<int32_t> answer;
  };
  auto run = [&](const std::vector<int32_t>& prompt, const std::string& ns) -> Result<Turn> {
    decode_worker::DecodeRequest r;
    r.tokens = prompt;
    r.ns = ns;
    r.transfer_id = ns + std::to_string(prompt.size());
    r.local_prefill = true;
    r.spec.sampling.temperature = 0;
    r.spec.max_tokens = o.max_tokens;
    Turn turn;
    const auto t0 = Clock::now();
    decode_worker::DecoderOutput out;
    KDN_ASSIGN_OR_RETURN(const uint64_t id, decoder.Prepare(std::move(r), &out));
    for (bool finished = false; !finished;) {
      for (const auto& d : out.prefilled) {
        turn.ttft_ms = Seconds(t0, Clock::now()) * 1e3;
        turn.done = d;
        turn.answer.push_back(d.first_token);
      }
      for (const decode_worker::TokenEvent& ev : out.events) {
        if (!ev.error.ok()) return ev.error;
        if (ev.id == id && ev.token >= 0) turn.answer.push_back(ev.token);
        finished |= ev.id == id && ev.finished;
      }
      if (finished) break;
      out = {};
      decoder.Advance(&out);
    }
    return turn;
  };
  // Warm-up, unmeasured: a first and a later turn's shapes.
  {
    std::vector<int32_t> warm;
    add_random(warm, o.context_tokens);
    for (int t = 0; t < 2; ++t) {
      add_random(warm, o.turn_tokens);
      KDN_ASSIGN_OR_RETURN(Turn turn, run(warm, "warm-up local"));
      warm.insert(warm.end(), turn.answer.begin(), turn.answer.end());
    }
  }
  for (int conv = 0; conv < o.conversations; ++conv) {
    std::vector<int32_t> prompt;
    add_random(prompt, o.context_tokens);
    for (int t = 0; t < o.turns; ++t) {
      add_random(prompt, o.turn_tokens);
      KDN_ASSIGN_OR_RETURN(Turn turn, run(prompt, "local" + std::to_string(conv)));
      m->ttft[t].push_back(turn.ttft_ms);
      m->cached[t].push_back(static_cast<double>(turn.done.held_tokens));
      m->resident_tok[t].push_back(static_cast<double>(turn.done.resident_tokens));
      m->loaded[t].push_back(static_cast<double>(turn.done.kv_bytes_loaded) / 1e6);
      m->prompt_len[t].push_back(static_cast<double>(prompt.size()));
      prompt.insert(prompt.end(), turn.answer.begin(), turn.answer.end());  // the answer
    }
  }
  io.Drain();
  return Status::Ok();
}

Status MultiturnEngine(const Common& c, const MultiturnOptions& o) {
  const uint64_t seed = o.seed.value_or(std::random_device{}());
  const int64_t longest = int64_t{o.context_tokens} +
                          int64_t{o.turns} * (o.turn_tokens + o.max_tokens) + kvbus::kMinTailTokens;
  std::string what;
  // One conversation's prompt, plus room for storing its new chunks.
  KDN_ASSIGN_OR_RETURN(auto model, MakeModel(c, 2 * longest, &what));
  engine::Engine& e = *model;
  if (longest > e.config().max_context) {
    return InvalidArgument("a conversation of " + std::to_string(longest) +
                           " tokens exceeds the model's context of " +
                           std::to_string(e.config().max_context));
  }
  // A host tier that holds every conversation's chunks.
  const uint64_t kv_bytes = static_cast<uint64_t>(longest) * o.conversations *
                            e.kv_cache().num_layers() * e.kv_cache().LayerBytes(1, e.kv_dtype());
  std::vector<std::unique_ptr<kvbus::ChunkStore>> tiers;
  tiers.push_back(std::make_unique<kvbus::HostTier>(kv_bytes + kv_bytes / 2 + (uint64_t{1} << 28)));
  kvbus::TieredStore store(std::move(tiers));
  std::printf(
      "multiturn on %s: %d conversations of %d turns, %d context tokens, %d tokens per "
      "user message and %d per answer, chunks of %d tokens, text seed %llu\n",
      what.c_str(), o.conversations, o.turns, o.context_tokens, o.turn_tokens, o.max_tokens,
      o.chunk_tokens, static_cast<unsigned long long>(seed));
  const int vocab = e.config().vocab_size;
  std::vector<Mode> modes = {{"resident", true}, {"copying", false}};
  for (Mode& m : modes) {
    e.kv_cache().DropResident();
    prefill_worker::Prefiller prefiller(e, store, kvbus::ChunkKey{0, 42},
                                        {.chunk_tokens = o.chunk_tokens, .resident = m.resident});
    std::mt19937_64 rng(seed);  // the same text in both modes
    auto add_random = [&](std::vector<int32_t>& to, int n) {
      for (int i = 0; i < n; ++i) to.push_back(static_cast<int32_t>(rng() % vocab));
    };
    for (auto* v : {&m.ttft, &m.cached, &m.resident_tok, &m.loaded, &m.prompt_len}) {
      v->assign(o.turns, {});
    }
    // An unmeasured conversation of two turns first, at the full context:
    // CUDA graphs, cuBLAS heuristics, attention plans and first-touch for
    // both a first and a later turn's shapes.
    {
      std::vector<int32_t> warm;
      add_random(warm, o.context_tokens);
      for (int t = 0; t < 2; ++t) {
        add_random(warm, o.turn_tokens);
        KDN_RETURN_IF_ERROR(
            prefiller.Run({.tokens = warm, .ns = std::string("warm-up ") + m.name}).status());
        KDN_RETURN_IF_ERROR(prefiller.StoreNewChunks());
        add_random(warm, o.max_tokens);
      }
    }
    for (int conv = 0; conv < o.conversations; ++conv) {
      std::vector<int32_t> prompt;
      add_random(prompt, o.context_tokens);
      for (int t = 0; t < o.turns; ++t) {
        if (t > 0) add_random(prompt, o.max_tokens);  // the previous answer
        add_random(prompt, o.turn_tokens);
        const auto t0 = Clock::now();
        KDN_ASSIGN_OR_RETURN(
            const prefill_worker::PrefillOutcome out,
            prefiller.Run({.tokens = prompt, .ns = m.name + std::to_string(conv)}));
        m.ttft[t].push_back(Seconds(t0, Clock::now()) * 1e3);
        m.cached[t].push_back(out.cached_tokens);
        m.resident_tok[t].push_back(out.resident_tokens);
        m.loaded[t].push_back(static_cast<double>(out.kv_bytes_loaded) / 1e6);
        m.prompt_len[t].push_back(static_cast<double>(prompt.size()));
        KDN_RETURN_IF_ERROR(prefiller.StoreNewChunks());
      }
    }
  }
  modes.push_back({"local", true});
  KDN_RETURN_IF_ERROR(LocalPrefillTurns(e, store, o, seed, &modes.back()));
  std::printf("%5s %11s %11s | %-34s | %-34s | %-23s\n", "", "", "", "resident KV in the pool",
              "residency off (copied from the host tier)", "decode worker, local");
  std::printf("%5s %11s %11s | %10s %10s %12s | %10s %10s %12s | %10s %12s\n", "turn", "prompt tok",
              "cached tok", "resident", "MB copied", "TTFT ms", "resident", "MB copied", "TTFT ms",
              "resident", "TTFT ms");
  json rows = json::array();
  for (int t = 0; t < o.turns; ++t) {
    const Mode &r = modes[0], &cp = modes[1], &lo = modes[2];
    std::printf("%5d %11.0f %11.0f | %10.0f %10.1f %12.1f | %10.0f %10.1f %12.1f | %10.0f %12.1f\n",
                t + 1, MedianOf(r.prompt_len[t]), MedianOf(r.cached[t]),
                MedianOf(r.resident_tok[t]), MedianOf(r.loaded[t]), MedianOf(r.ttft[t]),
                MedianOf(cp.resident_tok[t]), MedianOf(cp.loaded[t]), MedianOf(cp.ttft[t]),
                MedianOf(lo.resident_tok[t]), MedianOf(lo.ttft[t]));
    json row = {{"turn", t + 1},
                {"prompt_tokens", MedianOf(r.prompt_len[t])},
                {"cached_tokens", MedianOf(r.cached[t])}};
    for (const Mode& m : modes) {
      row[m.name] = {{"resident_tokens", MedianOf(m.resident_tok[t])},
                     {"kv_mb_copied_median", MedianOf(m.loaded[t])},
                     {"ttft_ms_median", MedianOf(m.ttft[t])},
                     {"ttft_ms", m.ttft[t]}};
    }
    rows.push_back(row);
  }
  json ratios;
  for (Mode& m : modes) {
    double later = 0;
    for (int t = 1; t < o.turns; ++t) later += MedianOf(m.ttft[t]);
    m.ratio = MedianOf(m.ttft[0]) / (later / (o.turns - 1));
    ratios[m.name] = m.ratio;
  }
  std::printf(
      "first-turn TTFT / mean later-turn TTFT: %.1fx with resident KV, %.1fx with "
      "residency off, %.1fx prefilled by the decode worker (aim: at least 10x; 20x "
      "for the local prefill at 16K on a GPU)\n",
      modes[0].ratio, modes[1].ratio, modes[2].ratio);
  Emit(c, {{"workload", "multiturn"},
           {"mode", "engine"},
           {"model", what},
           {"machine", Machine(c)},
           {"context_tokens", o.context_tokens},
           {"turns", o.turns},
           {"turn_tokens", o.turn_tokens},
           {"max_tokens", o.max_tokens},
           {"conversations", o.conversations},
           {"chunk_tokens", o.chunk_tokens},
           {"seed", seed},
           {"ttft",
            "Prefiller::Run: KDN lookup, cached KV attached (resident) or copied into "
            "the engine's cache, new tokens computed, first token drawn; local: "
            "Decoder::Prepare to its LocalPrefillDone"},
           {"results", rows},
           {"first_to_later_ttft_ratio", ratios}});
  return Status::Ok();
}

}  // namespace

int RunMultiturnEngine(const Common& c, const MultiturnOptions& o) {
  if (Status s = MultiturnEngine(c, o); !s.ok()) {
    std::fprintf(stderr, "kdn-bench: multiturn: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace kdn::bench
