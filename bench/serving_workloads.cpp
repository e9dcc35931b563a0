// kdn-bench's serving workloads: multiturn (see kdn_bench.cpp), a client of a
// running deployment through its HTTP API (docs/serving.md).
#include <algorithm>
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
  if (r.code != 200) return Unavailable("GET " + path + ": " + std::to_string(r.code) + " " + r.body);
  json j = json::parse(r.body, nullptr, false);
  if (j.is_discarded()) return Corruption("GET " + path + ": not JSON: " + r.body);
  return j;
}

// Sum of kdn_prompt_tokens_total by source, from Prometheus text; empty when
// the router does not export it.
std::map<std::string, double> PromptTokenCounters(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("kdn_prompt_tokens_total{", 0) != 0) continue;
    const size_t close = line.find('}');
    for (const char* source : {"computed", "cached"}) {
      if (close != std::string::npos &&
          line.find(std::string("source=\"") + source + "\"") < close) {
        out[source] += std::strtod(line.c_str() + close + 1, nullptr);
      }
    }
  }
  return out;
}

struct TurnResult {
  double ttft_s = 0, total_s = 0;
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
    if (j.is_discarded() || !j.is_object()) return Corruption("an event that is not a JSON object: " + data);
    try {
      return Read(j);
    } catch (const json::exception& e) {
      return Corruption(std::string("an event of an unexpected shape (") + e.what() + "): " + data);
    }
  }

  Status Read(const json& j) {
    if (j.contains("error")) return Unavailable("the stream carried an error: " + j["error"].dump());
    if (j.contains("choices") && !j["choices"].empty()) {
      if (!first_) r_->ttft_s = Seconds(*sent_, Clock::now());
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
  size_t pos_ = 0;
  std::string data_;
  bool done_ = false, first_ = false;
};

Result<TurnResult> Complete(const Url& url, const std::string& prompt, int max_tokens) {
  const json req = {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0},
                    {"stream", true}, {"stream_options", {{"include_usage", true}}},
                    {"ignore_eos", true}};
  // Answers fed back into the next prompt are UTF-8 already; replace rather
  // than throw should the router ever send something that is not.
  const std::string body = req.dump(-1, ' ', false, json::error_handler_t::replace);
  TurnResult r;
  Clock::time_point sent;
  SseReader sse(&sent, &r);
  KDN_ASSIGN_OR_RETURN(Reply reply,
                       Exchange(url, http::verb::post, "/v1/completions", body,
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

Status Multiturn(const Common& c, const MultiturnOptions& o) {
  if (o.context_tokens < 1 || o.turns < 2 || o.turn_tokens < 1 || o.max_tokens < 1 ||
      o.conversations < 1) {
    return InvalidArgument("multiturn needs --turns >= 2 and the other counts >= 1");
  }
  KDN_ASSIGN_OR_RETURN(const Url url, ParseUrl(o.url));
  KDN_ASSIGN_OR_RETURN(const json health, GetJson(url, "/health"));
  KDN_ASSIGN_OR_RETURN(const json models, GetJson(url, "/v1/models"));
  std::string model = "?";
  if (models.contains("data") && !models["data"].empty()) model = models["data"][0].value("id", "?");
  // A seed of its own each run by default: a rerun against the same
  // deployment must not find its first turns cached.
  const uint64_t seed = o.seed ? *o.seed : std::random_device{}();

  // One request first, outside the figures, so that no one-time cost of a
  // fresh deployment lands on the first conversation's first turn.
  std::mt19937_64 warm_rng(seed ^ 0x5eed);
  KDN_RETURN_IF_ERROR(Complete(url, RandomWords(warm_rng, 64), 2).status().WithContext("warm-up"));
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
      auto r = Complete(url, prompt, o.max_tokens);
      if (!r.ok()) {
        return r.status().WithContext("conversation " + std::to_string(conv + 1) + " turn " +
                                      std::to_string(t + 1));
      }
      std::fprintf(stderr,
                   "multiturn: conversation %d/%d turn %d/%d: %lld prompt tokens (%lld cached), "
                   "TTFT %.1f ms, total %.1f ms\n",
                   conv + 1, o.conversations, t + 1, o.turns,
                   static_cast<long long>(r->prompt_tokens), static_cast<long long>(r->cached_tokens),
                   r->ttft_s * 1e3, r->total_s * 1e3);
      if (t > 0) {
        const std::string fp = FloorPrompt(previous, previous_tokens,
                                           r->prompt_tokens - previous_tokens, o.chunk_tokens,
                                           floor_rng);
        auto f = Complete(url, fp, 1);
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

  std::printf("multiturn against %s (model %s): %d conversations of %d turns, a %d-token context, "
              "%d-token user turns, %d-token answers, seed %llu\n",
              o.url.c_str(), model.c_str(), o.conversations, o.turns, o.context_tokens,
              o.turn_tokens, o.max_tokens, static_cast<unsigned long long>(seed));
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
    json row = {{"turn", t + 1}, {"prompt_tokens", Median(prompt_tok)},
                {"cached_tokens", Median(cached_tok)}, {"ttft_ms_median", med},
                {"ttft_ms_mean", Mean(ttft)}, {"total_ms_median", Median(total)},
                {"ttft_ms", ttft}, {"total_ms", total}};
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
  std::printf("mean later-turn TTFT / mean floor TTFT: %.2fx (aim: at most 1.5x; the floor is each "
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
    const auto before = PromptTokenCounters(metrics_before->body);
    const auto after = PromptTokenCounters(metrics_after->body);
    if (!after.empty()) {
      delta = json::object();
      std::printf("router kdn_prompt_tokens_total during the conversations:");
      for (const auto& [source, v] : after) {
        const double d = v - (before.count(source) ? before.at(source) : 0.0);
        delta[source] = d;
        std::printf(" %s +%.0f", source.c_str(), d);
      }
      std::printf("\n");
    }
  }
  Emit(c, {{"workload", "multiturn"}, {"url", o.url}, {"model", model}, {"health", health},
           {"context_tokens", o.context_tokens}, {"turns", o.turns},
           {"turn_tokens", o.turn_tokens}, {"max_tokens", o.max_tokens},
           {"conversations", o.conversations}, {"seed", seed},
           {"ttft", "from sending the request to the first event with a choices entry"},
           {"floor", "each later turn's new tokens (prompt tokens added since the previous "
                     "prompt) on a context of whole cached chunks, 1 answer token"},
           {"results", rows}, {"first_to_later_ttft_ratio", ratio},
           {"later_to_floor_ttft_ratio", to_floor}, {"chunk_tokens", o.chunk_tokens},
           {"prompt_tokens_delta", delta}});
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
