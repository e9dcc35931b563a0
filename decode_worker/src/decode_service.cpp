#include "kdn/decode_worker/decode_service.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "kdn/common/job_thread.h"
#include "kdn/common/log.h"
#include "kdn/control/control_server.h"
#include "kdn/control/convert.h"
#include "kdn/control/request_spec.h"
#include "kdn/worker/worker_setup.h"
#include "kdn/decode_worker/decoder.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/transport.h"

namespace kdn::decode_worker {

namespace {

// A control message for the compute thread.
struct Command {
  std::string peer;
  proto::WorkerMessage msg;
};

// Who asked for a request: replies and token events go back there.
struct Origin {
  std::string peer;
  uint64_t request_id = 0;
  int64_t tokens = 0;       // token events sent to it so far
  int64_t blocks = 0;       // KV blocks its prompt reserved
  bool unstarted = true;    // prepared, not started: its blocks count against its peer's budget
  std::string transfer_id;  // echoed in a local prefill's reply
};

std::string OriginKey(const std::string& peer, uint64_t request_id) {
  return peer + "/" + std::to_string(request_id);
}

DecodeRequest RequestFromProto(uint64_t request_id, const proto::PrepareRequest& r) {
  DecodeRequest d;
  d.request_id = request_id;
  d.tokens.assign(r.tokens().begin(), r.tokens().end());
  d.ns = r.ns();
  d.transfer_id = r.transfer_id();
  d.blended = r.blended();
  d.local_prefill = r.local_prefill();
  d.lookup_tokens = r.lookup_tokens();
  if (r.has_emphasis()) {
    blend::Emphasis e = control::EmphasisFromProto(r.emphasis());
    d.emphasis = engine::KvSequence::AttentionBias{std::move(e.spans), e.heads, std::move(e.bias)};
  }
  d.spec.sampling = control::SamplingFromProto(r.sampling());
  d.spec.max_tokens = r.max_tokens();
  d.spec.stop_ids.assign(r.stop_ids().begin(), r.stop_ids().end());
  d.spec.stop_strings.assign(r.stop_strings().begin(), r.stop_strings().end());
  // A resumed request's generated tokens (DoPrepare has checked the count
  // is within the tokens; Decoder::Prepare checks the rest).
  d.spec.generated.assign(r.tokens().end() - r.generated_tokens(), r.tokens().end());
  return d;
}

}  // namespace

uint64_t StagingBytesFor(const model::ModelConfig& config, engine::DType kv_dtype,
                         int64_t pool_tokens, int max_batch, int chunk_tokens) {
  const int64_t longest = std::min<int64_t>(config.max_context, pool_tokens);
  // longest * max_batch, at most the pool (without overflowing).
  const int64_t tokens =
      longest > 0 && max_batch > pool_tokens / longest ? pool_tokens : longest * max_batch;
  const auto per_token = static_cast<uint64_t>(2 * int64_t{config.num_layers} * config.kv_dim() *
                                               engine::DTypeSize(kv_dtype));
  const auto slices = static_cast<uint64_t>((tokens / std::max(chunk_tokens, 1) + max_batch) *
                                            int64_t{config.num_layers});
  return static_cast<uint64_t>(tokens) * per_token + slices * kvbus::Chunk::kHeaderBytes;
}

struct DecodeService::Impl {
  // Constant after Start (declared so that what borrows is destroyed first).
  DecodeServiceOptions options;
  // The CPU engine's KV pool, in memory that prefill workers on this host
  // open to land pushed slices in place (docs/kvbus.md, "Landing in
  // place"): a shared segment of the host backend, written by their shm
  // plane, or by their cuda_ipc plane where the host backend stands in for
  // a device (pool_kind kDevice); null on a GPU. Outlives the engine.
  std::unique_ptr<kvbus::DeviceMemory> pool;
  kvbus::RegionKind pool_kind = kvbus::RegionKind::kShm;
  worker::WorkerModel wm;
  std::unique_ptr<kvbus::TieredStore> store;
  worker::WorkerKvEvents events;  // follows store's host tier
  std::unique_ptr<kvbus::HostTier> staging;
  std::unique_ptr<SliceLanding> landing;  // with `pool`
  // The Decoder's kdn-store round trips: loads and stores.
  std::unique_ptr<JobThread> store_io;
  // Lookups on a thread of their own: a router waits on them (about a
  // second), and a load or store in flight to a store that stopped answering
  // must not hold them for its whole timeout.
  std::unique_ptr<JobThread> lookup_io;
  std::unique_ptr<Decoder> decoder;  // the compute thread's alone
  std::unique_ptr<kvbus::Receiver> receiver;
  std::unique_ptr<control::ControlServer> server;
  std::string kvbus_endpoint;
  int total_blocks = 0;

