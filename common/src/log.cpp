#include "kdn/common/log.h"

#include <atomic>
#include <cerrno>  // program_invocation_short_name (glibc)
#include <cstdlib>
#include <memory>

#include <spdlog/logger.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>

namespace kdn {

namespace {

constexpr const char* kLevelNames[] = {"trace", "debug", "info", "warn", "error", "off"};

// The level as the line shows it: padded to 5 characters, so that the roles
// line up.
class LevelFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    static constexpr std::string_view kPadded[] = {"trace", "debug", "info ", "warn ",
                                                   "error", "error", "off  "};
    const auto i = static_cast<size_t>(msg.level);
    const std::string_view s = i < std::size(kPadded) ? kPadded[i] : "?    ";
    dest.append(s.data(), s.data() + s.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<LevelFlag>();
  }
};

spdlog::level::level_enum SpdLevel(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return spdlog::level::trace;
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kOff: break;
  }
  return spdlog::level::off;
}

std::unique_ptr<spdlog::formatter> MakeFormatter(std::string_view role) {
  std::string escaped;
  for (char c : role) {
    if (c == '%') escaped += '%';
    escaped += c;
  }
  auto f = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
  f->add_flag<LevelFlag>('*').set_pattern("%Y-%m-%dT%H:%M:%S.%eZ %* " + escaped + " %v");
  return f;
}

LogLevel LevelFromEnv() {
  const char* env = std::getenv("KDN_LOG_LEVEL");
  if (env == nullptr) return LogLevel::kInfo;
  auto l = ParseLogLevel(env);
  return l.ok() ? *l : LogLevel::kInfo;
}

// The process's one logger. Its level is ours (level below): spdlog's own
// is trace, so that it never filters a line twice.
struct LogState {
  LogState() : level(static_cast<int>(LevelFromEnv())) {
    logger =
        std::make_shared<spdlog::logger>("kdn", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    logger->set_level(spdlog::level::trace);
    logger->flush_on(spdlog::level::trace);
    logger->set_formatter(MakeFormatter(program_invocation_short_name));
  }
  std::shared_ptr<spdlog::logger> logger;  // constant after construction
  std::atomic<int> level;
};

LogState& State() {
  // Never destroyed: threads may log while the process exits.
  static LogState* state = new LogState();
  return *state;
}

}  // namespace

const char* LogLevelName(LogLevel level) {
  const auto i = static_cast<size_t>(level);
  return i < std::size(kLevelNames) ? kLevelNames[i] : "?";
}

Result<LogLevel> ParseLogLevel(std::string_view name) {
  for (size_t i = 0; i < std::size(kLevelNames); ++i) {
    if (name == kLevelNames[i]) return static_cast<LogLevel>(i);
  }
  return InvalidArgument("log level '" + std::string(name) +
                         "' is not one of trace, debug, info, warn, error, off");
}

void InitLog(std::string_view role, std::string_view name, LogLevel level) {
  std::string shown(role);
  if (!name.empty()) shown.append("/").append(name);
  LogState& s = State();
  s.logger->set_formatter(MakeFormatter(shown));
  s.level = static_cast<int>(level);
}

void SetLogLevel(LogLevel level) { State().level = static_cast<int>(level); }

LogLevel GetLogLevel() { return static_cast<LogLevel>(State().level.load()); }

bool LogEnabled(LogLevel level) {
  return level != LogLevel::kOff && static_cast<int>(level) >= State().level.load();
}

void LogWrite(LogLevel level, std::string_view message) {
  if (!LogEnabled(level)) return;
  State().logger->log(SpdLevel(level), spdlog::string_view_t(message.data(), message.size()));
}

std::string FormatRequestId(uint64_t id) { return fmt::format("{:016x}", id); }

LogLimiter::LogLimiter(int per_second, std::function<TimePoint()> clock)
    : per_second_(per_second > 0 ? per_second : 1), clock_(std::move(clock)) {}

LogLimiter::Decision LogLimiter::Admit() {
  const TimePoint now = clock_ ? clock_() : std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (!started_ || now - window_start_ >= std::chrono::seconds(1)) {
    started_ = true;
    window_start_ = now;
    in_window_ = 0;
  }
  if (in_window_ >= per_second_) {
    ++suppressed_;
    return {};
  }
  ++in_window_;
  Decision d{true, suppressed_};
  suppressed_ = 0;
  return d;
}

void LogLimiter::WriteSuppressed(LogLevel level, uint64_t count) {
  LogWrite(level, fmt::format("suppressed {} similar messages", count));
}

}  // namespace kdn
