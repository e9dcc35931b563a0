#pragma once
// What the router knows of one worker, read-only outside the worker pool
// (router/src/worker_pool.h): its role, whether it is up, and what it last
// reported (proto::WorkerInfo), apart from the router's own reservations
// since that report (placement.h's Ledger), which `reserved` shows and no
// reported field includes. The figures placement reads are copied into
// named fields; the counters only shown are kept as the proto messages the
// worker sent (declared once, in proto/serving.proto). /health, /metrics
// and the status page publish both from one StatusSnapshot (status.h).
//
// Thread-compatible values.

#include <cstdint>
#include <string>
#include <vector>

#include "kdn/kvbus/key.h"
#include "serving.pb.h"

namespace kdn::router {

enum class Role { kPrefill, kDecode };

// "prefill" or "decode": as workers report it and as logs and metrics label it.
const char* RoleName(Role role);

// The model every compatible worker serves, fixed by the first that reports.
struct ModelIdentity {
  bool known = false;
  kvbus::ChunkKey fingerprint;
  int chunk_tokens = 0;
};

// The router's reservations on a worker since its last report: requests
// routed to it that its report does not show yet. A report clears them.
struct Reservation {
  int requests = 0;            // decode: requests prepared on it
  int64_t kv_blocks = 0;       // decode: KV blocks those reserve
  int64_t prefill_tokens = 0;  // prefill: prompt tokens sent to it
  int64_t local_tokens = 0;    // decode: prompt tokens sent to it to prefill locally
};

struct WorkerView {
  std::string name;  // as the worker reports it; its endpoint until it has
  Role role = Role::kPrefill;
  std::string endpoint;
  bool up = false;
  bool compatible = true;  // false: another model than the other workers'
  // Reported by the worker.
  int queue_depth = 0;
  int max_batch = 0;  // decode: its --max-batch (0: not said)
  int64_t queue_tokens = 0;
  int free_kv_blocks = 0;
  int total_kv_blocks = 0;
  int64_t max_context = 0;
  std::string health;          // a failure the worker reports; empty when none
  std::string host_id;         // workers on one host share it (kvbus::HostId)
  std::string device;          // where its engine runs: "cpu", "cuda:0"
  std::string kv_transport;    // its --kv-transport
  std::string kvbus_endpoint;  // where it takes KV (decode); empty: not said
  // KV it moved over kvbus per data plane (sent by a prefill worker,
  // received by a decode worker).
  std::vector<proto::TransportCounters> kv_transports;
  proto::KvCodecCounters kv_codec;  // its KV codec at the kdn-store tier
  uint64_t store_unreachable = 0;   // its kdn-store requests left unanswered
  // decode: what it holds under leases now (proto::WorkerInfo fields 18, 19).
  int leased_kv_blocks = 0;
  uint64_t kvbus_leased_bytes = 0;
  proto::ResidentCounters resident;           // its KV pool as the KDN's first tier
  proto::LocalPrefill local_prefill;          // decode
  proto::PushedKv pushed_kv;                  // decode
  proto::Preemption preemption;               // decode
  std::vector<proto::StoreTier> store_tiers;  // its KDN store, fastest tier first
  // Its KV events (proto::WorkerInfo fields 26-29); empty: none.
  std::string kv_events_endpoint, kv_events_replay_endpoint, kv_events_topic, kv_events_stream;
  // The router's own, not reported: what it routed here since the report.
  Reservation reserved;
  // The router's own: its KV events as the router follows them
  // (--lookups-from-events); kv_events_followed false: not followed.
  bool kv_events_followed = false;
  bool kv_events_synced = false;
  uint64_t kv_events_blocks = 0;
  uint64_t kv_events_next = 0;
};

// Up, compatible and of `role`: a worker placement may choose.
inline bool Usable(const WorkerView& w, Role role) {
  return w.role == role && w.up && w.compatible;
}

}  // namespace kdn::router
