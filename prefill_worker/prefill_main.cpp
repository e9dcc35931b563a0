// kdn-prefill: a prefill worker (docs/serving.md). Holds the model; for each
// request loads the prompt's cached chunks from the KDN, computes the rest,
// pushes the KV to the chosen decode worker layer by layer and answers with
// the first token. Prints its control endpoint on stdout once it serves.
#include <cstdio>
#include <string>

#include <CLI/CLI.hpp>

#include "kdn/common/log_flags.h"
#include "kdn/control/worker_flags.h"
#include "kdn/control/stop_signal.h"
#include "kdn/engine/cpu_runtime.h"
#include "kdn/net/curve_flag.h"
#include "kdn/prefill_worker/prefill_service.h"
#include "proto_log.h"

int main(int argc, char** argv) {
  kdn::engine::PrepareCpuRuntime(argv);
  kdn::prefill_worker::PrefillServiceOptions o;
  double host_mib = 2048;
  CLI::App app{
      "kdn-prefill: a prefill worker. Prints its control endpoint on stdout once it serves."};
  kdn::LogFlags log_flags;
  log_flags.Add(app);
  app.add_option("--model", o.model_dir,
                 "Model folder (config.json, *.safetensors, tokenizer.json) or a .gguf file")
      ->required();
  app.add_option("--listen", o.listen, "Control endpoint to bind (port 0 picks a free one)")
      ->capture_default_str();
  app.add_option("--host-mib", host_mib, "Own host-memory KDN tier in MiB")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--chunk-tokens", o.chunk_tokens,
                 "Tokens per KV chunk (the same in every process)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--blend-kl-per-residual", o.blend_kl_per_residual,
                 "Blend: the KL per unit of residual deviation a request's blend_max_kl is "
                 "turned into a ratio with (docs/blend.md, \"A quality target\"); the default "
                 "is SmolLM2-135M-Instruct's, measured by kdn-bench blend-fidelity --calibrate")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  kdn::control::EngineFlags engine_flags(o.engine.kv_tokens);
  engine_flags.Add(app);
  app.add_option("--name", o.name, "Name in logs and metrics")->capture_default_str();
  kdn::control::KvFlags kv_flags;
  kv_flags.Add(app);
  kdn::net::CurveFlag curve_flag;
  curve_flag.Add(app);
  CLI11_PARSE(app, argc, argv);
  if (kdn::Status st = log_flags.Init("prefill", o.name); !st.ok()) {
    kdn::LogError("{}", st.ToString());
    return 2;
  }
  kdn::proto::RouteProtobufLogs();
  auto curve = curve_flag.Load();
  if (!curve.ok()) return 2;
  o.curve = *std::move(curve);
  auto engine = engine_flags.Options(o.engine);
  if (!engine.ok()) {
    kdn::LogError("{}", engine.status().message());
    return 2;
  }
  o.engine = *engine;
  if (kdn::Status st = kv_flags.ApplyTo(o); !st.ok()) {
    kdn::LogError("{}", st.ToString());
    return 2;
  }
  o.host_bytes = static_cast<uint64_t>(host_mib * 1048576.0);

  auto service = kdn::prefill_worker::PrefillService::Start(o);
  if (!service.ok()) {
    kdn::LogError("{}", service.status().ToString());
    return 1;
  }
  kdn::control::CatchStopSignals();
  kdn::LogInfo("serving on {} (engine on {}; KV to decode workers by --kv-transport {})",
               (*service)->endpoint(), (*service)->engine_summary(), kv_flags.kv_transport);
  std::printf("%s\n", (*service)->endpoint().c_str());
  std::fflush(stdout);
  kdn::control::WaitForStopSignal();
  service->reset();
  kdn::LogInfo("stopped");
  return 0;
}
