#pragma once
// What kdn-router's HTTP side shares between its parts (private to
// router/src): the server's state, one session per connection
// (http_session.cpp), the pages that show the workers (status_pages.cpp).
// The I/O thread alone touches ServerState's mutable members, but for the
// parse pool's reads of `served`, which is constant.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include "kdn/model/config.h"
#include "kdn/router/metrics.h"
#include "kdn/router/openai.h"
#include "kdn/router/router.h"
#include "kdn/router/status.h"
#include "kdn/text/tokenizer.h"

namespace kdn::router {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

// The largest request body one request may send (413 past it).
constexpr uint64_t kBodyLimit = 16u << 20;

// The HTTP status a failed job maps to.
ApiError JobError(const Status& st);
// Model output may hold bytes that are not UTF-8 (a byte-level model can emit
// anything); they become U+FFFD, as OpenAI's server does, instead of failing.
std::string Dump(const json& j);
std::string SseEvent(const std::string& data);
std::string Chunked(const std::string& piece);
json ProgressJson(const InjectProgress& p, bool final);

// The request-body bytes all sessions buffer, against --max-body-buffer-mib.
// The I/O thread's alone.
class BodyBudget {
 public:
  explicit BodyBudget(uint64_t cap = 0) : cap_(cap) {}
  // Counts `bytes` more unless that goes past the cap.
  bool TryReserve(uint64_t bytes) {
    if (bytes > cap_ - std::min(cap_, reserved_)) return false;
    reserved_ += bytes;
    return true;
  }
  void Release(uint64_t bytes) { reserved_ -= std::min(bytes, reserved_); }
  uint64_t reserved() const { return reserved_; }

 private:
  uint64_t cap_;
  uint64_t reserved_ = 0;
};

// Everything a session reads: the model's view, metrics, the backend.
struct ServerState {
  // Request-body bytes being read or served (--max-body-buffer-mib).
  BodyBudget bodies;
  RouterOptions options;
  model::ModelConfig config;
  std::unique_ptr<text::Tokenizer> tokenizer;
  text::ChatTemplate chat_template;
  ServedModel served;
  Metrics metrics;
  std::unique_ptr<Backend> backend;
  int64_t started = UnixNow();

  asio::io_context io{1};
  // Requests' JSON parsing and tokenizing (megabytes of body, tens of
  // thousands of tokens) run here, off the one I/O thread, which must keep
  // serving /health and other streams meanwhile. Destroyed before `io`.
  asio::thread_pool parse_pool{2};
  std::optional<tcp::acceptor> acceptor;
  // Between accepts that fail (out of file descriptors, which a try does not
  // change): 10 ms, doubling to 1 s, back to none after a success.
  std::optional<asio::steady_timer> accept_timer;
  std::chrono::milliseconds accept_backoff{0};
  int sessions = 0;  // open connections (the I/O thread's alone)
  std::string url;
  std::thread thread;

  // What /health, /metrics and the status page render.
  StatusSnapshot Snapshot() const {
    RouterFigures figures = metrics.Figures();
    const PinBook::Totals pins = backend->PinTotals();
    figures.pins = pins.pins;
    figures.pinned_bytes = pins.bytes;
    figures.pin_hits = pins.hits;
    figures.pins_refused = pins.refused;
    return {served.name, UnixNow(), started, backend->Workers(), std::move(figures)};
  }
};

// Serves one accepted connection until it closes.
void StartSession(tcp::socket socket, ServerState& state);

}  // namespace kdn::router