  // What this worker's chunk keys depend on, less the request's namespace.
  kvbus::KeyContext KeyContext() const { return {wm.fingerprint, "", options.chunk_tokens}; }

  std::mutex mu;
  std::condition_variable cv;
  std::deque<Command> commands;  // guarded by mu
  bool loads_in = false;         // guarded by mu: the Decoder has loads to take in
  bool stop = false;             // guarded by mu
  std::atomic<int> depth{0};     // prepared + running
  std::atomic<int> free_blocks{0};
  std::atomic<int64_t> leased_blocks{0};  // unstarted_blocks, summed
  DecoderStats stats;                     // guarded by mu: as of the last Advance
  std::thread compute;
  LogLimiter unserved;  // messages it does not serve, from any peer
  // When each peer was last heard from (any message: routers ping every
  // 250 ms), for the leases on its unstarted requests. Guarded by mu.
  std::map<std::string, std::chrono::steady_clock::time_point> heard;

  // The compute thread's alone.
  std::map<std::string, uint64_t> ids;  // origin key -> Decoder id
  std::map<uint64_t, Origin> origins;   // Decoder id -> who asked
  // Per peer, KV blocks held by its prepared requests not yet started.
  std::map<std::string, int64_t> unstarted_blocks;
  std::chrono::steady_clock::time_point next_lease_check{};

  std::chrono::steady_clock::time_point Now() const {
    return options.clock ? options.clock() : std::chrono::steady_clock::now();
  }

  void FillInfo(proto::WorkerInfo* info) {
    worker::SetWorkerIdentity(info, options.name, "decode", wm, options.chunk_tokens,
                              options.kv_transport);
    worker::SetKvEventsInfo(info, events, options.kv_events.topic);
    info->set_kvbus_endpoint(kvbus_endpoint);
    info->set_queue_depth(depth.load());
    info->set_max_batch(options.max_batch);
    // Free before leased (the compute thread stores them the other way
    // round): blocks seen free are seen no longer leased.
    const int free = free_blocks.load();
    info->set_leased_kv_blocks(static_cast<int32_t>(leased_blocks.load()));
    info->set_free_kv_blocks(free);
    info->set_total_kv_blocks(total_blocks);
    kvbus::ReceiverStats rs = receiver->Stats();
    // tcp and shm always, as a prefill worker reports them, then any other
    // plane that carried KV here.
    rs.planes.try_emplace("tcp");
    rs.planes.try_emplace("shm");
    for (const auto& [plane, p] : rs.planes) {
      worker::AddTransportCounters(info, plane, p.chunks, p.bytes, 0);
    }
    info->set_kvbus_leased_bytes(rs.leased_bytes);
    worker::SetStoreCounters(info, *store);
    {
      std::lock_guard<std::mutex> lock(mu);
      worker::SetResidentCounters(info, stats.resident, stats.resident_hit_tokens,
                                  stats.kv_bytes_loaded);
      proto::LocalPrefill* lp = info->mutable_local_prefill();
      lp->set_running(stats.running);
      lp->set_backlog_tokens(stats.local_backlog_tokens);
      lp->set_step_ms(stats.step_ms);
      lp->set_prefill_ms_per_token(stats.prefill_ms_per_token);
      lp->set_step_tokens(options.local_prefill_step_tokens);
      lp->set_requests(stats.local_prefills);
      lp->set_tokens(stats.local_prefill_tokens);
      proto::PushedKv* pk = info->mutable_pushed_kv();
      pk->set_slices_landed(stats.slices_landed);
      pk->set_start_copy_bytes(stats.start_copy_bytes);
      pk->set_quarantined_blocks(stats.quarantined_blocks);
      proto::Preemption* pe = info->mutable_preemption();
      pe->set_waiting(stats.preempted);
      pe->set_preemptions(stats.preemptions);
      pe->set_resumed_by_load(stats.resumed_by_load);
      pe->set_resumed_by_recompute(stats.resumed_by_recompute);
      pe->set_recomputed_tokens(stats.resume_recomputed_tokens);
    }
    if (landing) info->mutable_pushed_kv()->set_landed_bytes(landing->Stats().landed_bytes);
    if (Status h = receiver->Health(); !h.ok()) {
      control::StatusToProto(h, info->mutable_health());
    }
  }

