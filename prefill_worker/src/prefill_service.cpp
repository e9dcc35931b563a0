#include "kdn/prefill_worker/prefill_service.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "kdn/common/job_thread.h"
#include "kdn/common/log.h"
#include "kdn/control/control_server.h"
#include "kdn/control/convert.h"
#include "kdn/worker/worker_setup.h"
#include "kdn/prefill_worker/prefiller.h"

namespace kdn::prefill_worker {

namespace {

struct QueuedJob {
  std::string peer;
  uint64_t request_id = 0;
  bool inject = false;  // job.tokens is a document to store, not a prompt
  PrefillJob job;
  InjectSpec inject_spec;  // an injected document's pruning or erratum base
  // What a KV I/O thread read for it (Prefiller::Prefetch): set once read.
  // Guarded by Impl::mu.
  std::shared_ptr<std::optional<PrefetchedKv>> kv;
  bool read_posted = false;  // its read is queued, running or done
};

// Jobs read ahead of the compute thread at most: what they read (a cached
// prefix can be hundreds of MB) waits in memory until it is computed.
constexpr int kReadAhead = 4;

// PrefillServiceOptions::shared_store as a tier of the worker's store.
class SharedStoreTier final : public kvbus::ChunkStore {
 public:
  explicit SharedStoreTier(std::shared_ptr<kvbus::ChunkStore> store) : store_(std::move(store)) {}
  std::string name() const override { return store_->name(); }
  Result<std::shared_ptr<const kvbus::Chunk>> Get(const kvbus::ChunkKey& key) override {
    return store_->Get(key);
  }
  bool Contains(const kvbus::ChunkKey& key) override { return store_->Contains(key); }
  std::vector<bool> ContainsMany(std::span<const kvbus::ChunkKey> keys) override {
    return store_->ContainsMany(keys);
  }
  Status Put(std::shared_ptr<const kvbus::Chunk> chunk) override {
    return store_->Put(std::move(chunk));
  }
  kvbus::TierStats Stats() override { return store_->Stats(); }
  kvbus::TierStats LocalStats() override { return store_->LocalStats(); }

 private:
  std::shared_ptr<kvbus::ChunkStore> store_;
};

}  // namespace

struct PrefillService::Impl {
  // Constant after Start.
  PrefillServiceOptions options;
  // The engine's KV pool, in memory of a DeviceOps backend, that pushed
  // slices are read from (PrefillerOptions::kv_pool): the host backend's on
  // a CPU, the CUDA backend's with --kv-transport cuda_ipc; null otherwise
  // (the engine's own). Outlives the engine and the Prefiller's senders.
  std::unique_ptr<kvbus::DeviceMemory> pool;
  worker::WorkerModel wm;
  std::unique_ptr<kvbus::TieredStore> store;
  worker::WorkerKvEvents events;         // follows store's host tier
  std::unique_ptr<Prefiller> prefiller;  // the compute thread's alone
  // Lookups: kdn-store round trips, kept off the control I/O thread.
  std::unique_ptr<JobThread> lookups;
  // The jobs' KDN reads, kept off the compute thread.
  std::vector<std::unique_ptr<JobThread>> kv_io;
  int next_kv_io = 0;  // guarded by mu
  std::unique_ptr<control::ControlServer> server;
  int total_blocks = 0;

  // What this worker's chunk keys depend on, less the request's namespace.
  kvbus::KeyContext KeyContext() const { return {wm.fingerprint, "", options.chunk_tokens}; }

  std::mutex mu;
  std::condition_variable cv;
  std::deque<QueuedJob> queue;  // guarded by mu
  bool stop = false;            // guarded by mu
  std::atomic<int> depth{0};    // queued + running
  std::atomic<int64_t> queued_tokens{0};
  std::atomic<int> free_blocks{0};
  kvbus::SenderStats transport_stats;  // guarded by mu: as of the last job
  engine::ResidentStats resident;      // guarded by mu: as of the last job
  uint64_t resident_hit_tokens = 0;    // guarded by mu
  uint64_t kv_bytes_loaded = 0;        // guarded by mu
  std::thread compute;
  LogLimiter unserved;  // messages it does not serve, from any peer

