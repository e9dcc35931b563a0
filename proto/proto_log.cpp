#include "proto_log.h"

#include <google/protobuf/stubs/logging.h>

#include <mutex>
#include <string>

#include "kdn/common/log.h"

namespace kdn::proto {

namespace {

void Handler(google::protobuf::LogLevel level, const char* file, int line,
             const std::string& message) {
  static LogLimiter limiter;  // one budget for all of protobuf's lines
  const LogLevel ours = level == google::protobuf::LOGLEVEL_INFO      ? LogLevel::kDebug
                        : level == google::protobuf::LOGLEVEL_WARNING ? LogLevel::kWarn
                                                                      : LogLevel::kError;
  limiter.Log(ours, "protobuf ({}:{}): {}", file, line, message);
}

}  // namespace

void RouteProtobufLogs() {
  static std::once_flag once;
  std::call_once(once, [] { google::protobuf::SetLogHandler(&Handler); });
}

}  // namespace kdn::proto
