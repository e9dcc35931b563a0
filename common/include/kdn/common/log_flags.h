#pragma once
// --log-level, the flag every kdn service takes (kdn-router, kdn-prefill,
// kdn-decode, kdn-store). Header-only, so that only the programs' mains see
// CLI11.

#include <CLI/CLI.hpp>

#include <cstdlib>
#include <string>
#include <string_view>

#include "kdn/common/log.h"

namespace kdn {

struct LogFlags {
  std::string level;  // empty: $KDN_LOG_LEVEL, else info

  void Add(CLI::App& app) {
    app.add_option("--log-level", level,
                   "Log lines on stderr at this level and above: trace, debug, info (one line "
                   "per request milestone), warn, error or off (default: $KDN_LOG_LEVEL, else "
                   "info)")
        ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  }

  // After parsing: the process's role ("router", "prefill", ...), its name
  // when it has one, and the level (InitLog). INVALID_ARGUMENT, with the log
  // set up at info, when $KDN_LOG_LEVEL is used and is not a level.
  Status Init(std::string_view role, std::string_view name = {}) const {
    std::string chosen = level;
    if (chosen.empty()) {
      const char* env = std::getenv("KDN_LOG_LEVEL");
      chosen = env != nullptr && *env != '\0' ? env : "info";
    }
    auto l = ParseLogLevel(chosen);
    InitLog(role, name, l.ok() ? *l : LogLevel::kInfo);
    if (!l.ok()) return l.status().WithContext("KDN_LOG_LEVEL");
    return Status::Ok();
  }
};

}  // namespace kdn
