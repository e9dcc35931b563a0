#pragma once
// What kdn-prefill and kdn-decode set up alike: the model with its tokenizer
// and fingerprint, the KDN tiers a worker reads and fills, and the
// WorkerInfo it reports. Thread-safe (functions over values).

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "kdn/control/control_server.h"
#include "kdn/common/status.h"
#include "kdn/engine/engine.h"
#include "kdn/engine/open_engine.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/codec.h"
#include "kdn/kvbus/kv_events.h"
#include "kdn/kvbus/shared_tier.h"
#include "kdn/kvbus/tiered_store.h"
#include "kdn/kvbus/transport.h"
#include "kdn/text/tokenizer.h"

namespace kdn::worker {

struct WorkerModel {
  std::unique_ptr<engine::Engine> model;
  std::unique_ptr<text::Tokenizer> tokenizer;
  kvbus::ChunkKey fingerprint;  // of the model with its engine's KV dtype
};

// Loads the model folder (config, weights, tokenizer) onto options.device and
// fingerprints it (docs/kvbus.md: config, weight dtype, KV dtype, digest of
// the weights). A cuda device that is missing or too small fails here, with
// what the machine has.
Result<WorkerModel> LoadWorkerModel(const std::filesystem::path& dir,
                                    const engine::OpenOptions& options);

// "cuda:0, bf16 KV pool of 1048576 tokens": where the worker's engine runs
// and how much KV it holds, for its start-up line. Reads only what does not
// change after the engine is made, so any thread may call it.
std::string EngineSummary(engine::Engine& engine);

// The device backend of a worker's device plane, cuda_ipc or nccl
// (kdn/kvbus/device_ops.h):
// the CUDA backend of its GPU, or, on a CPU worker, the host backend
// standing in for a device in the workers' test mode (KDN_DEVICE_OPS=host).
// FAILED_PRECONDITION, saying why, when there is none.
Result<kvbus::DeviceOps*> WorkerDeviceOps(const engine::Device& device);

// Has the engine of `options` allocate its KV pool through the backend its
// worker's transport writes (docs/kvbus.md, "Device planes"), into `*pool`
// (which must outlive the engine): WorkerDeviceOps with --kv-transport
// cuda_ipc or nccl, the host backend on a CPU otherwise; a GPU pool under
// any other transport stays the engine's own (`*pool` left null). The
// error of WorkerDeviceOps when the device plane has no backend here.
Status AllocateKvPoolThroughBackend(kvbus::TransportKind transport, engine::OpenOptions* options,
                                    std::unique_ptr<kvbus::DeviceMemory>* pool);

// The worker's KDN view: its own host tier of `host_bytes` (raw KV), over the
// shared tier `shared_tier` names if one is given (kdn/kvbus/shared_tier.h:
// a kdn-store or a Redis Cluster; written through, so other workers find
// what this one stores). Chunks go to the shared tier coded at
// `store_codec`; whatever it sends back encoded is decoded, whatever level
// it was coded at. `shared`: CURVE keys for a kdn-store, the model and TTL
// for Redis.
Result<std::unique_ptr<kvbus::TieredStore>> MakeWorkerStore(
    uint64_t host_bytes, const std::string& shared_tier, kvbus::CodecLevel store_codec = {},
    const kvbus::SharedTierOptions& shared = {});

// A worker's KV event stream (kdn/kvbus/kv_events.h; docs/serving.md, "KV
// events"): the publisher, and what follows the host tier of `store` for
// it. Both null when options.endpoint is empty. The members' order is
// their teardown's in reverse: `host` stops following the tier first.
struct WorkerKvEvents {
  std::unique_ptr<kvbus::KvEventPublisher> publisher;
  // Shared: the store's put listener holds it weakly (what the worker
  // writes to its shared tier).
  std::shared_ptr<kvbus::HostTierEvents> host;
  std::string stream;  // this stream's name (WorkerInfo kv_events_stream): random
};
// Where the worker's KV events can be followed, into its info (nothing
// when it publishes none).
void SetKvEventsInfo(proto::WorkerInfo* info, const WorkerKvEvents& events,
                     const std::string& topic);
// The publisher's errors (kvbus::KvEventPublisher::Start);
// FAILED_PRECONDITION for a store without a host tier.
Result<WorkerKvEvents> StartKvEvents(const kvbus::KvEventsOptions& options,
                                     kvbus::TieredStore& store, int chunk_tokens);
// Answers, on the control I/O thread, the queries both kinds of worker answer
// alike: an info request (the router's liveness ping) and a lookup (how many
// leading prompt tokens its tiers hold, full chunks then tail pieces, and
// which segment keys), each with the worker's figures from `fill_info`.
// `keys` gives the fingerprint and chunk size the tail keys are computed
// with (its ns is the lookup's). `pool`, when given, is the worker's KV
// pool: what it holds resident counts first (LookupReply.resident_tokens);
// it is read only through KvCache::IsResident. False, with nothing sent, for
// any other message.
// Sets the info's store figures: each tier's name and local counters (no
// round trip), the KV codec counters from the CodecTier in `store`, if any,
// and the requests a remote tier left unanswered.
void SetStoreCounters(proto::WorkerInfo* info, kvbus::TieredStore& store);
// Sets what names a worker in its info, alike for both kinds: `name`, `role`
// ("prefill", "decode"), the model's fingerprint and context, the chunk
// size, the engine's device, this host's id and the worker's transport.
void SetWorkerIdentity(proto::WorkerInfo* info, const std::string& name, const std::string& role,
                       const WorkerModel& wm, int chunk_tokens, kvbus::TransportKind transport);
// Appends one data plane's kvbus counters to a worker's info.
void AddTransportCounters(proto::WorkerInfo* info, const std::string& transport, uint64_t chunks,
                          uint64_t bytes, double seconds);

// Answers what any worker answers alike: an info request, a lookup (what of
// a prompt its KDN reaches, and with `pool` what of it is resident), a keep
// (ChunkStore::Keep on `store`, and with `pool` KvCache::Keep, which its
// engine's thread applies; unanswered). False for any other message.
bool AnswerQuery(control::ControlServer& server, const std::string& peer,
                 const proto::WorkerMessage& message, kvbus::TieredStore& store,
                 const kvbus::KeyContext& keys,
                 const std::function<void(proto::WorkerInfo*)>& fill_info,
                 engine::KvCache* pool = nullptr);
// Sets the info's resident counters from the pool's (a snapshot the
// engine's thread took) and the worker's own two.
void SetResidentCounters(proto::WorkerInfo* info, const engine::ResidentStats& pool,
                         uint64_t hit_tokens, uint64_t kv_bytes_loaded);

}  // namespace kdn::worker