  void FillInfo(proto::WorkerInfo* info) {
    worker::SetWorkerIdentity(info, options.name, "prefill", wm, options.chunk_tokens,
                              options.kv_transport);
    worker::SetKvEventsInfo(info, events, options.kv_events.topic);
    info->set_queue_depth(depth.load());
    info->set_queue_tokens(queued_tokens.load());
    info->set_free_kv_blocks(free_blocks.load());
    info->set_total_kv_blocks(total_blocks);
    kvbus::SenderStats sent;
    {
      std::lock_guard<std::mutex> lock(mu);
      sent = transport_stats;
      worker::SetResidentCounters(info, resident, resident_hit_tokens, kv_bytes_loaded);
    }
    // tcp and shm always (a deployment's pages show both from the start),
    // then any other plane that moved KV.
    sent.planes.try_emplace("tcp");
    sent.planes.try_emplace("shm");
    for (const auto& [plane, p] : sent.planes) {
      worker::AddTransportCounters(info, plane, p.chunks, p.bytes, p.seconds);
    }
    worker::SetStoreCounters(info, *store);
  }

  // Queues `q` for the compute thread, which takes it once a KV I/O thread
  // has read what it needs from the KDN.
  void Enqueue(QueuedJob q) {
    queued_tokens += static_cast<int64_t>(q.job.tokens.size());
    ++depth;
    q.kv = std::make_shared<std::optional<PrefetchedKv>>();
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(std::move(q));
      PostReads();
    }
    cv.notify_one();  // ready now when the compute thread reads
  }

  // Starts the reads of the oldest queued jobs whose reads have not
  // started, while fewer than kReadAhead queued jobs have theirs out or
  // done. Called with mu held.
  void PostReads() {
    if (kv_io.empty()) return;  // the compute thread reads
    int ahead = 0;
    for (QueuedJob& j : queue) {
      if (ahead >= kReadAhead) return;
      if (!j.read_posted) {
        j.read_posted = true;
        kv_io[static_cast<size_t>(next_kv_io++) % kv_io.size()]->Post(
            0, [this, slot = j.kv, job = j.job,
                inject = j.inject ? std::optional<InjectSpec>(j.inject_spec) : std::nullopt] {
              PrefetchedKv kv = prefiller->Prefetch(job, inject ? &*inject : nullptr);
              {
                std::lock_guard<std::mutex> lock(mu);
                *slot = std::move(kv);
              }
              cv.notify_one();
            });
      }
      ++ahead;
    }
  }

  // The oldest queued job whose KDN reads are done (any, when the compute
  // thread reads); end() if none is.
  std::deque<QueuedJob>::iterator FirstReady() {
    return std::find_if(queue.begin(), queue.end(),
                        [this](const QueuedJob& j) { return kv_io.empty() || j.kv->has_value(); });
  }
  // What was read for `q` ahead of the compute thread; null when it reads.
  const PrefetchedKv* ReadFor(const QueuedJob& q) const {
    return q.kv->has_value() ? &**q.kv : nullptr;
  }

  // One document: computed here; stored, then answered, on the
  // Prefiller's store thread, while this thread goes on to the next job.
  void RunInject(const QueuedJob& q) {
    prefiller->Inject(
        q.job.tokens, q.job.ns, q.inject_spec, ReadFor(q),
        [this, request_id = q.request_id, peer = q.peer, tokens = q.job.tokens.size(),
         method = q.inject_spec.prune ? q.inject_spec.prune->method : std::string(),
         base = q.inject_spec.base_tokens,
         steer = q.inject_spec.steer ? q.inject_spec.steer->vector : std::string(),
         vector = q.inject_spec.steering_vector
                      ? q.inject_spec.steering_vector->name
                      : std::string()](Result<Prefiller::InjectOutcome> held) {
          proto::WorkerMessage reply;
          reply.set_request_id(request_id);
          auto* ir = reply.mutable_inject_reply();
          if (held.ok()) {
            ir->set_already_held(held->already_held);
            ir->set_stored_tokens(held->stored_tokens);
            if (!vector.empty()) {
              LogInfo("{} steering vector '{}': {}", ReqId{request_id}, vector,
                      held->already_held ? "already held" : "made and stored");
            } else {
              LogInfo("{} injected a document of {} tokens: {}", ReqId{request_id}, tokens,
                      held->already_held ? std::string("already held")
                      : !steer.empty()   ? fmt::format("steered by '{}' and stored", steer)
                      : !method.empty()
                          ? fmt::format("computed, pruned by {} to {} tokens and stored", method,
                                        held->stored_tokens)
                      : base > 0 ? fmt::format("an erratum of {} tokens after a document of {}, "
                                               "computed and stored",
                                               tokens - static_cast<size_t>(base), base)
                                 : std::string("computed and stored"));
            }
          } else {
            control::StatusToProto(held.status(), ir->mutable_error());
            // An edit whose original or vector is not here, or a vector's
            // name taken, is the client's to fix.
            const StatusCode code = held.status().code();
            Log(code == StatusCode::kNotFound || code == StatusCode::kFailedPrecondition ||
                        code == StatusCode::kInvalidArgument
                    ? LogLevel::kInfo
                    : LogLevel::kError,
                "{} injecting a document of {} tokens failed: {}", ReqId{request_id}, tokens,
                held.status().ToString());
          }
          server->Send(peer, reply);
        });
  }

