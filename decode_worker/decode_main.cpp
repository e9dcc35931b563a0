// kdn-decode: a decode worker (docs/serving.md). Continuous batching over its
// paged KV cache; receives prompt KV from prefill workers over kvbus, streams
// tokens to the router, and stores finished conversations' chunks in the KDN.
// Prints its control endpoint on stdout once it serves.
#include <chrono>
#include <string>

#include "kdn/decode_worker/decode_service.h"
#include "kdn/engine/cpu_runtime.h"
#include "kdn/worker/worker_main.h"

int main(int argc, char** argv) {
  kdn::engine::PrepareCpuRuntime(argv);
  using kdn::decode_worker::DecodeService;
  kdn::decode_worker::DecodeServiceOptions o;
  kdn::worker::WorkerMain<kdn::decode_worker::DecodeServiceOptions> main_loop(
      "decode", "kdn-decode: a decode worker.", o);
  CLI::App& app = main_loop.app();
  double staging_mib = 0;
  app.add_option("--kvbus-listen", o.kvbus_listen,
                 "kvbus endpoint prefill workers push KV to (port 0 picks a free one)")
      ->capture_default_str();
  app.add_option("--staging-mib", staging_mib,
                 "Host memory for KV that prefill workers pushed and no request has used yet, in "
                 "MiB; 0 sizes it from the model: the KV of --max-batch prompts as long as the KV "
                 "pool holds, at most the pool's KV (printed at start)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-batch", o.max_batch, "Requests decoded together at most")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--local-prefill-step-tokens", o.local_prefill_step_tokens,
                 "Prompt tokens a local prefill (the router's --disaggregation) computes "
                 "between two decode steps while requests run; with none running it runs whole")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--admission-reserve", o.admission_reserve,
                 "The share of the KV pool a new request must leave free while other requests "
                 "hold blocks, for the running ones to grow into (0: none)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.99));
  app.add_option("--local-prefill-call-tokens", o.local_prefill_call_tokens,
                 "The most prompt tokens one local prefill call computes; on a GPU the engine's "
                 "activation buffers hold this many rows, and a longer prompt runs in several "
                 "calls")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  int64_t peer_lease_ms = o.peer_lease.count();
  app.add_option("--peer-lease-ms", peer_lease_ms,
                 "Prepared requests not yet started are let go once the router that sent them "
                 "has been silent this long (routers ping every 250 ms)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  int64_t prepare_timeout_ms = o.prepare_timeout.count();
  app.add_option("--prepare-timeout-ms", prepare_timeout_ms,
                 "A prepared request is dropped when its router has neither started nor "
                 "renewed it this long (routers renew the requests they still want with every "
                 "ping, 250 ms, while their prefill is queued or running)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--peer-prepare-share", o.peer_prepare_share,
                 "The share of the KV pool one router's prepared, not yet started requests may "
                 "hold together; a Prepare past it is refused")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0).description("in (0, 1]"))
      ->check([](const std::string& s) {
        return std::stod(s) > 0 ? std::string() : std::string("must be more than 0");
      });
  if (std::optional<int> exit = main_loop.Parse(argc, argv)) return *exit;
  o.peer_lease = std::chrono::milliseconds(peer_lease_ms);
  o.prepare_timeout = std::chrono::milliseconds(prepare_timeout_ms);
  o.staging_bytes = static_cast<uint64_t>(staging_mib * 1048576.0);
  return main_loop.Serve<DecodeService>([&](const DecodeService& s) {
    return ", KV in on " + s.kvbus_endpoint() + " by --kv-transport " +
           main_loop.kv_flags().kv_transport + " (engine on " + s.engine_summary() + ")";
  });
}
