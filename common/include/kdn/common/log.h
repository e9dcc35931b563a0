#pragma once
// The processes' log: leveled lines on stderr, over spdlog (docs/serving.md,
// "Logs"). A line is
//
//   2026-11-24T10:15:03.412Z info  prefill/prefill-0 req=3f2a9c1b00000007 received: ...
//
// an ISO 8601 UTC timestamp with milliseconds, the level, the process role
// (with the worker's name when it has one) and the message. A request's lines
// carry `req=` and its id (ReqId below) in every process, so that grep of one
// id across the logs tells the request's story. stdout is never written: the
// programs print only their endpoint there.
//
// InitLog sets the role and the level once, at the start of main. Before it
// (and in programs that never call it: tests, tools, benchmarks) the role is
// the program's name and the level is $KDN_LOG_LEVEL, else info.
//
// Messages are fmt format strings, checked at compile time:
//   LogInfo("{} accepted: {} prompt tokens", ReqId{id}, n);
// Arguments are formatted only when the level is on.
//
// Thread-safe: every function, from any thread; lines are written whole.

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/core.h>

#include "kdn/common/status.h"

namespace kdn {

enum class LogLevel { kTrace = 0, kDebug, kInfo, kWarn, kError, kOff };

// "trace", "debug", "info", "warn", "error" or "off" (as --log-level takes them).
const char* LogLevelName(LogLevel level);
// The inverse of LogLevelName; INVALID_ARGUMENT naming the levels otherwise.
Result<LogLevel> ParseLogLevel(std::string_view name);

// Sets the process's role ("router", "prefill", "decode", "store"), its name
// when it has one ("prefill-0": the role shows as "prefill/prefill-0") and
// the level. Call once, early in main; later calls replace both.
void InitLog(std::string_view role, std::string_view name, LogLevel level);
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
bool LogEnabled(LogLevel level);
// Writes one line at `level` (dropped when the level is off). The formatting
// functions below call it.
void LogWrite(LogLevel level, std::string_view message);

// A request id as it appears in every process's lines: "req=" and 16
// lower-case hex digits (fixed width, so that grep of one never matches
// another).
struct ReqId {
  uint64_t id = 0;
};
// The id's 16 hex digits alone, as the router returns it in X-Request-Id.
std::string FormatRequestId(uint64_t id);

// Bytes shown as lower-case hex digits (a kvbus transfer id in a log line).
struct HexBytes {
  std::string_view bytes;
};

template <typename... Args>
void Log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
  if (LogEnabled(level)) LogWrite(level, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void LogTrace(fmt::format_string<Args...> format, Args&&... args) {
  Log(LogLevel::kTrace, format, std::forward<Args>(args)...);
}
template <typename... Args>
void LogDebug(fmt::format_string<Args...> format, Args&&... args) {
  Log(LogLevel::kDebug, format, std::forward<Args>(args)...);
}
template <typename... Args>
void LogInfo(fmt::format_string<Args...> format, Args&&... args) {
  Log(LogLevel::kInfo, format, std::forward<Args>(args)...);
}
template <typename... Args>
void LogWarn(fmt::format_string<Args...> format, Args&&... args) {
  Log(LogLevel::kWarn, format, std::forward<Args>(args)...);
}
template <typename... Args>
void LogError(fmt::format_string<Args...> format, Args&&... args) {
  Log(LogLevel::kError, format, std::forward<Args>(args)...);
}

// LogLimiter: rate-limits one call site of a line that can repeat without
// bound (an accept loop that fails on every try, a peer that sends garbage
// in a loop). At most `per_second` lines go out in any one-second window;
// the rest are counted, and the next line let through is preceded by one
// "suppressed K similar messages" line. (A count still held when the
// repeats stop is never written.) Lines whose level is off are neither
// written nor counted.
//
// Thread-safe. Keep one per call site, e.g. a function-local static, or a
// member of the object whose loop logs.
class LogLimiter {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  // `clock`: steady_clock::now when empty (tests inject one).
  explicit LogLimiter(int per_second = 5, std::function<TimePoint()> clock = {});

  // Whether a line goes out now, and how many were held back before it (0
  // when none, or when this one is held back too). Counts the line.
  struct Decision {
    bool emit = false;
    uint64_t suppressed = 0;
  };
  Decision Admit();

  template <typename... Args>
  void Log(LogLevel level, fmt::format_string<Args...> format, Args&&... args) {
    if (!LogEnabled(level)) return;
    const Decision d = Admit();
    if (!d.emit) return;
    if (d.suppressed > 0) WriteSuppressed(level, d.suppressed);
    LogWrite(level, fmt::format(format, std::forward<Args>(args)...));
  }
  template <typename... Args>
  void Warn(fmt::format_string<Args...> format, Args&&... args) {
    Log(LogLevel::kWarn, format, std::forward<Args>(args)...);
  }
  template <typename... Args>
  void Error(fmt::format_string<Args...> format, Args&&... args) {
    Log(LogLevel::kError, format, std::forward<Args>(args)...);
  }

 private:
  static void WriteSuppressed(LogLevel level, uint64_t count);

  // Constant after construction.
  const int per_second_;
  const std::function<TimePoint()> clock_;

  std::mutex mu_;
  TimePoint window_start_{};  // guarded by mu_
  int in_window_ = 0;         // guarded by mu_: lines let through in this window
  uint64_t suppressed_ = 0;   // guarded by mu_: held back since the last one let through
  bool started_ = false;      // guarded by mu_
};

}  // namespace kdn

template <>
struct fmt::formatter<kdn::ReqId> {
  constexpr auto parse(fmt::format_parse_context& ctx) -> decltype(ctx.begin()) {
    return ctx.begin();
  }
  auto format(kdn::ReqId r, fmt::format_context& ctx) const -> decltype(ctx.out()) {
    return fmt::format_to(ctx.out(), "req={:016x}", r.id);
  }
};

template <>
struct fmt::formatter<kdn::HexBytes> {
  constexpr auto parse(fmt::format_parse_context& ctx) -> decltype(ctx.begin()) {
    return ctx.begin();
  }
  auto format(kdn::HexBytes h, fmt::format_context& ctx) const -> decltype(ctx.out()) {
    static constexpr char kDigits[] = "0123456789abcdef";
    auto out = ctx.out();
    for (const char c : h.bytes) {
      const auto b = static_cast<unsigned char>(c);
      *out++ = kDigits[b >> 4];
      *out++ = kDigits[b & 15];
    }
    return out;
  }
};
