// kdn-bench multiturn (see kdn_bench.cpp): conversations through a running
// deployment's HTTP API, each later turn against its floor (serving_client.h).
#include <boost/beast/http/verb.hpp>

#include <algorithm>
#include <cstdio>
#include <random>

#include "bench_util.h"
#include "kdn/common/kv_block.h"
#include "serving_client.h"

namespace kdn::bench {

namespace {

namespace http = boost::beast::http;

// The floor of a later turn: its new tokens (what the client added since the
// previous prompt, answer included) prefilled on top of a context that is
// whole chunks the KDN holds, so that no tail is involved. The context is
// the previous prompt cut at its last chunk boundary (one BOS token plus
// bytes: one token each on kdn's byte-level tokenizers), moved back a chunk
// at a time while the cut would split a UTF-8 character.
std::string FloorPrompt(const std::string& previous, int64_t previous_tokens, int64_t new_tokens,
                        int chunk_tokens, std::mt19937_64& rng) {
  int64_t context = previous_tokens / chunk_tokens * chunk_tokens;
  const auto continuation = [&](int64_t bytes) {
    return bytes > 0 && bytes < static_cast<int64_t>(previous.size()) &&
           (static_cast<unsigned char>(previous[bytes]) & 0xc0) == 0x80;
  };
  while (context > chunk_tokens && continuation(context - 1)) context -= chunk_tokens;
  const int64_t bytes = std::max<int64_t>(context - 1, 0);  // the BOS is a token
  return previous.substr(0, std::min<size_t>(bytes, previous.size())) +
         RandomWords(rng, static_cast<int>(std::max<int64_t>(new_tokens, 1)));
}

// The conversations of one path (`path`: the requests' "disaggregation"
// field, empty for none): its table printed, its figures returned.
Result<json> MultiturnPath(const Url& url, const MultiturnOptions& o, const std::string& model,
                           const std::string& path, uint64_t seed) {
  auto metrics_before = Exchange(url, http::verb::get, "/metrics", "");

  // results[turn][conversation]; floors[turn][conversation] for turns > 1
  std::vector<std::vector<TurnResult>> results(o.turns), floors(o.turns);
  for (int conv = 0; conv < o.conversations; ++conv) {
    std::mt19937_64 rng(seed * 1000003 + conv);
    std::mt19937_64 floor_rng(seed * 1000003 + conv + 0xf100);
    std::string prompt = RandomWords(rng, o.context_tokens);
    std::string previous;
    int64_t previous_tokens = 0;
    for (int t = 0; t < o.turns; ++t) {
      prompt += "\n" + RandomWords(rng, o.turn_tokens - 1);
      auto r = Complete(url, prompt, o.max_tokens, path);
      if (!r.ok()) {
        return r.status().WithContext("conversation " + std::to_string(conv + 1) + " turn " +
                                      std::to_string(t + 1));
      }
      std::fprintf(stderr,
                   "multiturn: conversation %d/%d turn %d/%d: %lld prompt tokens (%lld cached), "
                   "TTFT %.1f ms, total %.1f ms\n",
                   conv + 1, o.conversations, t + 1, o.turns,
                   static_cast<long long>(r->prompt_tokens),
                   static_cast<long long>(r->cached_tokens), r->ttft_s * 1e3, r->total_s * 1e3);
      if (t > 0) {
        const std::string fp =
            FloorPrompt(previous, previous_tokens, r->prompt_tokens - previous_tokens,
                        o.chunk_tokens, floor_rng);
        auto f = Complete(url, fp, 1, path);
        if (!f.ok()) {
          return f.status().WithContext("conversation " + std::to_string(conv + 1) + " turn " +
                                        std::to_string(t + 1) + "'s floor");
        }
        std::fprintf(stderr,
                     "multiturn: conversation %d/%d turn %d/%d floor: %lld prompt tokens (%lld "
                     "cached), TTFT %.1f ms\n",
                     conv + 1, o.conversations, t + 1, o.turns,
                     static_cast<long long>(f->prompt_tokens),
                     static_cast<long long>(f->cached_tokens), f->ttft_s * 1e3);
        floors[t].push_back(std::move(*f));
      }
      previous = prompt;
      previous_tokens = r->prompt_tokens;
      prompt += r->text;
      results[t].push_back(std::move(*r));
    }
  }
  auto metrics_after = Exchange(url, http::verb::get, "/metrics", "");

  std::printf(
      "multiturn against %s (model %s)%s: %d conversations of %d turns, a %d-token "
      "context, %d-token user turns, %d-token answers, seed %llu\n",
      o.url.c_str(), model.c_str(), path.empty() ? "" : (", disaggregation " + path).c_str(),
      o.conversations, o.turns, o.context_tokens, o.turn_tokens, o.max_tokens,
      static_cast<unsigned long long>(seed));
  std::printf("%5s %12s %12s %16s %14s %16s %16s %14s\n", "turn", "prompt tok", "cached tok",
              "TTFT ms median", "TTFT ms mean", "total ms median", "floor ms median",
              "turn / floor");
  json rows = json::array();
  double first_ttft = 0.0;
  std::vector<double> later, later_floor;
  for (int t = 0; t < o.turns; ++t) {
    std::vector<double> ttft, total, prompt_tok, cached_tok, floor_ttft;
    for (const TurnResult& r : results[t]) {
      ttft.push_back(r.ttft_s * 1e3);
      total.push_back(r.total_s * 1e3);
      prompt_tok.push_back(static_cast<double>(r.prompt_tokens));
      cached_tok.push_back(static_cast<double>(r.cached_tokens));
    }
    for (const TurnResult& f : floors[t]) floor_ttft.push_back(f.ttft_s * 1e3);
    const double med = Median(ttft);
    json row = {{"turn", t + 1},
                {"prompt_tokens", Median(prompt_tok)},
                {"cached_tokens", Median(cached_tok)},
                {"ttft_ms_median", med},
                {"ttft_ms_mean", Mean(ttft)},
                {"total_ms_median", Median(total)},
                {"ttft_ms", ttft},
                {"total_ms", total}};
    if (t == 0) {
      first_ttft = med;
      std::printf("%5d %12.0f %12.0f %16.1f %14.1f %16.1f %16s %14s\n", t + 1, Median(prompt_tok),
                  Median(cached_tok), med, Mean(ttft), Median(total), "-", "-");
    } else {
      later.push_back(med);
      const double floor_med = Median(floor_ttft);
      later_floor.push_back(floor_med);
      std::printf("%5d %12.0f %12.0f %16.1f %14.1f %16.1f %16.1f %13.2fx\n", t + 1,
                  Median(prompt_tok), Median(cached_tok), med, Mean(ttft), Median(total), floor_med,
                  med / floor_med);
      row["floor_ttft_ms_median"] = floor_med;
      row["floor_ttft_ms"] = floor_ttft;
      row["turn_to_floor"] = med / floor_med;
    }
    rows.push_back(std::move(row));
  }
  const double ratio = first_ttft / Mean(later);
  const double to_floor = Mean(later) / Mean(later_floor);
  std::printf("first-turn TTFT / mean later-turn TTFT: %.1fx (aim: at least 10x)\n", ratio);
  std::printf(
      "mean later-turn TTFT / mean floor TTFT: %.2fx (aim: at most 1.5x; the floor is each "
      "later turn's new tokens prefilled on a context of whole cached chunks)\n",
      to_floor);
  for (const TurnResult& r : results[0]) {
    if (r.cached_tokens > 0) {
      std::printf("note: a first turn found %lld tokens cached, so it was not a cold prefill\n",
                  static_cast<long long>(r.cached_tokens));
      break;
    }
  }
  json delta = nullptr;
  if (metrics_before.ok() && metrics_after.ok() && metrics_before->code == 200 &&
      metrics_after->code == 200) {
    delta = json::object();
    for (const char* family : {"kdn_prompt_tokens_total", "kdn_requests_routed_total"}) {
      const auto before = LabelledCounters(metrics_before->body, family);
      const auto after = LabelledCounters(metrics_after->body, family);
      if (after.empty()) continue;
      std::printf("router %s during the conversations:", family);
      for (const auto& [label, v] : after) {
        const double d = v - (before.count(label) ? before.at(label) : 0.0);
        delta[std::string(family) + "{" + label + "}"] = d;
        std::printf(" %s +%.0f", label.c_str(), d);
      }
      std::printf("\n");
    }
  }
  return json{{"disaggregation", path.empty() ? json(nullptr) : json(path)},
              {"seed", seed},
              {"results", rows},
              {"first_to_later_ttft_ratio", ratio},
              {"later_to_floor_ttft_ratio", to_floor},
              {"later_ttft_ms_mean", Mean(later)},
              {"counters_delta", delta}};
}

Status Multiturn(const Common& c, const MultiturnOptions& o) {
  if (o.context_tokens < 1 || o.turns < 2 || o.turn_tokens < 1 || o.max_tokens < 1 ||
      o.conversations < 1) {
    return InvalidArgument("multiturn needs --turns >= 2 and the other counts >= 1");
  }
  for (const std::string& p : o.paths) {
    if (p != "always" && p != "auto" && p != "never") {
      return InvalidArgument("--paths takes always, auto and never, not '" + p + "'");
    }
  }
  KDN_ASSIGN_OR_RETURN(const Url url, ParseUrl(o.url));
  KDN_ASSIGN_OR_RETURN(const json health, GetJson(url, "/health"));
  KDN_ASSIGN_OR_RETURN(const json models, GetJson(url, "/v1/models"));
  std::string model = "?";
  if (models.contains("data") && !models["data"].empty())
    model = models["data"][0].value("id", "?");
  // A seed of its own each run by default: a rerun against the same
  // deployment must not find its first turns cached.
  const uint64_t seed = o.seed ? *o.seed : std::random_device{}();

  // One request first, outside the figures, so that no one-time cost of a
  // fresh deployment lands on the first conversation's first turn.
  std::mt19937_64 warm_rng(seed ^ 0x5eed);
  KDN_RETURN_IF_ERROR(Complete(url, RandomWords(warm_rng, 64), 2).status().WithContext("warm-up"));
  const std::vector<std::string> paths = o.paths.empty() ? std::vector<std::string>{""} : o.paths;
  json runs = json::array();
  for (size_t i = 0; i < paths.size(); ++i) {
    // Text of its own per path: no path finds another's conversations cached.
    KDN_ASSIGN_OR_RETURN(json run, MultiturnPath(url, o, model, paths[i], seed + 7919 * i));
    runs.push_back(std::move(run));
  }
  if (runs.size() > 1) {
    const double base = runs[0]["later_ttft_ms_mean"].get<double>();
    for (size_t i = 1; i < runs.size(); ++i) {
      std::printf("mean later-turn TTFT, disaggregation %s / %s: %.2fx\n", paths[i].c_str(),
                  paths[0].c_str(), runs[i]["later_ttft_ms_mean"].get<double>() / base);
    }
  }
  json out = {{"workload", "multiturn"},
              {"url", o.url},
              {"model", model},
              {"health", health},
              {"context_tokens", o.context_tokens},
              {"turns", o.turns},
              {"turn_tokens", o.turn_tokens},
              {"max_tokens", o.max_tokens},
              {"conversations", o.conversations},
              {"seed", seed},
              {"ttft", "from sending the request to the first event with a choices entry"},
              {"floor",
               "each later turn's new tokens (prompt tokens added since the previous "
               "prompt) on a context of whole cached chunks, 1 answer token, on the "
               "same path"},
              {"chunk_tokens", o.chunk_tokens}};
  if (runs.size() == 1) {
    for (auto& [k, v] : runs[0].items()) out[k] = v;
  } else {
    out["paths"] = runs;
  }
  Emit(c, out);
  return Status::Ok();
}

}  // namespace

int RunMultiturn(const Common& c, const MultiturnOptions& o) {
  if (Status s = Multiturn(c, o); !s.ok()) {
    std::fprintf(stderr, "kdn-bench: multiturn: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace kdn::bench
