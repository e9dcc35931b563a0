#pragma once
// Router: the kdn-router process without its flags (docs/serving.md). An
// HTTP/1.1 server (Boost.Beast) with the OpenAI-compatible endpoints, health
// and metrics, in front of a Backend that drives the workers.
//
// Thread-safe: url() from any thread. One I/O thread serves HTTP; the
// backend's thread talks to workers. The destructor stops both (open
// streams are cut).

#include <cstdint>
#include <memory>
#include <string>

#include "kdn/common/status.h"
#include "kdn/blend/emphasis.h"
#include "kdn/router/api_keys.h"
#include "kdn/router/backend.h"

namespace kdn::router {

struct RouterOptions {
  std::string model_dir;          // config.json and tokenizer.json are read
  std::string served_model_name;  // empty: the model folder's name
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0 picks a free port
  // Blend defaults (docs/serving.md, "Documents").
  std::string separator;
  double recompute_ratio = blend::kDefaultRecomputeRatio;
  int check_layer = blend::kDefaultCheckLayer;
  // Progressive filtering (blend::CheckSchedule); empty: one check.
  std::vector<int> check_layers = blend::DefaultCheckLayers();
  std::vector<double> check_ratios;
  // The policy (blend::ParseBlendSelection).
  blend::BlendSelection selection = blend::DefaultBlendSelection();
  // Emphasis defaults (docs/serving.md, "Emphasis"): a head profile's file
  // (blend::LoadEmphasisProfile; empty: the middle third's heads) and the
  // strength a request gets when it names none.
  std::string emphasis_heads;
  double emphasis_strength = blend::kDefaultEmphasisStrength;
  BackendOptions backend;
  // API keys (docs/serving.md, "API keys"); null: every request is served,
  // in the namespace of its cache_salt.
  std::shared_ptr<const ApiKeys> api_keys;
  // Open HTTP connections at most: one over it is answered 503 and closed
  // at once (each may buffer a body of up to 16 MiB, and all of them
  // max_body_buffer_bytes together).
  int max_connections = 1024;
  // Request-body bytes all connections may buffer at once: a body that
  // would go past it is answered 503 with Retry-After and its connection
  // closed, before any of it is read (its Content-Length counts, else the
  // 16 MiB a body may be).
  uint64_t max_body_buffer_bytes = uint64_t{256} << 20;
};

class Router {
 public:
  static Result<std::unique_ptr<Router>> Start(const RouterOptions& options);
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  // "http://HOST:PORT" with the real port.
  const std::string& url() const;

 private:
  struct Impl;
  explicit Router(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kdn::router
