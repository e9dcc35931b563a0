// kdn-prefill: a prefill worker (docs/serving.md). Holds the model; for each
// request loads the prompt's cached chunks from the KDN, computes the rest,
// pushes the KV to the chosen decode worker layer by layer and answers with
// the first token. Prints its control endpoint on stdout once it serves.
#include <string>

#include "kdn/engine/cpu_runtime.h"
#include "kdn/prefill_worker/prefill_service.h"
#include "kdn/worker/worker_main.h"

int main(int argc, char** argv) {
  kdn::engine::PrepareCpuRuntime(argv);
  using kdn::prefill_worker::PrefillService;
  kdn::prefill_worker::PrefillServiceOptions o;
  kdn::worker::WorkerMain<kdn::prefill_worker::PrefillServiceOptions> main_loop(
      "prefill", "kdn-prefill: a prefill worker.", o);
  main_loop.app()
      .add_option("--blend-kl-per-residual", o.blend_kl_per_residual,
                  "Blend: the KL per unit of residual deviation a request's blend_max_kl is "
                  "turned into a ratio with (docs/blend.md, \"A quality target\"); the default "
                  "is SmolLM2-135M-Instruct's, measured by kdn-bench blend-fidelity --calibrate")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  return main_loop.Run<PrefillService>(argc, argv, [&](const PrefillService& s) {
    return " (engine on " + s.engine_summary() + "; KV to decode workers by --kv-transport " +
           main_loop.kv_flags().kv_transport + ")";
  });
}
