#pragma once
// Command-line flags kdn-prefill and kdn-decode share: kvbus's data plane
// and the KV codec of what they put into kdn-store. Header-only, so that only
// the programs' mains see CLI11.

#include <CLI/CLI.hpp>

#include <string>

#include "kdn/kvbus/codec.h"
#include "kdn/kvbus/transport.h"

namespace kdn::control {

struct KvFlags {
  std::string kv_transport = "auto";
  std::string store_codec = "raw";

  // Adds --kv-transport and --store-codec to `app`, checked as they parse.
  void Add(CLI::App& app) {
    app.add_option("--kv-transport", kv_transport,
                   "kvbus data plane: auto (shm with workers on this host, else tcp), tcp, or shm")
        ->check(CLI::IsMember({"auto", "tcp", "shm"}))
        ->capture_default_str();
    app.add_option("--store-codec", store_codec,
                   "KV codec level of chunks put into the --store: raw, lossless, or q2 ... q8 "
                   "(docs/kvbus.md, \"KV codec\"); chunks read back are decoded whatever their "
                   "level")
        ->check([](const std::string& s) {
          auto l = kvbus::ParseCodecLevel(s);
          return l.ok() ? std::string() : l.status().message();
        })
        ->capture_default_str();
  }
  // After parsing (both were checked then).
  kvbus::TransportKind transport() const { return kvbus::ParseTransportKind(kv_transport).value(); }
  kvbus::CodecLevel codec() const { return kvbus::ParseCodecLevel(store_codec).value(); }
};

}  // namespace kdn::control
