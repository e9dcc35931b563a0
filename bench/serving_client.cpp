// kdn-bench's client of a deployment's HTTP API (serving_client.h).
#include "serving_client.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

namespace kdn::bench {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

// Longest silence accepted from the router: a cold 4,096-token prefill of the
// small preset takes seconds on a few idle CPU cores, under a minute on busy ones.
constexpr auto kIdleTimeout = std::chrono::seconds(300);

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

}  // namespace

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

Result<Reply> Exchange(const Url& url, http::verb verb, const std::string& path,
                       const std::string& body,
                       const std::function<Status(const std::string&)>& on_body,
                       Clock::time_point* sent) {
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

Result<TurnResult> Complete(const Url& url, const std::string& prompt, int max_tokens,
                            const std::string& path) {
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

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

}  // namespace kdn::bench
