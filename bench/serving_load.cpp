// kdn-bench serve-load (see kdn_bench.cpp): concurrent streams through a
// running deployment's HTTP API, timed and summarized (serving_client.h).
#include <boost/beast/http/verb.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "bench_util.h"
#include "kdn/common/kv_block.h"
#include "serving_client.h"

namespace kdn::bench {

namespace {

namespace http = boost::beast::http;

// Resident memory of each process of a kdn-launch run dir (deployment.json),
// in MiB, by name; empty without a run dir.
std::map<std::string, double> ProcessRss(const std::string& run_dir) {
  std::map<std::string, double> out;
  if (run_dir.empty()) return out;
  std::ifstream in(run_dir + "/deployment.json");
  const json info = json::parse(in, nullptr, false);
  if (info.is_discarded() || !info.contains("processes")) return out;
  for (const json& p : info["processes"]) {
    std::ifstream status("/proc/" + std::to_string(p.value("pid", 0)) + "/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("VmRSS:", 0) == 0)
        out[p.value("name", "?")] = std::strtod(line.c_str() + 6, nullptr) / 1024;
    }
  }
  return out;
}

struct LoadResult {
  bool ok = false;
  std::string error;
  double ttft_s = 0, total_s = 0, itl_s = 0;  // itl: the request's mean gap between tokens
  std::vector<double> gaps_s;                 // each gap between its token events
  int64_t prompt_tokens = 0, cached_tokens = 0;
  int turn = 0;  // of its conversation, from 0 (--chat-turns)
};

// One run of the load, its requests on `path` (their "disaggregation"
// field; empty: none): its summary printed and returned. `roomy`: the
// overcommit case's deployment that needs no preemption (no 2x aim).
Result<json> ServeLoadRun(const ServeLoadOptions& o, const Url& url, const std::string& path,
                          uint64_t seed, bool roomy = false) {
  const int requests = o.soak > 0 ? o.soak : o.requests;
  if (!path.empty()) std::printf("serve-load, disaggregation %s:\n", path.c_str());
  // Documents, and a Zipf law over them: document k (from 0) is asked about
  // with weight 1 / (k + 1)^s.
  std::mt19937_64 doc_rng(seed);
  std::vector<std::string> docs;
  const int documents = o.overcommit ? requests : o.documents;  // overcommit: one each
  for (int i = 0; i < documents; ++i) docs.push_back(RandomWords(doc_rng, o.doc_chars));
  std::vector<double> cdf;
  double sum = 0;
  for (int k = 0; k < o.documents; ++k) cdf.push_back(sum += 1.0 / std::pow(k + 1.0, o.zipf));

  KDN_RETURN_IF_ERROR(Complete(url, RandomWords(doc_rng, 64), 2).status().WithContext("warm-up"));
  auto metrics_before = Exchange(url, http::verb::get, "/metrics", "");
  if (!metrics_before.ok()) return metrics_before.status().WithContext("GET /metrics");
  int64_t pool_tokens = 0;  // the decode workers' KV pools, in tokens
  if (o.overcommit) {
    KDN_ASSIGN_OR_RETURN(const json status, GetJson(url, "/status.json"));
    for (const json& w : status.value("workers", json::array())) {
      if (w.value("role", "") == "decode") {
        pool_tokens += w.value("total_kv_blocks", int64_t{0}) * kKvBlockTokens;
      }
    }
  }
  const auto rss_start = ProcessRss(o.run_dir);
  std::map<std::string, double> rss_warm;
  const int warm_at = std::max(1, requests / 10);  // RSS after warm-up: the first 10%

  std::vector<LoadResult> results(requests);
  std::atomic<int> next{0}, done{0};
  std::mutex mu;
  const auto started = Clock::now();
  auto client = [&](int id) {
    std::mt19937_64 rng(seed * 7919 + id);
    std::uniform_real_distribution<double> u(0, sum);
    // A chat (--chat-turns): the document and a question, then each turn the
    // answer and a new question on top of the conversation so far.
    std::string conversation;
    int turn = 0;
    for (int i; (i = next.fetch_add(1)) < requests;) {
      if (o.overcommit) {
        conversation = docs[static_cast<size_t>(i)];
      } else if (turn == 0) {
        const int doc =
            static_cast<int>(std::lower_bound(cdf.begin(), cdf.end(), u(rng)) - cdf.begin());
        conversation = docs[std::min(doc, o.documents - 1)];
      }
      const std::string prompt = conversation + "\n" + RandomWords(rng, o.question_chars);
      auto r = Complete(url, prompt, o.max_tokens, path);
      LoadResult& out = results[i];
      out.turn = turn;
      conversation = r.ok() ? prompt + r->text : prompt;
      turn = (turn + 1) % std::max(1, o.chat_turns);
      if (r.ok()) {
        out.ok = true;
        out.gaps_s = r->gaps_s;
        out.ttft_s = r->ttft_s;
        out.total_s = r->total_s;
        out.itl_s = o.max_tokens > 1 ? (r->total_s - r->ttft_s) / (o.max_tokens - 1) : 0;
        out.prompt_tokens = r->prompt_tokens;
        out.cached_tokens = r->cached_tokens;
      } else {
        out.error = r.status().message().substr(0, 160);
      }
      const int d = done.fetch_add(1) + 1;
      std::lock_guard<std::mutex> lock(mu);
      if (d == warm_at) rss_warm = ProcessRss(o.run_dir);
      if (d % std::max(1, requests / 20) == 0 || d == requests) {
        std::fprintf(stderr, "serve-load: %d/%d requests, %.1f s\n", d, requests,
                     Seconds(started, Clock::now()));
      }
    }
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < o.clients; ++i) threads.emplace_back(client, i);
  for (std::thread& t : threads) t.join();
  const double wall = Seconds(started, Clock::now());

  // Drained: what the deployment holds now must be what it held before. The
  // workers' figures reach /metrics with the router's pings (every 250 ms):
  // read them a second after the last request left.
  std::map<std::string, double> after_lines;
  for (int tries = 0, idle = 0; tries < 100 && idle < 10; ++tries) {
    auto m = Exchange(url, http::verb::get, "/metrics", "");
    if (!m.ok()) return m.status().WithContext("GET /metrics");
    after_lines = MetricLines(
        m->body, {"kdn_requests_in_flight", "kdn_worker_free_kv_blocks", "kdn_prompt_tokens_total",
                  "kdn_queue_depth", "kdn_worker_leased_kv_blocks", "kdn_worker_kvbus_leased_bytes",
                  "kdn_worker_preemptions_total", "kdn_worker_resumes_by_recompute_total"});
    idle = after_lines["kdn_requests_in_flight"] == 0 ? idle + 1 : 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const auto before_lines =
      MetricLines(metrics_before->body,
                  {"kdn_worker_free_kv_blocks", "kdn_prompt_tokens_total",
                   "kdn_worker_preemptions_total", "kdn_worker_resumes_by_recompute_total"});
  // Of counter family `name`, summed over its lines: after less before.
  const auto grew = [&](const char* name) {
    double d = 0;
    for (const auto& [line, v] : after_lines) {
      if (line.rfind(name, 0) == 0) d += v - (before_lines.count(line) ? before_lines.at(line) : 0);
    }
    return d;
  };
  const auto rss_end = ProcessRss(o.run_dir);

  std::vector<double> ttft, itl, gaps, ttft_later;
  std::map<std::string, int> errors;
  int ok = 0, good = 0;
  int64_t prompt_tokens = 0;
  for (const LoadResult& r : results) {
    if (!r.ok) {
      ++errors[r.error];
      continue;
    }
    ++ok;
    prompt_tokens += r.prompt_tokens;
    ttft.push_back(r.ttft_s * 1e3);
    if (r.turn > 0) ttft_later.push_back(r.ttft_s * 1e3);
    if (o.max_tokens > 1) itl.push_back(r.itl_s * 1e3);
    for (double g : r.gaps_s) gaps.push_back(g * 1e3);
    good += r.ttft_s * 1e3 <= o.ttft_slo_ms;
  }
  double cached = 0, total = 0;
  for (const auto& [line, v] : after_lines) {
    if (line.rfind("kdn_prompt_tokens_total", 0) != 0) continue;
    const double d = v - (before_lines.count(line) ? before_lines.at(line) : 0.0);
    total += d;
    if (line.find("source=\"cached\"") != std::string::npos) cached += d;
  }
  json leaked = json::object();
  int64_t leaked_blocks = 0;
  for (const auto& [line, v] : before_lines) {
    if (line.rfind("kdn_worker_free_kv_blocks", 0) != 0 || !after_lines.count(line)) continue;
    const double lost = v - after_lines.at(line);
    leaked[line] = lost;
    leaked_blocks += static_cast<int64_t>(std::max(0.0, lost));
  }
  // Leases still held once drained: each would be let go only when it runs
  // out, so any here is a request or a transfer the deployment lost track of.
  json leases = json::object();
  double leases_held = 0;
  for (const auto& [line, v] : after_lines) {
    if (line.rfind("kdn_worker_leased_kv_blocks", 0) != 0 &&
        line.rfind("kdn_worker_kvbus_leased_bytes", 0) != 0) {
      continue;
    }
    leases[line] = v;
    leases_held += v;
  }
  json rss = json::object();
  double worst_growth = 0;
  for (const auto& [name, mib] : rss_end) {
    const double start = rss_start.count(name) ? rss_start.at(name) : 0;
    const double warm = rss_warm.count(name) ? rss_warm.at(name) : start;
    const double growth = warm > 0 ? (mib - warm) / warm : 0;
    worst_growth = std::max(worst_growth, growth);
    rss[name] = {{"start_mib", start},
                 {"after_warmup_mib", warm},
                 {"end_mib", mib},
                 {"growth_after_warmup", growth}};
  }
  const int failed = requests - ok;
  std::printf("serve-load: %d requests, %d clients, %d documents (Zipf s=%.2f), %d answer tokens\n",
              requests, o.clients, o.documents, o.zipf, o.max_tokens);
  std::printf("  throughput      %.2f requests/s, %.1f answer tokens/s\n", ok / wall,
              ok * static_cast<double>(o.max_tokens) / wall);
  std::printf("  goodput         %.2f requests/s within a TTFT of %.0f ms (%d of %d)\n",
              good / wall, o.ttft_slo_ms, good, ok);
  std::printf("  TTFT            p50 %.1f ms, p99 %.1f ms\n", Percentile(ttft, 0.5),
              Percentile(ttft, 0.99));
  std::printf("  inter-token     p50 %.2f ms, p99 %.2f ms (each request's mean gap)\n",
              Percentile(itl, 0.5), Percentile(itl, 0.99));
  std::printf("  token gaps      p50 %.2f ms, p99 %.2f ms (every gap between token events)\n",
              Percentile(gaps, 0.5), Percentile(gaps, 0.99));
  if (!ttft_later.empty()) {
    std::printf("  later turns     TTFT p50 %.1f ms, p99 %.1f ms (%zu requests)\n",
                Percentile(ttft_later, 0.5), Percentile(ttft_later, 0.99), ttft_later.size());
  }
  std::printf("  KDN hit rate    %.1f%% of prompt tokens cached\n",
              total > 0 ? 100 * cached / total : 0);
  // The overcommit case: what the load would hold at its longest, against
  // the pools (the failed requests' prompts counted at the mean).
  const double load_tokens =
      ok > 0 ? (static_cast<double>(prompt_tokens) / ok + o.max_tokens) * requests : 0;
  const double overcommit = pool_tokens > 0 ? load_tokens / static_cast<double>(pool_tokens) : 0;
  if (o.overcommit) {
    std::printf(
        "  overcommit      prompt + max_tokens of all requests %.0f tokens, %.2fx the decode "
        "pools' %lld%s\n",
        load_tokens, overcommit, static_cast<long long>(pool_tokens),
        roomy            ? " (the roomy deployment)"
        : overcommit < 2 ? " (not an overcommit: aim 2x; raise --requests or --max-tokens)"
                         : "");
    std::printf(
        "  completed       %d of %d (%.2f; aim 1.0), %.0f preemptions, %.0f resumes "
        "by recompute\n",
        ok, requests, static_cast<double>(ok) / requests, grew("kdn_worker_preemptions_total"),
        grew("kdn_worker_resumes_by_recompute_total"));
  }
  std::printf("  errors          %d\n", failed);
  for (const auto& [what, n] : errors) std::printf("    %d x %s\n", n, what.c_str());
  std::printf("  KV blocks not given back after the run: %lld\n",
              static_cast<long long>(leaked_blocks));
  std::printf(
      "  held under leases after the run: %.0f (KV blocks of requests not started, kvbus "
      "bytes granted)\n",
      leases_held);
  for (const auto& [name, r] : rss.items()) {
    std::printf("  RSS %-10s %.1f MiB at start, %.1f after warm-up, %.1f at the end (%+.1f%%)\n",
                name.c_str(), r["start_mib"].get<double>(), r["after_warmup_mib"].get<double>(),
                r["end_mib"].get<double>(), 100 * r["growth_after_warmup"].get<double>());
  }
  json errs = json::object();
  for (const auto& [what, n] : errors) errs[what] = n;
  json out = {{"workload", "serve-load"},
              {"url", o.url},
              {"requests", requests},
              {"disaggregation", path.empty() ? json(nullptr) : json(path)},
              {"chat_turns", o.chat_turns},
              {"gap_ms_p50", Percentile(gaps, 0.5)},
              {"gap_ms_p99", Percentile(gaps, 0.99)},
              {"later_turn_ttft_ms_p50",
               ttft_later.empty() ? json(nullptr) : json(Percentile(ttft_later, 0.5))},
              {"later_turn_ttft_ms_p99",
               ttft_later.empty() ? json(nullptr) : json(Percentile(ttft_later, 0.99))},
              {"clients", o.clients},
              {"documents", o.documents},
              {"zipf", o.zipf},
              {"doc_chars", o.doc_chars},
              {"question_chars", o.question_chars},
              {"max_tokens", o.max_tokens},
              {"seed", seed},
              {"seconds", wall},
              {"requests_per_s", ok / wall},
              {"ttft_slo_ms", o.ttft_slo_ms},
              {"goodput_requests_per_s", good / wall},
              {"ttft_ms_p50", Percentile(ttft, 0.5)},
              {"ttft_ms_p99", Percentile(ttft, 0.99)},
              {"itl_ms_p50", Percentile(itl, 0.5)},
              {"itl_ms_p99", Percentile(itl, 0.99)},
              {"itl", "each request's mean gap between tokens: (total - TTFT) / (tokens - 1)"},
              {"hit_rate", total > 0 ? cached / total : 0.0},
              {"errors", failed},
              {"error_kinds", errs},
              {"kv_blocks_leaked", leaked_blocks},
              {"free_kv_blocks_lost", leaked},
              {"leases_held_after", leases},
              {"leases_held", leases_held},
              {"rss", rss},
              {"rss_growth_after_warmup_max", worst_growth},
              {"completed_share", static_cast<double>(ok) / requests},
              {"answer_tokens_per_s", ok * static_cast<double>(o.max_tokens) / wall}};
  if (o.overcommit) {
    out["overcommit"] = {{"pool_tokens", pool_tokens},
                         {"load_tokens", load_tokens},
                         {"load_over_pool", overcommit},
                         {"preemptions", grew("kdn_worker_preemptions_total")},
                         {"resumes_by_recompute", grew("kdn_worker_resumes_by_recompute_total")}};
  }
  if (o.soak > 0) {
    const bool pass = failed == 0 && leaked_blocks == 0 && leases_held == 0 &&
                      (rss_end.empty() || worst_growth < 0.05);
    std::printf(
        "soak: %s (aims: 0 errors, 0 KV blocks kept, 0 leases held, RSS growth after "
        "warm-up under 5%%%s)\n",
        pass ? "met" : "MISSED", o.run_dir.empty() ? "; no --run-dir, RSS not read" : "");
    if (!pass) return Status(StatusCode::kInternal, "the soak missed its aims");
  }
  return out;
}

Status ServeLoad(const Common& c, const ServeLoadOptions& o) {
  for (const std::string& p : o.paths) {
    if (p != "always" && p != "auto" && p != "never") {
      return InvalidArgument("--paths takes always, auto and never, not '" + p + "'");
    }
  }
  KDN_ASSIGN_OR_RETURN(const Url url, ParseUrl(o.url));
  const uint64_t seed = o.seed ? *o.seed : std::random_device{}();
  if (o.overcommit && (o.chat_turns > 1 || !o.paths.empty())) {
    return InvalidArgument("--overcommit takes neither --chat-turns nor --paths");
  }
  if (!o.roomy_url.empty()) {
    // The same load (the same text) on the overcommitted deployment, then on
    // the roomy one.
    KDN_ASSIGN_OR_RETURN(const Url roomy, ParseUrl(o.roomy_url));
    std::printf("serve-load on %s (overcommitted):\n", o.url.c_str());
    KDN_ASSIGN_OR_RETURN(json tight, ServeLoadRun(o, url, "", seed));
    std::printf("serve-load on %s (roomy):\n", o.roomy_url.c_str());
    KDN_ASSIGN_OR_RETURN(json room, ServeLoadRun(o, roomy, "", seed, /*roomy=*/true));
    const auto ratio = [&](const char* key) {
      return tight[key].get<double>() / std::max(room[key].get<double>(), 1e-9);
    };
    const json ratios = {{"completed_share", ratio("completed_share")},
                         {"answer_tokens_per_s", ratio("answer_tokens_per_s")},
                         {"ttft_ms_p50", ratio("ttft_ms_p50")},
                         {"ttft_ms_p99", ratio("ttft_ms_p99")}};
    std::printf(
        "overcommitted against roomy: completed %.2f against %.2f, answer tokens/s %.2fx, "
        "TTFT p50 %.2fx, p99 %.2fx\n",
        tight["completed_share"].get<double>(), room["completed_share"].get<double>(),
        ratios["answer_tokens_per_s"].get<double>(), ratios["ttft_ms_p50"].get<double>(),
        ratios["ttft_ms_p99"].get<double>());
    Emit(c, {{"workload", "serve-load"},
             {"overcommit", tight},
             {"roomy", room},
             {"overcommit_over_roomy", ratios},
             {"seed", seed}});
    if (tight["completed_share"].get<double>() < 1 || room["completed_share"].get<double>() < 1) {
      return Status(StatusCode::kInternal, "requests failed: the completed share's aim is 1.0");
    }
    return Status::Ok();
  }
  const std::vector<std::string> paths = o.paths.empty() ? std::vector<std::string>{""} : o.paths;
  json runs = json::array();
  for (size_t i = 0; i < paths.size(); ++i) {
    // Text of its own per path: no run finds another's documents cached.
    KDN_ASSIGN_OR_RETURN(json run, ServeLoadRun(o, url, paths[i], seed + 104729 * i));
    runs.push_back(std::move(run));
  }
  if (runs.size() == 1) {
    Emit(c, runs[0]);
    return Status::Ok();
  }
  const json& base = runs[0];
  for (size_t i = 1; i < runs.size(); ++i) {
    const json& r = runs[i];
    std::printf(
        "disaggregation %s against %s: token gap p99 %.2fx, inter-token p99 %.2fx, "
        "TTFT p50 %.2fx, throughput %.2fx\n",
        paths[i].c_str(), paths[0].c_str(),
        r["gap_ms_p99"].get<double>() / base["gap_ms_p99"].get<double>(),
        r["itl_ms_p99"].get<double>() / base["itl_ms_p99"].get<double>(),
        r["ttft_ms_p50"].get<double>() / base["ttft_ms_p50"].get<double>(),
        r["requests_per_s"].get<double>() / base["requests_per_s"].get<double>());
  }
  Emit(c, {{"workload", "serve-load"}, {"url", o.url}, {"seed", seed}, {"paths", runs}});
  return Status::Ok();
}

}  // namespace

int RunServeLoad(const Common& c, const ServeLoadOptions& o) {
  if (Status s = ServeLoad(c, o); !s.ok()) {
    std::fprintf(stderr, "kdn-bench: serve-load: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace kdn::bench
