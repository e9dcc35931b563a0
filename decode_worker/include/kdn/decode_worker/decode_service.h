#pragma once
// DecodeService: the kdn-decode process without its flags (docs/serving.md).
// Loads the model, opens its KDN tiers, receives prompt KV on a kvbus
// endpoint, serves the control socket, and drives a Decoder (decoder.h: it
// carries out DecodeScheduler's plans) with the protocol's messages
// converted to its structs:
//   Prepare  reserve KV for a prompt and load the chunks its tiers hold;
//   Start    assemble the layer slices a prefill worker pushed, admit the
//            request with its first token and stream tokens back (from the
//            second on when the router says it sent the first itself);
//   Cancel   drop a prepared request (its KV and its own slices) or finish a
//            running one;
//   finish   store the conversation's full chunks (prompt and output) in the
//            KDN, so that the next turn finds them.
// Prepared requests that never start are dropped after a minute.
//
// Threads: the control socket's I/O thread answers info requests and queues
// the rest; the compute thread runs the Decoder (prepare, start, cancel,
// decode steps); the store I/O thread makes every kdn-store round trip
// (lookups first, then the Decoder's loads, then its stores), so that neither
// of the others waits on the network.
//
// Thread-safe: endpoint accessors from any thread. The destructor stops it
// (store jobs still queued are dropped: a conversation not stored costs only
// reuse).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "kdn/common/status.h"
#include "kdn/engine/open_engine.h"
#include "kdn/engine/tensor.h"
#include "kdn/model/config.h"
#include "kdn/kvbus/kv_events.h"
#include "kdn/kvbus/codec.h"
#include "kdn/kvbus/transport.h"

namespace kdn::decode_worker {

struct DecodeServiceOptions {
  std::string model_dir;
  std::string listen = "tcp://127.0.0.1:0";
  std::string kvbus_listen = "tcp://127.0.0.1:0";
  // The KDN tier shared with other workers (kdn/kvbus/shared_tier.h: a
  // kdn-store endpoint or a redis:// URL); empty: none.
  std::string shared_tier;
  std::chrono::milliseconds shared_tier_ttl{0};  // Redis: expiry of what is put (0: none)
  kvbus::CodecLevel store_codec;  // what chunks are coded at for the store (raw: none)
  std::string name = "decode-0";
  uint64_t host_bytes = uint64_t{2} << 30;  // own KDN tier
  // KV slices received from prefill workers, not yet assembled; 0: sized
  // from the model and the pool (StagingBytesFor).
  uint64_t staging_bytes = 0;
  int chunk_tokens = 256;
  // Where the engine runs and the KV its paged cache holds (its max_batch
  // is set from max_batch, its max_prefill_tokens from
  // local_prefill_call_tokens).
  engine::OpenOptions engine{.kv_tokens = 65536};
  int max_batch = 32;
  // Local prefill (docs/serving.md, "Two paths"): the most prompt tokens
  // computed between two decode steps while requests run.
  int local_prefill_step_tokens = 64;
  // DecoderOptions::admission_reserve (docs/serving.md, "Admission and
  // preemption"): the share of the pool a new request leaves free.
  double admission_reserve = 0.01;
  // The most prompt tokens one local prefill call computes: a GPU engine's
  // activation buffers are sized for this many rows rather than a prefill
  // worker's 32768 (a decode worker prefills only its conversations' next
  // turns); a longer prompt is computed in several calls.
  int64_t local_prefill_call_tokens = 4096;
  // kvbus data plane (kvbus::TransportKind): auto and shm give the receiver
  // a shared-memory landing segment of kv_landing_bytes for prefill workers
  // on this host; tcp gives none.
  kvbus::TransportKind kv_transport = kvbus::TransportKind::kAuto;
  uint64_t kv_landing_bytes = uint64_t{256} << 20;
  // Leases on reservations: the prepared, unstarted requests of a peer (a
  // router) not heard from for this long are let go. Routers ping every
  // 250 ms, so only a dead or hung one (or a peer that is no router) lapses.
  // Not less than seconds: a router's loop on a loaded 2-core machine went
  // 5 to 7 s without a ping (2026-12-06; docs/serving.md, "Leases"), and
  // with a 5 s lease its prepared requests were let go and lost.
  std::chrono::milliseconds peer_lease{30000};
  // Time for the leases and the Decoder's prepare_timeout;
  // steady_clock::now when empty (tests inject one). Called from the control
  // I/O and compute threads.
  std::function<std::chrono::steady_clock::time_point()> clock;
  // DecoderOptions::prepare_timeout: a prepared request its router neither
  // started nor renewed for this long is dropped.
  std::chrono::milliseconds prepare_timeout{60000};
  // A peer's budget: the share of the KV pool its prepared, unstarted
  // requests may hold together; a Prepare past it is RESOURCE_EXHAUSTED.
  // Below 1, no one router can reserve the whole pool for requests that
  // never start. In (0, 1].
  double peer_prepare_share = 0.9;
  // Set: every ZeroMQ socket it opens (control, kvbus, kdn-store) runs CURVE
  // with this deployment key (kdn/net/curve.h); unset: plaintext.
  std::optional<net::CurveKeys> curve;
  // Its host tier's KV events (kdn/kvbus/kv_events.h), published where
  // kv_events.endpoint says; none when it is empty.
  kvbus::KvEventsOptions kv_events;
};

// The staging memory a decode worker gives the KV slices prefill workers
// push when none is set: the KV of `max_batch` concurrent pushes of the
// longest prompt its pool can hold (the model's context, or the pool when
// that is smaller), at most the pool's KV (every push lands in blocks its
// Prepare reserved, so more is never waiting to be assembled at once), in
// `kv_dtype` (the engine's: what its slices carry), with a header for each
// slice (one per layer of each chunk and of each request's tail piece).
uint64_t StagingBytesFor(const model::ModelConfig& config, engine::DType kv_dtype,
                         int64_t pool_tokens, int max_batch, int chunk_tokens);

class DecodeService {
 public:
  static Result<std::unique_ptr<DecodeService>> Start(const DecodeServiceOptions& options);
  ~DecodeService();
  DecodeService(const DecodeService&) = delete;
  DecodeService& operator=(const DecodeService&) = delete;

  const std::string& endpoint() const;        // control
  const std::string& kvbus_endpoint() const;  // where prefill workers push KV
  // Where its engine runs and the KV it holds (worker::EngineSummary).
  std::string engine_summary() const;
  // The staging memory it was given (options.staging_bytes, or
  // StagingBytesFor its model and pool).
  uint64_t staging_bytes() const;

 private:
  struct Impl;
  explicit DecodeService(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kdn::decode_worker
