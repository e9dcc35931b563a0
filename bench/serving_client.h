#pragma once
// kdn-bench's client of a running deployment through its HTTP API
// (docs/serving.md): one request on a fresh connection, /metrics samples,
// streamed completions timed as they arrive, and the figures the serving
// workloads (serving_multiturn.cpp, serving_load.cpp) share.

#include <boost/beast/http/verb.hpp>

#include <functional>
#include <initializer_list>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"

namespace kdn::bench {

struct Url {
  std::string text, host, port, prefix;  // prefix: a path before /v1/..., usually empty
};

Result<Url> ParseUrl(const std::string& s);

struct Reply {
  int code = 0;
  std::string body;
};

// One HTTP/1.1 request on a fresh connection; `sent`, if given, is set just
// before the request is written. While a 200 response arrives,
// `on_body` sees the whole body received so far (chunked framing removed)
// after every read, so that a stream is timed as it arrives; an error it
// returns ends the exchange.
Result<Reply> Exchange(const Url& url, boost::beast::http::verb verb, const std::string& path,
                       const std::string& body,
                       const std::function<Status(const std::string&)>& on_body = {},
                       Clock::time_point* sent = nullptr);

Result<json> GetJson(const Url& url, const std::string& path);

// The samples of /metrics text: every `name{labels} value`
// line whose name is one of `names`, keyed by the line up to the value.
std::map<std::string, double> MetricLines(const std::string& text,
                                          std::initializer_list<const char*> names);

// The samples of counter family `name` in Prometheus text, by their labels
// (what lies between the braces); empty when the router does not export it.
std::map<std::string, double> LabelledCounters(const std::string& text, const char* name);

struct TurnResult {
  double ttft_s = 0, total_s = 0;
  std::vector<double> gaps_s;  // between events with tokens, from the first on
  int64_t prompt_tokens = -1, cached_tokens = -1;
  std::string text;
};

// One streamed completion of `prompt` (greedy, `max_tokens` tokens whatever
// the model says, usage included), timed by its events. `path`: the
// request's "disaggregation" field (docs/serving.md, "Two paths"); empty:
// none, the router's own.
Result<TurnResult> Complete(const Url& url, const std::string& prompt, int max_tokens,
                            const std::string& path = "");

// `n` characters of lowercase words separated by spaces: one token each.
std::string RandomWords(std::mt19937_64& rng, int n);

double Median(std::vector<double> v);
// The value at quantile `q` (0 to 1) of `v`, nearest rank; 0 for none.
double Percentile(std::vector<double> v, double q);

}  // namespace kdn::bench