  // One prompt: prefill, reply, then store its new chunks.
  void RunPrefill(const QueuedJob& q) {
    const auto t0 = std::chrono::steady_clock::now();
    auto out = prefiller->Run(q.job, ReadFor(q));
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    proto::WorkerMessage reply;
    reply.set_request_id(q.request_id);
    auto* pr = reply.mutable_prefill_reply();
    pr->set_transfer_id(q.job.transfer_id);
    if (out.ok()) {
      pr->set_first_token(out->first_token);
      pr->set_cached_tokens(out->cached_tokens);
      pr->set_tail_tokens(out->tail_tokens);
      pr->set_computed_tokens(out->computed_tokens);
      pr->set_kv_bytes_sent(out->kv_bytes_sent);
      pr->set_slices_skipped(out->slices_skipped);
      pr->set_slices_sourced(out->slices_sourced);
      pr->set_blended_tokens(out->blended_tokens);
      pr->set_recomputed_tokens(out->recomputed_tokens);
      pr->set_question_pass_tokens(out->question_pass_tokens);
      pr->set_recompute_ratio(out->recompute_ratio);
      pr->set_resident_tokens(out->resident_tokens);
      pr->set_kv_bytes_loaded(out->kv_bytes_loaded);
      pr->set_kv_tokens(out->kv_tokens);
      pr->set_kv_holes(out->kv_holes);
      pr->set_pruned_tokens(out->pruned_tokens);
      {
        std::lock_guard<std::mutex> lock(mu);
        resident_hit_tokens += static_cast<uint64_t>(out->resident_tokens);
        kv_bytes_loaded += out->kv_bytes_loaded;
      }
      const ReqId req{q.request_id};
      LogInfo(
          "{} KDN: {} of {} prompt tokens cached ({} resident in the pool, {} from tail "
          "pieces, {} blended, {} of them pruned away when stored), {} KV bytes loaded in {:.1f} "
          "ms",
          req, out->cached_tokens, q.job.tokens.size(), out->resident_tokens, out->tail_tokens,
          out->blended_tokens, out->pruned_tokens, out->kv_bytes_loaded, out->load_seconds * 1e3);
      LogInfo("{} computed: {} tokens in full, {} blended tokens recomputed; {:.1f} ms in all", req,
              out->computed_tokens, out->recomputed_tokens, secs * 1e3);
      if (!q.job.decode_endpoint.empty()) {
        LogInfo(
            "{} KV sent: {} bytes to {} (transfer {}), {} slices skipped, {} read where they "
            "lie in the pool",
            req, out->kv_bytes_sent, q.job.decode_endpoint, HexBytes{q.job.transfer_id},
            out->slices_skipped, out->slices_sourced);
      }
    } else {
      control::StatusToProto(out.status(), pr->mutable_error());
      LogError("{} failed: {}", ReqId{q.request_id}, out.status().ToString());
    }
    server->Send(q.peer, reply);
    // After the reply, so that storing costs the request no time.
    if (Status st = prefiller->StoreNewChunks(); !st.ok()) {
      LogError("{} storing chunks: {}", ReqId{q.request_id}, st.ToString());
    }
  }

