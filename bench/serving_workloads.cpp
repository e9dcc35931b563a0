// kdn-bench's serving workloads: multiturn (see kdn_bench.cpp), a client of a
// running deployment through its HTTP API (docs/serving.md).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>
#include <cstdio>
#include <functional>
#include <map>
#include <numeric>
#include <random>
#include <sstream>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "bench_util.h"
#include "kdn/common/kv_block.h"

namespace kdn::bench {

namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

// Longest silence accepted from the router: a cold 4,096-token prefill of the
// small preset takes seconds on a few idle CPU cores, under a minute on busy ones.
constexpr auto kIdleTimeout = std::chrono::seconds(300);

struct Url {
  std::string text, host, port, prefix;  // prefix: a path before /v1/..., usually empty
};

Result<Url> ParseUrl(const std::string& s) {
  const std::string scheme = "http://";
  if (s.rfind(scheme, 0) != 0) return InvalidArgument("--url must be http://HOST:PORT, got " + s);
  Url u{s, "", "80", ""};
  std::string rest = s.substr(scheme.size());
  if (const size_t slash = rest.find('/'); slash != std::string::npos) {
    u.prefix = rest.substr(slash);
    rest.resize(slash);
  }
  while (!u.prefix.empty() && u.prefix.back() == '/') u.prefix.pop_back();
  if (const size_t colon = rest.rfind(':'); colon != std::string::npos) {
    u.port = rest.substr(colon + 1);
    rest.resize(colon);
  }
  u.host = rest;
  if (u.host.empty() || u.port.empty()) return InvalidArgument("--url has no host or port: " + s);
  return u;
}

// Runs one asynchronous operation to completion (beast's tcp_stream enforces
// its deadline only on asynchronous operations).
template <typename Start>
beast::error_code Await(asio::io_context& ioc, Start start) {
  beast::error_code result;
  start([&](beast::error_code ec, auto&&...) { result = ec; });
  ioc.restart();
  ioc.run();
  return result;
}

struct Reply {
  int code = 0;
  std::string body;
};

// One HTTP/1.1 request on a fresh connection; `sent`, if given, is set just
// before the request is written. While a 200 response arrives,
// `on_body` sees the whole body received so far (chunked framing removed)
// after every read, so that a stream is timed as it arrives; an error it
// returns ends the exchange.
Result<Reply> Exchange(const Url& url, http::verb verb, const std::string& path,
                       const std::string& body,
                       const std::function<Status(const std::string&)>& on_body = {},
                       Clock::time_point* sent = nullptr) {
  asio::io_context ioc;
  beast::tcp_stream stream(ioc);
  tcp::resolver resolver(ioc);
  beast::error_code ec;
  const auto endpoints = resolver.resolve(url.host, url.port, ec);
  if (ec) return Unavailable("cannot resolve " + url.host + ": " + ec.message());
  const std::string what = std::string(http::to_string(verb)) + " " + url.text + path;
  stream.expires_after(kIdleTimeout);
  ec = Await(ioc, [&](auto h) { stream.async_connect(endpoints, h); });
  if (ec) return Unavailable("cannot reach the router at " + url.text + ": " + ec.message());

  http::request<http::string_body> req(verb, url.prefix + path, 11);
  req.set(http::field::host, url.host + ":" + url.port);
  req.set(http::field::user_agent, "kdn-bench");
  if (verb == http::verb::post) {
    req.set(http::field::content_type, "application/json");
    req.body() = body;
  }
  req.prepare_payload();
  stream.expires_after(kIdleTimeout);
  if (sent) *sent = Clock::now();
  ec = Await(ioc, [&](auto h) { http::async_write(stream, req, h); });
  if (ec) return Unavailable(what + ": sending: " + ec.message());

  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(std::uint64_t{1} << 30);
  while (!parser.is_done()) {
    stream.expires_after(kIdleTimeout);
    ec = Await(ioc, [&](auto h) { http::async_read_some(stream, buffer, parser, h); });
    if (ec == beast::error::timeout) {
      return Status(StatusCode::kDeadlineExceeded, what + ": the router sent nothing for " +
                                                       std::to_string(kIdleTimeout.count()) + " s");
    }
    if (ec) return Unavailable(what + ": reading the response: " + ec.message());
    if (on_body && parser.is_header_done() && parser.get().result_int() == 200) {
      if (Status s = on_body(parser.get().body()); !s.ok()) return s;
    }
  }
  return Reply{static_cast<int>(parser.get().result_int()), std::move(parser.get().body())};
}

Result<json> GetJson(const Url& url, const std::string& path) {
  KDN_ASSIGN_OR_RETURN(Reply r, Exchange(url, http::verb::get, path, ""));
  if (r.code != 200)
    return Unavailable("GET " + path + ": " + std::to_string(r.code) + " " + r.body);
  json j = json::parse(r.body, nullptr, false);
  if (j.is_discarded()) return Corruption("GET " + path + ": not JSON: " + r.body);
  return j;
}

// The samples of /metrics text: every `name{labels} value`
// line whose name is one of `names`, keyed by the line up to the value.
std::map<std::string, double> MetricLines(const std::string& text,
                                          std::initializer_list<const char*> names) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    for (const char* name : names) {
      const size_t n = std::strlen(name);
      if (line.compare(0, n, name) != 0 || (line.size() > n && line[n] != '{' && line[n] != ' ')) {
        continue;
      }
      const size_t space = line.rfind(' ');
      if (space != std::string::npos)
        out[line.substr(0, space)] = std::strtod(line.c_str() + space + 1, nullptr);
    }
  }
  return out;
}

