#pragma once
// The main every kdn worker runs (kdn-prefill, kdn-decode): the flags both
// kinds take, logs, the service started on them, its endpoint printed on
// stdout once it serves, and a clean stop on SIGINT or SIGTERM. A worker's
// main adds its own flags to app() between the constructor and Run (or
// Parse, then Serve, to finish its options from its flags in between).
// Header-only, so that only the workers' mains see CLI11. Not thread-safe
// (one per process, on its main thread).

#include <CLI/CLI.hpp>

#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "kdn/common/log.h"
#include "kdn/common/log_flags.h"
#include "kdn/common/status.h"
#include "kdn/control/stop_signal.h"
#include "kdn/net/curve_flag.h"
#include "kdn/worker/worker_flags.h"

namespace kdn::worker {

// Routes protobuf's own log lines into kdn's log (proto/proto_log.h); done by
// worker_main.cpp so that this header needs no proto include.
void RouteWorkerProtobufLogs();

// Options: a worker's service options with the fields every worker has
// (model_dir, listen, chunk_tokens, name, engine, curve, host_bytes, and
// those KvFlags::ApplyTo sets).
template <class Options>
class WorkerMain {
 public:
  // `role` names the worker in its logs ("prefill", "decode"); `o` receives
  // the flags and must outlive Run.
  WorkerMain(std::string role, const std::string& description, Options& o)
      : role_(std::move(role)),
        o_(o),
        app_(description + " Prints its control endpoint on stdout once it serves."),
        engine_flags_(o.engine.kv_tokens) {
    log_flags_.Add(app_);
    app_.add_option("--model", o.model_dir,
                    "Model folder (config.json, *.safetensors, tokenizer.json) or a .gguf file")
        ->required();
    app_.add_option("--listen", o.listen, "Control endpoint to bind (port 0 picks a free one)")
        ->capture_default_str();
    app_.add_option("--host-mib", host_mib_, "Own host-memory KDN tier in MiB")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    app_.add_option("--chunk-tokens", o.chunk_tokens,
                    "Tokens per KV chunk (the same in every process)")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    engine_flags_.Add(app_);
    app_.add_option("--name", o.name, "Name in logs and metrics")->capture_default_str();
    kv_flags_.Add(app_);
    curve_flag_.Add(app_);
    auto* events =
        app_.add_option("--kv-events", o.kv_events.endpoint,
                        "Publish what this worker's host tier gains and drops, as vLLM's KV "
                        "events (ZeroMQ PUB, msgpack; docs/serving.md, \"KV events\"), on this "
                        "endpoint (tcp://host:port, bound; plaintext)");
    app_.add_option("--kv-events-replay", o.kv_events.replay_endpoint,
                    "With --kv-events: answer replay requests for missed batches on this "
                    "endpoint (ZeroMQ ROUTER, bound)")
        ->needs(events);
    app_.add_option("--kv-events-topic", o.kv_events.topic,
                    "With --kv-events: the topic frame of every message (vLLM's default: "
                    "empty)")
        ->needs(events);
  }

  CLI::App& app() { return app_; }
  const KvFlags& kv_flags() const { return kv_flags_; }

  // Parses argv into the options; a worker's own flags are in them once
  // this returns nullopt. Otherwise the exit code: 0 after --help, 2 for a
  // bad flag (said on stderr or in the log).
  std::optional<int> Parse(int argc, char** argv) {
    try {
      app_.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app_.exit(e);
    }
    if (Status st = log_flags_.Init(role_, o_.name); !st.ok()) {
      LogError("{}", st.ToString());
      return 2;
    }
    RouteWorkerProtobufLogs();
    auto curve = curve_flag_.Load();  // it logs why it fails
    if (!curve.ok()) return 2;
    o_.curve = *std::move(curve);
    auto engine = engine_flags_.Options(o_.engine);
    if (!engine.ok()) {
      LogError("{}", engine.status().message());
      return 2;
    }
    o_.engine = *engine;
    if (Status st = kv_flags_.ApplyTo(o_); !st.ok()) {
      LogError("{}", st.ToString());
      return 2;
    }
    o_.host_bytes = static_cast<uint64_t>(host_mib_ * 1048576.0);
    return std::nullopt;
  }

  // Starts the service (Service::Start on the options Parse set), logs
  // "serving on ENDPOINT" and `details` of it (where its KV comes and goes,
  // where its engine runs), serves until SIGINT or SIGTERM, then destroys
  // it: main's exit code (1 when it does not start).
  template <class Service>
  int Serve(const std::function<std::string(const Service&)>& details) {
    Result<std::unique_ptr<Service>> service = Service::Start(o_);
    if (!service.ok()) {
      LogError("{}", service.status().ToString());
      return 1;
    }
    control::CatchStopSignals();
    LogInfo("serving on {}{}", (*service)->endpoint(), details(**service));
    std::printf("%s\n", (*service)->endpoint().c_str());
    std::fflush(stdout);
    control::WaitForStopSignal();
    service->reset();
    LogInfo("stopped");
    return 0;
  }
  // Parse, then Serve: for a worker with no flags to finish in between.
  template <class Service>
  int Run(int argc, char** argv, const std::function<std::string(const Service&)>& details) {
    if (std::optional<int> exit = Parse(argc, argv)) return *exit;
    return Serve(details);
  }

 private:
  std::string role_;
  Options& o_;
  CLI::App app_;
  double host_mib_ = 2048;
  LogFlags log_flags_;
  EngineFlags engine_flags_;
  KvFlags kv_flags_;
  net::CurveFlag curve_flag_;
};

}  // namespace kdn::worker
