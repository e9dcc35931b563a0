#include "kdn/worker/worker_setup.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "kdn/common/log.h"
#include "kdn/control/convert.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/device_ops.h"
#if KDN_CUDA
#include "kdn/kvbus/cuda/cuda_device_ops.h"
#endif
#include "kdn/kvbus/disk_tier.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/prefix_io.h"
#include "kdn/kvbridge/fingerprint.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbridge/resident.h"

namespace kdn::worker {

Result<WorkerModel> LoadWorkerModel(const std::filesystem::path& dir,
                                    const engine::OpenOptions& options) {
  WorkerModel w;
  const auto t0 = std::chrono::steady_clock::now();
  KDN_ASSIGN_OR_RETURN(w.model, engine::OpenEngine(dir, options));
  kvbridge::PinChunkBuffersFor(*w.model);
  KDN_ASSIGN_OR_RETURN(w.tokenizer, text::Tokenizer::Load(dir));
  KDN_ASSIGN_OR_RETURN(w.fingerprint,
                       kvbridge::FolderFingerprint(dir, w.model->config(), w.model->kv_dtype()));
  // kdn-launch shows this time as each worker comes up.
  LogInfo("model {} loaded in {:.2f} s ({})", dir.string(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
          EngineSummary(*w.model));
  return w;
}

std::string EngineSummary(engine::Engine& engine) {
  const int64_t tokens = int64_t{engine.kv_cache().num_blocks()} * engine::kKvBlockTokens;
  return engine.device() + ", " + engine::DTypeName(engine.kv_dtype()) + " KV pool of " +
         std::to_string(tokens) + " tokens";
}

Result<std::unique_ptr<kvbus::TieredStore>> MakeWorkerStore(
    uint64_t host_bytes, const std::string& shared_tier, kvbus::CodecLevel store_codec,
    const kvbus::SharedTierOptions& shared) {
  std::vector<std::unique_ptr<kvbus::ChunkStore>> tiers;
  tiers.push_back(std::make_unique<kvbus::HostTier>(host_bytes));
  kvbus::TieredStoreOptions options;
  if (!shared_tier.empty()) {
    KDN_ASSIGN_OR_RETURN(auto remote, kvbus::OpenSharedTier(shared_tier, shared));
    LogInfo("KDN: host tier of {} MiB over {}", host_bytes >> 20, remote->name());
    tiers.push_back(std::make_unique<kvbus::CodecTier>(
        std::move(remote), kvbus::CodecTierOptions{.level = store_codec}));
    options.write_through = true;
  }
  return std::make_unique<kvbus::TieredStore>(std::move(tiers), options);
}

bool AnswerQuery(control::ControlServer& server, const std::string& peer,
                 const proto::WorkerMessage& message, kvbus::TieredStore& store,
                 const kvbus::KeyContext& keys,
                 const std::function<void(proto::WorkerInfo*)>& fill_info, engine::KvCache* pool) {
  proto::WorkerMessage reply;
  reply.set_request_id(message.request_id());
  if (message.body_case() == proto::WorkerMessage::kInfoRequest) {
    fill_info(reply.mutable_info());
  } else if (message.body_case() == proto::WorkerMessage::kLookup) {
    const proto::LookupRequest& lookup = message.lookup();
    std::vector<kvbus::ChunkKey> prefix;
    for (const std::string& b : lookup.keys()) {
      auto k = control::KeyFromBytes(b);
      if (!k.ok()) break;
      prefix.push_back(*k);
    }
    const std::vector<int32_t> tokens(lookup.tokens().begin(), lookup.tokens().end());
    kvbus::KeyContext ctx = keys;
    ctx.ns = lookup.ns();
    // A lookup without the prompt: full chunks only.
    const int64_t limit = tokens.empty() ? static_cast<int64_t>(prefix.size()) * ctx.chunk_tokens
                                         : static_cast<int64_t>(tokens.size());
    const int64_t resident = pool == nullptr
                                 ? 0
                                 : kvbridge::ResidentPrefixTokens(*pool, ctx, tokens, prefix, limit,
                                                                  kvbus::kMinTailTokens);
    auto* lr = reply.mutable_lookup_reply();
    lr->set_prefix_tokens(static_cast<int32_t>(kvbus::StoredPrefixTokens(
        store, ctx, tokens, prefix, limit, kvbus::kMinTailTokens, resident)));
    lr->set_resident_tokens(static_cast<int32_t>(resident));
    std::vector<kvbus::ChunkKey> segments;
    for (const std::string& b : message.lookup().segment_keys()) {
      auto k = control::KeyFromBytes(b);
      segments.push_back(k.ok() ? *k : kvbus::ChunkKey{});
    }
    if (!segments.empty()) {
      for (bool held : store.ContainsMany(segments)) lr->add_segments_held(held);
    }
    fill_info(lr->mutable_info());
    LogDebug("{} lookup: its KDN reaches {} of {} prompt tokens; {} of {} documents held",
             ReqId{message.request_id()}, lr->prefix_tokens(), tokens.size(),
             std::count(lr->segments_held().begin(), lr->segments_held().end(), true),
             segments.size());
  } else if (message.body_case() == proto::WorkerMessage::kKeep) {
    std::vector<kvbus::ChunkKey> keys;
    for (const std::string& b : message.keep().keys()) {
      auto k = control::KeyFromBytes(b);
      if (!k.ok()) {
        LogWarn("a keep request with a malformed key ignored: {}", k.status().ToString());
        return true;
      }
      keys.push_back(*k);
    }
    const auto lease = kvbus::KeepLeaseFromWire(message.keep().lease_ms());
    if (pool != nullptr && kvbridge::KeepResident(*pool, keys, lease) == 0 && lease.count() > 0 &&
        !keys.empty()) {
      LogWarn("keeping {} pinned chunks in the KV pool: its bound of {} kept keys is reached",
              keys.size(), engine::KvCache::kMaxKeptKeys);
    }
    auto kept = store.Keep(keys, lease);
    if (!kept.ok()) {
      LogWarn("keeping {} pinned chunks: {}", keys.size(), kept.status().ToString());
    } else {
      LogDebug("{} {} chunks for {} ms", lease.count() == 0 ? "let go of" : "keeping", keys.size(),
               lease.count());
    }
    return true;  // no reply
  } else {
    return false;
  }
  server.Send(peer, reply);
  return true;
}

void SetResidentCounters(proto::WorkerInfo* info, const engine::ResidentStats& st,
                         uint64_t hit_tokens, uint64_t kv_bytes_loaded) {
  proto::ResidentCounters* r = info->mutable_resident();
  r->set_cached_blocks(st.cached_blocks);
  r->set_evictable_blocks(st.evictable_blocks);
  r->set_evictions(st.evictions);
  r->set_hit_tokens(hit_tokens);
  r->set_copied_blocks(st.copied_blocks);
  r->set_kv_bytes_loaded(kv_bytes_loaded);
  r->set_kept_blocks(st.kept_blocks);
}

void SetStoreCounters(proto::WorkerInfo* info, kvbus::TieredStore& store) {
  for (size_t i = 0; i < store.tier_count(); ++i) {
    kvbus::ChunkStore& tier = store.tier(i);
    const kvbus::TierStats ts = tier.LocalStats();
    proto::StoreTier* t = info->add_store_tiers();
    t->set_name(tier.name());
    t->set_chunks(ts.chunks);
    t->set_bytes(ts.bytes);
    t->set_capacity_bytes(ts.capacity_bytes);
    t->set_hits(ts.hits);
    t->set_misses(ts.misses);
    t->set_held_here(dynamic_cast<kvbus::HostTier*>(&tier) != nullptr ||
                     dynamic_cast<kvbus::DiskTier*>(&tier) != nullptr);
    if (auto* codec = dynamic_cast<kvbus::CodecTier*>(&store.tier(i))) {
      const kvbus::CodecStats s = codec->codec_stats();
      proto::KvCodecCounters* c = info->mutable_kv_codec();
      c->set_encoded_chunks(s.encoded);
      c->set_raw_bytes(s.raw_bytes);
      c->set_encoded_bytes(s.encoded_bytes);
      c->set_decoded_chunks(s.decoded);
      c->set_decode_errors(s.decode_errors);
    }
  }
  info->set_store_unreachable(store.LocalStats().unreachable);
}

Result<kvbus::DeviceOps*> WorkerDeviceOps(const engine::Device& device) {
  if (device.cuda()) {
#if KDN_CUDA
    return kvbus::cuda::CudaDeviceOps(device.index);
#else
    return FailedPrecondition("the device planes (cuda_ipc, nccl): this build has no CUDA");
#endif
  }
  if (kvbus::DeviceOps* ops = kvbus::StandInDeviceOps()) return ops;
  return FailedPrecondition(
      "--kv-transport cuda_ipc or nccl needs a GPU worker (--device cuda or cuda:N): a CPU "
      "worker's KV pool is host memory, which shm (one host) or tcp lands in");
}

Status AllocateKvPoolThroughBackend(kvbus::TransportKind transport, engine::OpenOptions* options,
                                    std::unique_ptr<kvbus::DeviceMemory>* pool) {
  kvbus::DeviceOps* ops = nullptr;
  if (kvbus::OverDevicePlane(transport)) {
    KDN_ASSIGN_OR_RETURN(ops, WorkerDeviceOps(options->device));
  } else if (!options->device.cuda()) {
    ops = &kvbus::HostDeviceOps();
  }
  if (ops == nullptr) return Status::Ok();
  options->kv_pool_memory = [pool, ops](uint64_t bytes) -> Result<uint8_t*> {
    KDN_ASSIGN_OR_RETURN(*pool, ops->Allocate(bytes));
    return (*pool)->data();
  };
  return Status::Ok();
}

void SetWorkerIdentity(proto::WorkerInfo* info, const std::string& name, const std::string& role,
                       const WorkerModel& wm, int chunk_tokens, kvbus::TransportKind transport) {
  info->set_name(name);
  info->set_role(role);
  info->set_model_fingerprint(control::KeyToBytes(wm.fingerprint));
  info->set_chunk_tokens(chunk_tokens);
  info->set_max_context(wm.model->config().max_context);
  info->set_device(wm.model->device());
  info->set_host_id(kvbus::HostId());
  info->set_kv_transport(kvbus::TransportKindName(transport));
}

void AddTransportCounters(proto::WorkerInfo* info, const std::string& transport, uint64_t chunks,
                          uint64_t bytes, double seconds) {
  proto::TransportCounters* t = info->add_kv_transports();
  t->set_transport(transport);
  t->set_chunks(chunks);
  t->set_bytes(bytes);
  t->set_seconds(seconds);
}

void SetKvEventsInfo(proto::WorkerInfo* info, const WorkerKvEvents& events,
                     const std::string& topic) {
  if (events.publisher == nullptr) return;
  info->set_kv_events_endpoint(events.publisher->endpoint());
  info->set_kv_events_replay_endpoint(events.publisher->replay_endpoint());
  info->set_kv_events_topic(topic);
  info->set_kv_events_stream(events.stream);
}

Result<WorkerKvEvents> StartKvEvents(const kvbus::KvEventsOptions& options,
                                     kvbus::TieredStore& store, int chunk_tokens) {
  WorkerKvEvents events;
  if (options.endpoint.empty()) return events;
  if (store.host() == nullptr) {
    return FailedPrecondition("KV events follow the host tier, and this store has none");
  }
  KDN_ASSIGN_OR_RETURN(events.publisher, kvbus::KvEventPublisher::Start(options));
  std::random_device rd;
  events.stream = fmt::format("{:08x}{:08x}", rd(), rd());
  kvbus::KvEventPublisher* publisher = events.publisher.get();
  events.host = std::make_shared<kvbus::HostTierEvents>(
      *store.host(), chunk_tokens,
      [publisher](kvbus::KvEvent e) { publisher->Publish(std::move(e)); });
  if (store.tier_count() > 1) {
    // What it writes to its shared tier (kdn-store, Redis): medium STORAGE.
    store.SetPutListener([host = std::weak_ptr<kvbus::HostTierEvents>(events.host)](
                             size_t, const kvbus::ChunkKey& key) {
      if (auto h = host.lock()) h->WroteShared(key);
    });
  }
  LogInfo("KV events of the host tier on {}{}", publisher->endpoint(),
          publisher->replay_endpoint().empty() ? std::string()
                                               : ", replayed on " + publisher->replay_endpoint());
  return events;
}

}  // namespace kdn::worker