  void OnMessage(control::ControlServer& srv, const std::string& peer, proto::WorkerMessage msg) {
    const auto fill = [this](proto::WorkerInfo* info) { FillInfo(info); };
    if (msg.body_case() == proto::WorkerMessage::kLookup ||
        msg.body_case() == proto::WorkerMessage::kKeep) {  // a shared tier's keep: a round trip
      lookups->Post(0, [this, &srv, peer, msg = std::move(msg), fill] {
        (void)worker::AnswerQuery(srv, peer, msg, *store, KeyContext(), fill,
                                  &wm.model->kv_cache());
      });
      return;
    }
    if (worker::AnswerQuery(srv, peer, msg, *store, KeyContext(), fill)) return;
    switch (msg.body_case()) {
      case proto::WorkerMessage::kPrefill: {
        QueuedJob q;
        q.peer = peer;
        q.request_id = msg.request_id();
        const proto::PrefillRequest& r = msg.prefill();
        q.job.tokens.assign(r.tokens().begin(), r.tokens().end());
        q.job.ns = r.ns();
        q.job.sampling = control::SamplingFromProto(r.sampling());
        q.job.decode_endpoint = r.decode_endpoint();
        q.job.decode_held_tokens = r.decode_held_tokens();
        q.job.transfer_id = r.transfer_id();
        q.job.generated_tokens = r.generated_tokens();
        if (r.has_blend()) q.job.blend = control::BlendFromProto(r.blend());
        LogInfo(
            "{} received: {} prompt tokens{}{}, KV to {} (it holds {} tokens; transfer {}), "
            "{} ahead in the queue",
            ReqId{q.request_id}, q.job.tokens.size(),
            q.job.generated_tokens > 0
                ? fmt::format(" (resumed: the last {} generated)", q.job.generated_tokens)
                : std::string(),
            q.job.blend ? fmt::format(", {} documents", q.job.blend->segment_tokens.size())
                        : std::string(),
            q.job.decode_endpoint, q.job.decode_held_tokens, HexBytes{q.job.transfer_id},
            depth.load());
        Enqueue(std::move(q));
        return;
      }
      case proto::WorkerMessage::kInject: {
        QueuedJob q;
        q.peer = peer;
        q.request_id = msg.request_id();
        q.inject = true;
        q.job.tokens.assign(msg.inject().tokens().begin(), msg.inject().tokens().end());
        q.job.ns = msg.inject().ns();
        if (msg.inject().has_prune()) {
          Result<prune::PruneSpec> spec = control::PruneFromProto(msg.inject().prune());
          if (!spec.ok()) {
            // Another kdn's granularity: refused before it is queued.
            proto::WorkerMessage reply;
            reply.set_request_id(q.request_id);
            control::StatusToProto(spec.status(), reply.mutable_inject_reply()->mutable_error());
            server->Send(peer, reply);
            return;
          }
          q.inject_spec.prune = *std::move(spec);
        }
        q.inject_spec.base_tokens = msg.inject().base_tokens();
        q.inject_spec.base_required = msg.inject().base_required();
        if (msg.inject().has_steer())
          q.inject_spec.steer = control::SteerFromProto(msg.inject().steer());
        if (msg.inject().has_steering_vector()) {
          q.inject_spec.steering_vector =
              control::SteeringVectorFromProto(msg.inject().steering_vector());
        }
        LogDebug("{} received: inject a document of {} tokens", ReqId{q.request_id},
                 q.job.tokens.size());
        Enqueue(std::move(q));
        return;
      }
      case proto::WorkerMessage::kCancel: {
        std::lock_guard<std::mutex> lock(mu);
        for (auto it = queue.begin(); it != queue.end(); ++it) {
          if (it->peer == peer && it->request_id == msg.request_id()) {
            queued_tokens -= static_cast<int64_t>(it->job.tokens.size());
            --depth;
            queue.erase(it);
            PostReads();
            LogInfo("{} cancelled while queued", ReqId{msg.request_id()});
            break;
          }
        }
        return;  // a running prefill finishes; its router ignores the reply
      }
      default:
        unserved.Warn("{} ignoring a message it does not serve ({})", ReqId{msg.request_id()},
                      static_cast<int>(msg.body_case()));
    }
  }

  void Loop() {
    free_blocks = wm.model->kv_cache().free_blocks();
    for (;;) {
      QueuedJob q;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || FirstReady() != queue.end(); });
        if (stop) return;
        auto ready = FirstReady();
        q = std::move(*ready);
        queue.erase(ready);
        PostReads();
      }
      // Pins' keeps and their expiry, before the job takes blocks.
      wm.model->kv_cache().ApplyKeeps(std::chrono::steady_clock::now());
      if (q.inject) {
        RunInject(q);
      } else {
        RunPrefill(q);
      }
      queued_tokens -= static_cast<int64_t>(q.job.tokens.size());
      --depth;
      free_blocks = wm.model->kv_cache().free_blocks();
      const kvbus::SenderStats sent = prefiller->TransportStats();
      const engine::ResidentStats pool = wm.model->kv_cache().resident_stats();
      std::lock_guard<std::mutex> lock(mu);
      transport_stats = sent;
      resident = pool;
    }
  }
};

