#pragma once
// PrefillService: the kdn-prefill process without its flags. Loads the model,
// opens the KDN tiers, serves the control socket (docs/serving.md) and runs
// prefill jobs one at a time, in arrival order, on a compute thread. Lookups
// (kdn-store round trips) are answered on a thread of their own, so that the
// control socket's I/O thread answers the router's pings at once.
//
// Thread-safe: endpoint() from any thread. The destructor stops serving
// (queued jobs are dropped; their router times them out).

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "kdn/blend/blend.h"
#include "kdn/common/status.h"
#include "kdn/engine/open_engine.h"
#include "kdn/kvbus/kv_events.h"
#include "kdn/kvbus/codec.h"
#include "kdn/kvbus/transport.h"

namespace kdn::prefill_worker {

struct PrefillServiceOptions {
  std::string model_dir;
  std::string listen = "tcp://127.0.0.1:0";
  // The KDN tier shared with other workers (kdn/kvbus/shared_tier.h: a
  // kdn-store endpoint or a redis:// URL); empty: none.
  std::string shared_tier;
  std::chrono::milliseconds shared_tier_ttl{0};  // Redis: expiry of what is put (0: none)
  // The shared tier as an object, in place of shared_tier: a program that
  // embeds the worker, or a test, gives its own store (thread-safe), which
  // sits below the host tier as a shared tier does. Set, shared_tier must be
  // empty.
  std::shared_ptr<kvbus::ChunkStore> shared_store;
  kvbus::CodecLevel store_codec;  // what chunks are coded at for the store (raw: none)
  std::string name = "prefill-0";
  uint64_t host_bytes = uint64_t{2} << 30;
  int chunk_tokens = 256;
  // A blend's quality target's slope (docs/blend.md, "A quality target").
  double blend_kl_per_residual = blend::kDefaultKlPerResidual;
  // KV I/O threads that read each job's KDN tiers ahead of the compute
  // thread (docs/serving.md, "Inside a worker"), each job on the next in
  // turn: with two, a job whose reads are slow holds up only the jobs behind
  // it on its thread. 0: the compute thread reads them itself before it
  // computes each job (for comparison).
  int kv_io_threads = 2;
  // Where the engine runs and the KV its paged cache holds.
  engine::OpenOptions engine{.kv_tokens = 32768, .max_batch = 8};
  // kvbus data plane to decode workers (kvbus::TransportKind).
  kvbus::TransportKind kv_transport = kvbus::TransportKind::kAuto;
  // Set: every ZeroMQ socket it opens (control, kvbus, kdn-store) runs CURVE
  // with this deployment key (kdn/net/curve.h); unset: plaintext.
  std::optional<net::CurveKeys> curve;
  // Its host tier's KV events (kdn/kvbus/kv_events.h), published where
  // kv_events.endpoint says; none when it is empty.
  kvbus::KvEventsOptions kv_events;
};

class PrefillService {
 public:
  static Result<std::unique_ptr<PrefillService>> Start(const PrefillServiceOptions& options);
  ~PrefillService();
  PrefillService(const PrefillService&) = delete;
  PrefillService& operator=(const PrefillService&) = delete;

  const std::string& endpoint() const;
  // Where its engine runs and the KV it holds (worker::EngineSummary).
  std::string engine_summary() const;

 private:
  struct Impl;
  explicit PrefillService(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kdn::prefill_worker