// The samples of counter family `name` in Prometheus text, by their labels
// (what lies between the braces); empty when the router does not export it.
std::map<std::string, double> LabelledCounters(const std::string& text, const char* name) {
  std::map<std::string, double> out;
  for (const auto& [line, v] : MetricLines(text, {name})) {
    const size_t open = line.find('{'), close = line.rfind('}');
    const std::string labels = open == std::string::npos || close == std::string::npos
                                   ? ""
                                   : line.substr(open + 1, close - open - 1);
    out[labels] += v;
  }
  return out;
}

struct TurnResult {
  double ttft_s = 0, total_s = 0;
  std::vector<double> gaps_s;  // between events with tokens, from the first on
  int64_t prompt_tokens = -1, cached_tokens = -1;
  std::string text;
};

// Server-sent events of a completion stream: `data: {json}` lines, a blank
// line between events, `data: [DONE]` last. TTFT is taken at the first event
// with a choices entry, whatever its text: a byte-level model may produce a
// token whose bytes the router holds back until a UTF-8 character completes.
class SseReader {
 public:
  // `sent`: when the request went out, set before any body arrives.
  SseReader(const Clock::time_point* sent, TurnResult* r) : sent_(sent), r_(r) {}

  Status Consume(const std::string& body) {
    for (size_t nl; (nl = body.find('\n', pos_)) != std::string::npos; pos_ = nl + 1) {
      std::string line = body.substr(pos_, nl - pos_);
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.empty()) {
        KDN_RETURN_IF_ERROR(Dispatch());
      } else if (line.rfind("data:", 0) == 0) {
        data_ += line.substr(line.size() > 5 && line[5] == ' ' ? 6 : 5);
      }
    }
    return Status::Ok();
  }

  Status Finish() {
    KDN_RETURN_IF_ERROR(Dispatch());
    if (!done_) return Unavailable("the stream ended without data: [DONE]");
    if (!first_) return Unavailable("the stream carried no token");
    return Status::Ok();
  }

 private:
  Status Dispatch() {
    std::string data = std::move(data_);
    data_.clear();
    if (data.empty()) return Status::Ok();
    if (data == "[DONE]") {
      done_ = true;
      return Status::Ok();
    }
    const json j = json::parse(data, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      return Corruption("an event that is not a JSON object: " + data);
    try {
      return Read(j);
    } catch (const json::exception& e) {
      return Corruption(std::string("an event of an unexpected shape (") + e.what() + "): " + data);
    }
  }

  Status Read(const json& j) {
    if (j.contains("error"))
      return Unavailable("the stream carried an error: " + j["error"].dump());
    if (j.contains("choices") && !j["choices"].empty()) {
      const auto now = Clock::now();
      if (!first_) r_->ttft_s = Seconds(*sent_, now);
      if (first_) r_->gaps_s.push_back(Seconds(last_, now));
      last_ = now;
      first_ = true;
      r_->text += j["choices"][0].value("text", "");
    }
    if (j.contains("usage") && j["usage"].is_object()) {
      const json& u = j["usage"];
      r_->prompt_tokens = u.value("prompt_tokens", int64_t{-1});
      if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object()) {
        r_->cached_tokens = u["prompt_tokens_details"].value("cached_tokens", int64_t{-1});
      }
    }
    return Status::Ok();
  }

  const Clock::time_point* sent_;
  TurnResult* r_;
  Clock::time_point last_;  // the last event with tokens
  size_t pos_ = 0;
  std::string data_;
  bool done_ = false, first_ = false;
};

// `path`: the request's "disaggregation" field (docs/serving.md, "Two
// paths"); empty: none, the router's own.
Result<TurnResult> Complete(const Url& url, const std::string& prompt, int max_tokens,
                            const std::string& path = "") {
  json req = {{"prompt", prompt},
              {"max_tokens", max_tokens},
              {"temperature", 0},
              {"stream", true},
              {"stream_options", {{"include_usage", true}}},
              {"ignore_eos", true}};
  if (!path.empty()) req["disaggregation"] = path;
  // Answers fed back into the next prompt are UTF-8 already; replace rather
  // than throw should the router ever send something that is not.
  const std::string body = req.dump(-1, ' ', false, json::error_handler_t::replace);
  TurnResult r;
  Clock::time_point sent;
  SseReader sse(&sent, &r);
  KDN_ASSIGN_OR_RETURN(Reply reply,
                       Exchange(
                           url, http::verb::post, "/v1/completions", body,
                           [&](const std::string& b) { return sse.Consume(b); }, &sent));
  r.total_s = Seconds(sent, Clock::now());
  if (reply.code != 200) {
    return Unavailable("POST /v1/completions: " + std::to_string(reply.code) + " " + reply.body);
  }
  KDN_RETURN_IF_ERROR(sse.Finish());
  return r;
}

// `n` characters of lowercase words separated by spaces: one token each.
std::string RandomWords(std::mt19937_64& rng, int n) {
  std::uniform_int_distribution<int> letter('a', 'z'), length(2, 9);
  std::string s;
  while (static_cast<int>(s.size()) < n) {
    if (!s.empty()) s += ' ';
    for (int i = length(rng); i > 0; --i) s += static_cast<char>(letter(rng));
  }
  s.resize(n);
  return s;
}

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

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double Mean(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0) / v.size();
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

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
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

int RunMultiturn(const Common& c, const MultiturnOptions& o) {
  if (Status s = Multiturn(c, o); !s.ok()) {
    std::fprintf(stderr, "kdn-bench: multiturn: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace kdn::bench