PrefillService::PrefillService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<PrefillService>> PrefillService::Start(
    const PrefillServiceOptions& options) {
  if (options.chunk_tokens <= 0) return InvalidArgument("--chunk-tokens must be positive");
  if (options.kv_io_threads < 0) return InvalidArgument("kv_io_threads must not be negative");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  engine::OpenOptions eo = options.engine;
  KDN_RETURN_IF_ERROR(worker::AllocateKvPoolThroughBackend(options.kv_transport, &eo, &impl->pool));
  Impl* raw = impl.get();
  KDN_ASSIGN_OR_RETURN(impl->wm, worker::LoadWorkerModel(options.model_dir, eo));
  if (options.shared_store != nullptr) {
    if (!options.shared_tier.empty()) {
      return InvalidArgument("a shared tier is named (" + options.shared_tier +
                             ") and given as an object: one of them");
    }
    std::vector<std::unique_ptr<kvbus::ChunkStore>> tiers;
    tiers.push_back(std::make_unique<kvbus::HostTier>(options.host_bytes));
    tiers.push_back(std::make_unique<SharedStoreTier>(options.shared_store));
    impl->store = std::make_unique<kvbus::TieredStore>(
        std::move(tiers), kvbus::TieredStoreOptions{.write_through = true});
  } else {
    KDN_ASSIGN_OR_RETURN(
        impl->store,
        worker::MakeWorkerStore(options.host_bytes, options.shared_tier, options.store_codec,
                                {.curve = options.curve,
                                 .model = impl->wm.fingerprint,
                                 .ttl = options.shared_tier_ttl}));
  }
  KDN_ASSIGN_OR_RETURN(
      impl->events, worker::StartKvEvents(options.kv_events, *impl->store, options.chunk_tokens));
  PrefillerOptions po;
  po.chunk_tokens = options.chunk_tokens;
  po.events = impl->events.host.get();
  po.blend_kl_per_residual = options.blend_kl_per_residual;
  for (const std::string& text : prune::CalibrationTexts()) {
    po.budget_texts.push_back(impl->wm.tokenizer->Encode(text, /*add_bos=*/false));
  }
  po.sender.transport = options.kv_transport;
  // The device plane's backend: cuda_ipc writes the slices the prefiller
  // pushes into a decode worker's exported pool, nccl sends them over a
  // link of it; auto uses cuda_ipc where a decode worker offers a device
  // region.
  if (kvbus::OverDevicePlane(options.kv_transport)) {
    KDN_ASSIGN_OR_RETURN(po.sender.device_ops, worker::WorkerDeviceOps(options.engine.device));
  } else if (options.kv_transport == kvbus::TransportKind::kAuto) {
    Result<kvbus::DeviceOps*> ops = worker::WorkerDeviceOps(options.engine.device);
    po.sender.device_ops = ops.ok() ? *ops : nullptr;
  }
  po.sender.curve = options.curve;
  po.store_in_background = true;
  // Over tcp a sourced slice is read into a chunk anyway: built at once.
  po.kv_pool = options.kv_transport == kvbus::TransportKind::kTcp ? nullptr : impl->pool.get();
  impl->prefiller =
      std::make_unique<Prefiller>(*impl->wm.model, *impl->store, impl->wm.fingerprint, po);
  impl->lookups = std::make_unique<JobThread>();
  for (int i = 0; i < options.kv_io_threads; ++i) {
    impl->kv_io.push_back(std::make_unique<JobThread>());
  }
  impl->total_blocks = impl->wm.model->kv_cache().num_blocks();
  impl->free_blocks = impl->wm.model->kv_cache().free_blocks();
  KDN_ASSIGN_OR_RETURN(
      impl->server, control::ControlServer::Start(
                        options.listen,
                        [raw](control::ControlServer& srv, const std::string& peer,
                              proto::WorkerMessage m) { raw->OnMessage(srv, peer, std::move(m)); },
                        options.curve));
  impl->compute = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<PrefillService>(new PrefillService(std::move(impl)));
}

PrefillService::~PrefillService() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  if (impl_->compute.joinable()) impl_->compute.join();
  // The store thread answers injections through the server.
  if (impl_->prefiller) impl_->prefiller->WaitForStores();
  for (auto& io : impl_->kv_io) (void)io->Stop();  // before the Prefiller and store they read
  (void)impl_->lookups->Stop();                    // before the server it answers through
  impl_->server.reset();                           // before the state its handler reads
}

const std::string& PrefillService::endpoint() const { return impl_->server->endpoint(); }
std::string PrefillService::engine_summary() const {
  return worker::EngineSummary(*impl_->wm.model);
}

}  // namespace kdn::prefill_worker