  // Control I/O thread: answers info requests, hands lookups (store round
  // trips) to the store I/O thread and the rest to the compute thread.
  void OnMessage(control::ControlServer& srv, const std::string& peer, proto::WorkerMessage msg) {
    const auto fill = [this](proto::WorkerInfo* info) { FillInfo(info); };
    {
      std::lock_guard<std::mutex> lock(mu);
      heard[peer] = Now();
    }
    switch (msg.body_case()) {
      case proto::WorkerMessage::kLookup:
      case proto::WorkerMessage::kKeep:  // a shared tier's keep is a round trip too
        lookup_io->Post(0, [this, &srv, peer, msg = std::move(msg), fill] {
          (void)worker::AnswerQuery(srv, peer, msg, *store, KeyContext(), fill,
                                    &wm.model->kv_cache());
        });
        return;
      case proto::WorkerMessage::kPrepare:
      case proto::WorkerMessage::kStart:
      case proto::WorkerMessage::kCancel: {
        {
          std::lock_guard<std::mutex> lock(mu);
          commands.push_back({peer, std::move(msg)});
        }
        cv.notify_one();
        return;
      }
      default:
        if (msg.body_case() == proto::WorkerMessage::kInfoRequest &&
            msg.info_request().held_requests_size() > 0) {
          // The ping renews its router's reservations here (on the compute
          // thread, which owns them), and is answered as any ping.
          proto::WorkerMessage renew;
          *renew.mutable_info_request()->mutable_held_requests() =
              msg.info_request().held_requests();
          {
            std::lock_guard<std::mutex> lock(mu);
            commands.push_back({peer, std::move(renew)});
          }
          cv.notify_one();
        }
        if (worker::AnswerQuery(srv, peer, msg, *store, KeyContext(), fill)) return;
        unserved.Warn("{} ignoring a message it does not serve ({})", ReqId{msg.request_id()},
                      static_cast<int>(msg.body_case()));
    }
  }

  void SendError(const Origin& o, const Status& st) {
    proto::WorkerMessage m;
    m.set_request_id(o.request_id);
    auto* e = m.mutable_tokens()->add_events();
    e->set_token(-1);
    e->set_finished(true);
    control::StatusToProto(st, e->mutable_error());
    server->Send(o.peer, m);
  }

  // A peer's budget: the KV blocks its prepared, unstarted requests may
  // hold together (options.peer_prepare_share of the pool).
  Status CheckBudget(const std::string& peer, int64_t blocks) const {
    const auto it = unstarted_blocks.find(peer);
    const int64_t held = it == unstarted_blocks.end() ? 0 : it->second;
    const auto budget = static_cast<int64_t>(options.peer_prepare_share * total_blocks);
    if (held + blocks <= budget) return Status::Ok();
    return ResourceExhausted(
        "this router's requests not yet started hold " + std::to_string(held) + " KV blocks; " +
        std::to_string(blocks) + " more would pass its budget of " + std::to_string(budget) + " (" +
        std::to_string(options.peer_prepare_share) + " of the pool, --peer-prepare-share)");
  }

  void DoPrepare(const std::string& peer, const proto::WorkerMessage& msg, DecoderOutput* out) {
    const std::string okey = OriginKey(peer, msg.request_id());
    const proto::PrepareRequest& pr = msg.prepare();
    Status refused;
    int64_t blocks = 0;
    if (ids.count(okey) != 0) {
      refused = InvalidArgument("request " + std::to_string(msg.request_id()) + " is already here");
    } else if (pr.generated_tokens() < 0 || pr.generated_tokens() > pr.tokens_size()) {
      refused = InvalidArgument("generated_tokens " + std::to_string(pr.generated_tokens()) +
                                " is not within the " + std::to_string(pr.tokens_size()) +
                                " tokens sent");
    }
    DecodeRequest request;
    if (refused.ok()) {
      request = RequestFromProto(msg.request_id(), pr);
      blocks = KvBlocksFor(KvTokensAdmitted(request, wm.model->config().max_context));
      refused = CheckBudget(peer, blocks);
    }
    Result<uint64_t> id =
        !refused.ok() ? Result<uint64_t>(refused) : decoder->Prepare(std::move(request), out);
    if (!id.ok()) {
      if (id.status().code() == StatusCode::kResourceExhausted) {
        // Back-pressure, not a fault: the router queues it until there is room.
        LogInfo("{} prepare refused for now: {}", ReqId{msg.request_id()}, id.status().ToString());
      } else {
        LogError("{} prepare refused: {}", ReqId{msg.request_id()}, id.status().ToString());
      }
      proto::WorkerMessage reply;
      reply.set_request_id(msg.request_id());
      control::StatusToProto(id.status(), reply.mutable_prepare_reply()->mutable_error());
      server->Send(peer, reply);
      return;
    }
    // The reply goes out with the Decoder's PrepareDone, once the load is in.
    ids[okey] = *id;
    origins[*id] = {peer, msg.request_id(), 0, blocks, true, pr.transfer_id()};
    unstarted_blocks[peer] += blocks;
  }

