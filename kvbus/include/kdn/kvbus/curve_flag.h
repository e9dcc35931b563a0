#pragma once
// --curve-keys, the flag every kdn program with ZeroMQ sockets takes
// (kdn/kvbus/curve.h). Header-only, so that only the programs' mains see
// CLI11.

#include <CLI/CLI.hpp>

#include <cstdio>
#include <optional>
#include <string>

#include "kdn/kvbus/curve.h"

namespace kdn::kvbus {

struct CurveFlag {
  std::string path;

  void Add(CLI::App& app) {
    app.add_option("--curve-keys", path,
                   "The deployment's CURVE key file (kdn-keygen writes one; mode 0600): "
                   "internal sockets are then encrypted and refuse peers without the key. "
                   "Default: the file named by KDN_CURVE_KEYS, else none (plaintext: anyone "
                   "who can connect to this process's ports is trusted)");
  }

  // After parsing: the key, or none; logs which, as `program`. On error,
  // prints why and returns an error status for main to exit with.
  Result<std::optional<CurveKeys>> Load(const char* program) const {
    auto keys = CurveKeysFromFlagOrEnv(path);
    if (!keys.ok()) {
      std::fprintf(stderr, "%s: --curve-keys: %s\n", program, keys.status().ToString().c_str());
      return keys.status();
    }
    if (keys->has_value()) {
      std::fprintf(stderr, "%s: internal sockets use CURVE (deployment key %.8s...)\n", program,
                   (*keys)->public_key.c_str());
    } else {
      std::fprintf(stderr,
                   "%s: internal sockets are plaintext (no --curve-keys): any process that can "
                   "connect to them is trusted\n",
                   program);
    }
    return keys;
  }
};

}  // namespace kdn::kvbus
