#pragma once
// --curve-keys, the flag every kdn program with ZeroMQ sockets takes
// (kdn/net/curve.h). Header-only, so that only the programs' mains see
// CLI11.

#include <CLI/CLI.hpp>

#include <optional>
#include <string>

#include "kdn/common/log.h"
#include "kdn/net/curve.h"

namespace kdn::net {

struct CurveFlag {
  std::string path;

  void Add(CLI::App& app) {
    app.add_option("--curve-keys", path,
                   "The deployment's CURVE key file (kdn-keygen FILE --router FILE2 writes "
                   "them, mode 0600): FILE for kdn-prefill, kdn-decode and kdn-store, FILE2 "
                   "for kdn-router. Internal sockets are then encrypted and refuse peers "
                   "without the right key. Default: the file named by KDN_CURVE_KEYS, else "
                   "none (plaintext: anyone who can connect to this process's ports is "
                   "trusted)");
  }

  // After parsing: the key, or none, and a log line saying which. On error
  // it logs why and returns the status, for main to exit with.
  Result<std::optional<CurveKeys>> Load() const {
    auto keys = CurveKeysFromFlagOrEnv(path);
    if (!keys.ok()) {
      LogError("--curve-keys: {}", keys.status().ToString());
      return keys.status();
    }
    if (keys->has_value()) {
      LogInfo("internal sockets use CURVE (public key {}...)", (*keys)->public_key.substr(0, 8));
    } else {
      LogWarn(
          "internal sockets are plaintext (no --curve-keys): any process that can connect to "
          "them is trusted");
    }
    return keys;
  }
};

}  // namespace kdn::net