  // `o` is started, finished or let go: its blocks leave its peer's budget.
  void Unreserve(Origin& o) {
    if (!o.unstarted) return;
    o.unstarted = false;
    auto it = unstarted_blocks.find(o.peer);
    if (it != unstarted_blocks.end() && (it->second -= o.blocks) <= 0) unstarted_blocks.erase(it);
  }

  // Leases: the unstarted requests of a peer silent for options.peer_lease
  // (its router died, or it was never a router) are let go, their blocks
  // free; and peers long silent are forgotten.
  void ExpireLeases(DecoderOutput* out) {
    // Leases last seconds: a look every 100 ms is enough, rather than one
    // per decode step.
    const auto now = Now();
    if (now < next_lease_check) return;
    next_lease_check = now + std::chrono::milliseconds(100);
    std::set<std::string> silent;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto it = heard.begin(); it != heard.end();) {
        const auto quiet = now - it->second;
        if (quiet > options.peer_lease) silent.insert(it->first);
        it = quiet > 10 * options.peer_lease ? heard.erase(it) : std::next(it);
      }
    }
    if (silent.empty()) return;
    std::vector<uint64_t> lapsed;
    for (const auto& [id, o] : origins) {
      if (o.unstarted && silent.count(o.peer) != 0) lapsed.push_back(id);
    }
    for (uint64_t id : lapsed) {
      Origin& o = origins[id];
      LogWarn("{} its router has been silent for over {} ms: letting its {} reserved KV blocks go",
              ReqId{o.request_id}, options.peer_lease.count(), o.blocks);
      Unreserve(o);
      (void)decoder->Cancel(id, out);
    }
  }

  // Its router still wants these prepared requests (proto::InfoRequest).
  void DoRenew(const std::string& peer, const proto::WorkerMessage& msg) {
    for (uint64_t request_id : msg.info_request().held_requests()) {
      auto it = ids.find(OriginKey(peer, request_id));
      if (it != ids.end()) (void)decoder->Renew(it->second);
    }
  }

  void DoStart(const std::string& peer, const proto::WorkerMessage& msg, DecoderOutput* out) {
    const Origin origin{peer, msg.request_id()};
    auto it = ids.find(OriginKey(peer, msg.request_id()));
    Status st = it == ids.end() ? NotFound("request " + std::to_string(msg.request_id()) +
                                           " was not prepared here (or expired)")
                                : decoder->Start(it->second, msg.start().first_token(),
                                                 msg.start().first_token_sent(), out,
                                                 msg.start().kv_tokens(), msg.start().kv_holes());
    if (st.ok()) Unreserve(origins[it->second]);
    if (!st.ok()) {
      LogError("{} start refused: {}", ReqId{msg.request_id()}, st.ToString());
      SendError(origin, st);
    }
  }

  void DoCancel(const std::string& peer, const proto::WorkerMessage& msg, DecoderOutput* out) {
    auto it = ids.find(OriginKey(peer, msg.request_id()));
    if (it != ids.end()) {
      (void)decoder->Cancel(it->second, out);
    } else {
      LogDebug("{} cancel: not here (finished already)", ReqId{msg.request_id()});
    }
  }

  // Requests that started (a local prefill's first token) or ended leave
  // their peer's budget: before the figures are published, so that an info
  // reply never shows their blocks free and still leased.
  void Settle(const DecoderOutput& out) {
    for (const LocalPrefillDone& d : out.prefilled) {
      if (auto it = origins.find(d.id); it != origins.end()) Unreserve(it->second);
    }
    for (const TokenEvent& e : out.events) {
      if (!e.finished) continue;
      if (auto it = origins.find(e.id); it != origins.end()) Unreserve(it->second);
    }
  }

  // Sends what the Decoder produced to the routers that asked: Prepare
  // replies, then one message of token events per request. Finished
  // requests are forgotten.
  void Deliver(const DecoderOutput& out) {
    for (const PrepareDone& d : out.prepared) {
      auto it = origins.find(d.id);
      if (it == origins.end()) continue;
      proto::WorkerMessage reply;
      reply.set_request_id(it->second.request_id);
      reply.mutable_prepare_reply()->set_held_tokens(static_cast<int32_t>(d.held_tokens));
      reply.mutable_prepare_reply()->set_resident_tokens(static_cast<int32_t>(d.resident_tokens));
      server->Send(it->second.peer, reply);
    }
    // A local prefill's first token, as a prefill worker would send it;
    // before its events, which follow it.
    for (const LocalPrefillDone& d : out.prefilled) {
      auto it = origins.find(d.id);
      if (it == origins.end()) continue;
      proto::WorkerMessage reply;
      reply.set_request_id(it->second.request_id);
      proto::PrefillReply* pr = reply.mutable_prefill_reply();
      pr->set_first_token(d.first_token);
      pr->set_cached_tokens(static_cast<int32_t>(d.held_tokens));
      pr->set_computed_tokens(static_cast<int32_t>(d.computed_tokens));
      pr->set_resident_tokens(static_cast<int32_t>(d.resident_tokens));
      pr->set_kv_bytes_loaded(d.kv_bytes_loaded);
      pr->set_tail_tokens(static_cast<int32_t>(d.held_tokens % options.chunk_tokens));
      pr->set_transfer_id(it->second.transfer_id);
      server->Send(it->second.peer, reply);
    }
    std::map<uint64_t, std::vector<const TokenEvent*>> by_id;
    for (const TokenEvent& e : out.events) by_id[e.id].push_back(&e);
    for (const auto& [id, evs] : by_id) {
      auto it = origins.find(id);
      if (it == origins.end()) continue;
      proto::WorkerMessage m;
      m.set_request_id(it->second.request_id);
      for (const TokenEvent* ev : evs) {
        if (ev->token >= 0) ++it->second.tokens;
        auto* e = m.mutable_tokens()->add_events();
        e->set_token(ev->token);
        e->set_text(ev->text);
        e->set_finished(ev->finished);
        e->set_finish_reason(ev->finish_reason);
        if (!ev->error.ok()) control::StatusToProto(ev->error, e->mutable_error());
      }
      server->Send(it->second.peer, m);
      if (evs.back()->finished) {
        const TokenEvent& last = *evs.back();
        if (!last.error.ok()) {
          LogError("{} failed after {} tokens: {}", ReqId{it->second.request_id}, it->second.tokens,
                   last.error.ToString());
        } else {
          LogInfo("{} finished: {}, {} tokens sent", ReqId{it->second.request_id},
                  last.finish_reason, it->second.tokens);
        }
        ids.erase(OriginKey(it->second.peer, it->second.request_id));
        origins.erase(it);
      }
    }
  }

  void Loop() {
    for (;;) {
      std::deque<Command> todo;
      {
        std::unique_lock<std::mutex> lock(mu);
        // Awake at least once a second, so that unstarted requests expire.
        if (!decoder->Busy()) {
          cv.wait_for(lock, std::chrono::seconds(1),
                      [&] { return stop || loads_in || !commands.empty(); });
        }
        if (stop) return;
        loads_in = false;
        todo.swap(commands);
      }
      DecoderOutput out;
      ExpireLeases(&out);
      for (const Command& c : todo) {
        switch (c.msg.body_case()) {
          case proto::WorkerMessage::kPrepare: DoPrepare(c.peer, c.msg, &out); break;
          case proto::WorkerMessage::kStart: DoStart(c.peer, c.msg, &out); break;
          case proto::WorkerMessage::kCancel: DoCancel(c.peer, c.msg, &out); break;
          case proto::WorkerMessage::kInfoRequest: DoRenew(c.peer, c.msg); break;
          default: break;
        }
      }
      decoder->Advance(&out);
      Settle(out);
      // The figures first, then the replies: a peer that asks for info after
      // a reply sees what the reply did (its blocks reserved or given back).
      const DecoderStats s = decoder->Stats();
      // Leased before free: a reader that sees the blocks free sees them no
      // longer leased.
      int64_t leased = 0;
      for (const auto& [peer, blocks] : unstarted_blocks) leased += blocks;
      leased_blocks = leased;
      // Preempted requests wait ahead of any new one, for blocks of their
      // own; a new one must leave the admission reserve free.
      depth = s.prepared + s.running + s.preempted;
      free_blocks = static_cast<int>(
          std::max<int64_t>(s.free_kv_blocks - s.resume_kv_blocks - s.admission_reserve_blocks, 0));
      {
        std::lock_guard<std::mutex> lock(mu);
        stats = s;
      }
      Deliver(out);
    }
  }
};

DecodeService::DecodeService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<DecodeService>> DecodeService::Start(const DecodeServiceOptions& options) {
  if (options.chunk_tokens <= 0) return InvalidArgument("--chunk-tokens must be positive");
  if (options.max_batch <= 0) return InvalidArgument("--max-batch must be positive");
  if (options.local_prefill_step_tokens <= 0) {
    return InvalidArgument("--local-prefill-step-tokens must be positive");
  }
  if (!(options.admission_reserve >= 0 && options.admission_reserve <= 0.99)) {
    return InvalidArgument("--admission-reserve must be between 0 and 0.99");
  }
  if (options.local_prefill_call_tokens <= 0) {
    return InvalidArgument("--local-prefill-call-tokens must be positive");
  }
  if (!(options.peer_prepare_share > 0 && options.peer_prepare_share <= 1)) {
    return InvalidArgument("--peer-prepare-share must be in (0, 1]");
  }
  if (options.peer_lease.count() <= 0) return InvalidArgument("--peer-lease-ms must be positive");
  if (options.prepare_timeout.count() <= 0) {
    return InvalidArgument("--prepare-timeout-ms must be positive");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  engine::OpenOptions eo = options.engine;
  eo.max_batch = options.max_batch;
  eo.max_prefill_tokens = options.local_prefill_call_tokens;
  Impl* raw = impl.get();
  // The KV pool in memory prefill workers can write: a GPU's, exported for
  // their cuda_ipc plane or received into over their nccl link, only with
  // --kv-transport cuda_ipc or nccl (auto keeps a GPU pool the engine's
  // own, its slices through staging, until the device planes have run on a
  // GPU: docs/kvbus.md, "Device planes").
  KDN_RETURN_IF_ERROR(worker::AllocateKvPoolThroughBackend(options.kv_transport, &eo, &raw->pool));
  if (kvbus::OverDevicePlane(options.kv_transport)) {
    impl->pool_kind = kvbus::RegionKind::kDevice;
  }
  KDN_ASSIGN_OR_RETURN(impl->wm, worker::LoadWorkerModel(options.model_dir, eo));
  KDN_ASSIGN_OR_RETURN(
      impl->store,
      worker::MakeWorkerStore(
          options.host_bytes, options.shared_tier, options.store_codec,
          {.curve = options.curve, .model = impl->wm.fingerprint, .ttl = options.shared_tier_ttl}));
  KDN_ASSIGN_OR_RETURN(
      impl->events, worker::StartKvEvents(options.kv_events, *impl->store, options.chunk_tokens));
  engine::Engine& model = *impl->wm.model;
  const int64_t pool_tokens = int64_t{model.kv_cache().num_blocks()} * engine::kKvBlockTokens;
  if (impl->options.staging_bytes == 0) {
    impl->options.staging_bytes = StagingBytesFor(model.config(), model.kv_dtype(), pool_tokens,
                                                  options.max_batch, options.chunk_tokens);
    LogInfo(
        "staging for pushed KV: {:.1f} MiB, the {} KV of {} prompts of up to {} tokens, at most "
        "the pool's {} tokens (--staging-mib sets it)",
        static_cast<double>(impl->options.staging_bytes) / (1 << 20),
        engine::DTypeName(model.kv_dtype()), options.max_batch,
        std::min<int64_t>(model.config().max_context, pool_tokens), pool_tokens);
  } else {
    LogInfo("staging for pushed KV: {:.1f} MiB (--staging-mib)",
            static_cast<double>(impl->options.staging_bytes) / (1 << 20));
  }
  impl->staging = std::make_unique<kvbus::HostTier>(impl->options.staging_bytes);
  impl->store_io = std::make_unique<JobThread>(kStoreLanes);
  impl->lookup_io = std::make_unique<JobThread>(1);
  kvbus::ReceiverOptions ropt;
  ropt.curve = options.curve;
  if (options.kv_transport != kvbus::TransportKind::kTcp) {
    ropt.shm_landing_bytes = options.kv_landing_bytes;
  }
  DecoderOptions dopt;
  if (impl->pool) {
    impl->landing = std::make_unique<SliceLanding>();
    ropt.landing = impl->landing.get();
    ropt.landing_region = impl->pool.get();
    ropt.landing_kind = impl->pool_kind;
    ropt.landing_by_plane = options.kv_transport != kvbus::TransportKind::kTcp;
    dopt.landing = impl->landing.get();
    dopt.landing_quarantine = ropt.lease;
    const kvbus::DeviceOps& ops = impl->pool->ops();
    const bool nccl = options.kv_transport == kvbus::TransportKind::kNccl;
    LogInfo("pushed KV lands in place, in the KV pool's blocks ({:.1f} MiB of {} memory{}{})",
            static_cast<double>(impl->pool->bytes()) / (1 << 20),
            ops.memory_kind() == kvbus::MemoryKind::kDevice ? "device" : "shared host",
            !ropt.landing_by_plane ? "; tcp only"
            : impl->pool_kind == kvbus::RegionKind::kShm
                ? " that prefill workers on this host write by shm"
            : nccl ? " that prefill workers send into over nccl links"
                   : " that prefill workers on this GPU or its peers write by cuda_ipc",
            &ops == &kvbus::HostDeviceOps() && impl->pool_kind == kvbus::RegionKind::kDevice
                ? ", the host backend standing in for a device (KDN_DEVICE_OPS=host)"
                : "");
  }
  dopt.chunk_tokens = options.chunk_tokens;
  dopt.max_batch = options.max_batch;
  dopt.prepare_timeout = options.prepare_timeout;
  dopt.clock = options.clock;
  dopt.events = impl->events.host.get();
  dopt.local_prefill_step_tokens = options.local_prefill_step_tokens;
  dopt.admission_reserve = options.admission_reserve;
  dopt.on_load_done = [raw] {
    {
      std::lock_guard<std::mutex> lock(raw->mu);
      raw->loads_in = true;
    }
    raw->cv.notify_one();
  };
  impl->decoder =
      std::make_unique<Decoder>(*impl->wm.model, *impl->wm.tokenizer, impl->wm.fingerprint,
                                *impl->store, *impl->staging, *impl->store_io, dopt);
  KDN_ASSIGN_OR_RETURN(impl->receiver, kvbus::Listen(options.kvbus_listen, *impl->staging, ropt));
  impl->kvbus_endpoint = impl->receiver->endpoint();
  const DecoderStats s = impl->decoder->Stats();
  impl->total_blocks = s.total_kv_blocks;
  impl->free_blocks = s.free_kv_blocks;
  KDN_ASSIGN_OR_RETURN(
      impl->server, control::ControlServer::Start(
                        options.listen,
                        [raw](control::ControlServer& srv, const std::string& peer,
                              proto::WorkerMessage m) { raw->OnMessage(srv, peer, std::move(m)); },
                        options.curve));
  impl->compute = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<DecodeService>(new DecodeService(std::move(impl)));
}

DecodeService::~DecodeService() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  if (impl_->compute.joinable()) impl_->compute.join();
  // Before the server its lookups answer through; lookups posted after this
  // are dropped (their router times them out).
  (void)impl_->lookup_io->Stop();
  if (const size_t dropped = impl_->store_io->Stop(); dropped > 0) {
    LogWarn("stopping with {} store jobs not run", dropped);
  }
  impl_->server.reset();
  impl_->receiver.reset();
}

const std::string& DecodeService::endpoint() const { return impl_->server->endpoint(); }
const std::string& DecodeService::kvbus_endpoint() const { return impl_->kvbus_endpoint; }
std::string DecodeService::engine_summary() const {
  return worker::EngineSummary(*impl_->wm.model);
}
uint64_t DecodeService::staging_bytes() const { return impl_->options.staging_bytes; }

}  // namespace kdn::decode_worker
