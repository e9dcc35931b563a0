#include "kdn/decode_worker/decode_service.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "kdn/control/control_server.h"
#include "kdn/control/convert.h"
#include "kdn/control/transfer_plan.h"
#include "kdn/control/worker_setup.h"
#include "kdn/decode_worker/batcher.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/transport.h"
#include "kdn/kvbridge/paged_chunks.h"

namespace kdn::decode_worker {

namespace {

using SteadyClock = std::chrono::steady_clock;
constexpr auto kPrepareTimeout = std::chrono::seconds(60);

// A control message for the compute thread.
struct Command {
  std::string peer;
  proto::WorkerMessage msg;
};

// Who asked for a request: replies and token events go back there.
struct Origin {
  std::string peer;
  uint64_t request_id = 0;
};

struct Prepared {
  Origin origin;
  RequestSpec spec;
  std::vector<int32_t> tokens;
  std::string ns;
  std::string transfer_id;
  std::vector<kvbus::ChunkKey> keys;  // the prompt's prefix keys; none when blended
  bool blended = false;               // KV fused by blend: not exact, never stored
  engine::KvSequence seq;
  int held_chunks = 0;
  SteadyClock::time_point created;
};

struct Running {
  Origin origin;
  std::vector<int32_t> tokens;  // the prompt
  std::string ns;
  bool blended = false;
};

}  // namespace

struct DecodeService::Impl {
  // Constant after Start.
  DecodeServiceOptions options;
  control::WorkerModel wm;
  std::unique_ptr<kvbus::TieredStore> store;
  std::unique_ptr<kvbus::HostTier> staging;
  std::unique_ptr<kvbus::Receiver> receiver;
  std::unique_ptr<control::ControlServer> server;
  std::string kvbus_endpoint;
  int total_blocks = 0;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<Command> commands;  // guarded by mu
  bool stop = false;             // guarded by mu
  std::atomic<int> depth{0};     // prepared + running
  std::atomic<int> free_blocks{0};
  std::thread compute;

  // The compute thread's alone.
  std::unique_ptr<Batcher> batcher;
  std::map<std::string, uint64_t> ids;  // "peer/request id" -> internal id
  std::map<uint64_t, Prepared> prepared;
  std::map<uint64_t, Running> running;
  uint64_t next_id = 1;

  static std::string OriginKey(const std::string& peer, uint64_t request_id) {
    return peer + "/" + std::to_string(request_id);
  }

  void FillInfo(proto::WorkerInfo* info) {
    info->set_name(options.name);
    info->set_role("decode");
    info->set_model_fingerprint(control::KeyToBytes(wm.fingerprint));
    info->set_chunk_tokens(options.chunk_tokens);
    info->set_max_context(wm.model->config().max_context);
    info->set_kvbus_endpoint(kvbus_endpoint);
    info->set_queue_depth(depth.load());
    info->set_free_kv_blocks(free_blocks.load());
    info->set_total_kv_blocks(total_blocks);
    if (Status h = receiver->Health(); !h.ok()) {
      control::StatusToProto(h, info->mutable_health());
    }
  }

  // I/O thread: answers what needs no model, queues the rest.
  void OnMessage(control::ControlServer& srv, const std::string& peer, proto::WorkerMessage msg) {
    if (control::AnswerQuery(srv, peer, msg, *store,
                             [this](proto::WorkerInfo* info) { FillInfo(info); })) {
      return;
    }
    switch (msg.body_case()) {
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
        std::fprintf(stderr, "%s: ignoring a message it does not serve (%d)\n",
                     options.name.c_str(), static_cast<int>(msg.body_case()));
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

  Status ValidatePrepare(const proto::PrepareRequest& r) {
    const engine::ModelConfig& c = wm.model->config();
    if (r.tokens().empty()) return InvalidArgument("empty prompt");
    if (static_cast<int64_t>(r.tokens().size()) >= c.max_context) {
      return InvalidArgument("a prompt of " + std::to_string(r.tokens().size()) +
                             " tokens leaves no room in the model's context of " +
                             std::to_string(c.max_context));
    }
    for (int32_t t : r.tokens()) {
      if (t < 0 || t >= c.vocab_size) {
        return InvalidArgument("token id " + std::to_string(t) + " is outside the vocabulary");
      }
    }
    if (r.max_tokens() < 1) return InvalidArgument("max_tokens must be at least 1");
    return engine::ValidateSamplingParams(control::SamplingFromProto(r.sampling()));
  }

  void DoPrepare(const std::string& peer, const proto::WorkerMessage& msg) {
    const proto::PrepareRequest& r = msg.prepare();
    proto::WorkerMessage reply;
    reply.set_request_id(msg.request_id());
    auto* pr = reply.mutable_prepare_reply();
    const std::string okey = OriginKey(peer, msg.request_id());
    Status st = ValidatePrepare(r);
    if (st.ok() && ids.count(okey) != 0) {
      st = InvalidArgument("request " + std::to_string(msg.request_id()) + " is already here");
    }
    Prepared p;
    if (st.ok()) {
      p.origin = {peer, msg.request_id()};
      p.tokens.assign(r.tokens().begin(), r.tokens().end());
      p.ns = r.ns();
      p.transfer_id = r.transfer_id();
      p.blended = r.blended();
      p.spec.sampling = control::SamplingFromProto(r.sampling());
      p.spec.max_tokens = r.max_tokens();
      p.spec.stop_ids.assign(r.stop_ids().begin(), r.stop_ids().end());
      p.spec.stop_strings.assign(r.stop_strings().begin(), r.stop_strings().end());
      p.created = SteadyClock::now();
      engine::KvCache& cache = wm.model->kv_cache();
      p.seq = cache.NewSequence();
      st = cache.Reserve(p.seq, static_cast<int64_t>(p.tokens.size()));
    }
    if (st.ok()) {
      // The chunks this worker's tiers hold need not travel; a blended
      // prompt's KV all comes from its prefill.
      engine::KvCache& cache = wm.model->kv_cache();
      if (!p.blended) {
        p.keys = kvbus::PrefixKeys({wm.fingerprint, p.ns, options.chunk_tokens}, p.tokens);
      }
      for (const kvbus::ChunkKey& key : p.keys) {
        auto chunk = store->Get(key);
        if (!chunk.ok() || !control::ChunkFits(**chunk, wm.fingerprint, options.chunk_tokens) ||
            !kvbridge::ChunkToPagedKv(**chunk, cache, p.seq,
                                   static_cast<int64_t>(p.held_chunks) * options.chunk_tokens)
                 .ok()) {
          break;
        }
        ++p.held_chunks;
      }
      pr->set_held_chunks(p.held_chunks);
      const uint64_t id = next_id++;
      p.spec.id = id;
      ids[okey] = id;
      prepared.emplace(id, std::move(p));
      ++depth;
    } else {
      control::StatusToProto(st, pr->mutable_error());
    }
    server->Send(peer, reply);
  }

  // Writes the pushed slices into the prepared sequence.
  Status Assemble(Prepared& p) {
    engine::KvCache& cache = wm.model->kv_cache();
    const auto regions =
        control::TransferRegions(p.keys, static_cast<int64_t>(p.tokens.size()),
                                 options.chunk_tokens, p.held_chunks, p.transfer_id);
    for (const control::KvRegion& r : regions) {
      for (int l = 0; l < cache.num_layers(); ++l) {
        const kvbus::ChunkKey key = kvbus::LayerSliceKey(r.parent, l);
        auto slice = staging->Get(key);
        if (!slice.ok()) {
          return Unavailable("layer " + std::to_string(l) + " of the KV of tokens [" +
                             std::to_string(r.first) + ", " + std::to_string(r.first + r.count) +
                             ") never arrived");
        }
        if ((*slice)->info().tokens != static_cast<uint32_t>(r.count)) {
          return Corruption("KV slice " + key.ToHex() + " has " +
                            std::to_string((*slice)->info().tokens) + " tokens, expected " +
                            std::to_string(r.count));
        }
        KDN_RETURN_IF_ERROR(kvbridge::LayerSliceToPagedKv(**slice, l, cache, p.seq, r.first));
        if (r.tail) staging->Erase(key);  // named for this request alone
      }
    }
    cache.SetLength(p.seq, static_cast<int64_t>(p.tokens.size()));
    return Status::Ok();
  }

  void DoStart(const std::string& peer, const proto::WorkerMessage& msg) {
    const Origin origin{peer, msg.request_id()};
    auto idit = ids.find(OriginKey(peer, msg.request_id()));
    auto pit = idit == ids.end() ? prepared.end() : prepared.find(idit->second);
    if (pit == prepared.end()) {
      SendError(origin, NotFound("request " + std::to_string(msg.request_id()) +
                                 " was not prepared here (or expired)"));
      return;
    }
    Prepared p = std::move(pit->second);
    prepared.erase(pit);
    p.spec.first_token_sent = msg.start().first_token_sent();
    Status st = Assemble(p);
    std::vector<TokenEvent> events;
    if (st.ok()) {
      running[p.spec.id] = Running{p.origin, p.tokens, p.ns, p.blended};
      st = batcher->Admit(p.spec, std::move(p.seq), msg.start().first_token(), &events);
      if (!st.ok()) running.erase(p.spec.id);
    }
    if (!st.ok()) {
      std::fprintf(stderr, "%s: request %llu cannot start: %s\n", options.name.c_str(),
                   static_cast<unsigned long long>(msg.request_id()), st.ToString().c_str());
      ids.erase(idit);
      --depth;
      SendError(origin, st);
      return;
    }
    Deliver(events);
  }

  // Erases from staging the slices named for this request alone (the
  // partial tail; a blended prompt's whole KV), which only Assemble would
  // otherwise have taken.
  void DropOwnSlices(const Prepared& p) {
    const auto regions =
        control::TransferRegions(p.keys, static_cast<int64_t>(p.tokens.size()),
                                 options.chunk_tokens, p.held_chunks, p.transfer_id);
    for (const control::KvRegion& r : regions) {
      if (!r.tail) continue;
      for (int l = 0; l < wm.model->kv_cache().num_layers(); ++l) {
        staging->Erase(kvbus::LayerSliceKey(r.parent, l));
      }
    }
  }

  void DoCancel(const std::string& peer, const proto::WorkerMessage& msg) {
    auto idit = ids.find(OriginKey(peer, msg.request_id()));
    if (idit == ids.end()) return;
    const uint64_t id = idit->second;
    if (auto pit = prepared.find(id); pit != prepared.end()) {
      // Never started (the first token ended it, or its client went away):
      // its reserved KV goes back with the sequence.
      DropOwnSlices(pit->second);
      prepared.erase(pit);
      ids.erase(idit);
      --depth;
      return;
    }
    std::vector<TokenEvent> events;
    if (batcher->Cancel(id, &events).ok()) Deliver(events);
  }

  // Sends events to their routers, one message per request; finished
  // requests leave.
  void Deliver(const std::vector<TokenEvent>& events) {
    std::map<uint64_t, std::vector<const TokenEvent*>> by_id;
    for (const TokenEvent& e : events) by_id[e.id].push_back(&e);
    for (const auto& [id, evs] : by_id) {
      auto it = running.find(id);
      if (it == running.end()) continue;
      proto::WorkerMessage m;
      m.set_request_id(it->second.origin.request_id);
      for (const TokenEvent* ev : evs) {
        auto* e = m.mutable_tokens()->add_events();
        e->set_token(ev->token);
        e->set_text(ev->text);
        e->set_finished(ev->finished);
        e->set_finish_reason(ev->finish_reason);
      }
      server->Send(it->second.origin.peer, m);
      if (evs.back()->finished) {
        ids.erase(OriginKey(it->second.origin.peer, it->second.origin.request_id));
        running.erase(it);
        --depth;
      }
    }
  }

  // Stores the full chunks of prompt + output (all but the last token, whose
  // KV was never computed) that the tiers lack.
  void StoreConversation(uint64_t id, const engine::KvSequence& seq,
                         const std::vector<int32_t>& generated) {
    auto it = running.find(id);
    // Blended KV differs from what a full prefill gives: never under prefix keys.
    if (it == running.end() || it->second.blended) return;
    std::vector<int32_t> tokens = it->second.tokens;
    tokens.insert(tokens.end(), generated.begin(), generated.end());
    tokens.resize(std::min<size_t>(tokens.size(), static_cast<size_t>(seq.length())));
    const kvbus::KeyContext ctx{wm.fingerprint, it->second.ns, options.chunk_tokens};
    const std::vector<kvbus::ChunkKey> keys = kvbus::PrefixKeys(ctx, tokens);
    for (size_t i = 0; i < keys.size(); ++i) {
      if (store->Contains(keys[i])) continue;
      auto chunk = kvbridge::ChunkFromPagedKv(wm.model->kv_cache(), seq,
                                           static_cast<int64_t>(i) * options.chunk_tokens,
                                           options.chunk_tokens, keys[i], wm.fingerprint,
                                           kvbus::KvDType::kF32);
      Status st = chunk.ok() ? store->Put(*std::move(chunk)) : chunk.status();
      if (!st.ok()) {
        std::fprintf(stderr, "%s: storing a chunk: %s\n", options.name.c_str(),
                     st.ToString().c_str());
        break;
      }
    }
  }

  void Loop();
};

void DecodeService::Impl::Loop() {
  batcher = std::make_unique<Batcher>(*wm.model, *wm.tokenizer, options.max_batch);
  batcher->SetFinishHook([this](uint64_t id, const engine::KvSequence& seq,
                                const std::vector<int32_t>& generated) {
    StoreConversation(id, seq, generated);
  });
  auto last_sweep = SteadyClock::now();
  for (;;) {
    std::deque<Command> todo;
    {
      std::unique_lock<std::mutex> lock(mu);
      if (batcher->running() == 0) {
        cv.wait_for(lock, std::chrono::seconds(1), [&] { return stop || !commands.empty(); });
      }
      if (stop) return;
      todo.swap(commands);
    }
    for (Command& c : todo) {
      switch (c.msg.body_case()) {
        case proto::WorkerMessage::kPrepare: DoPrepare(c.peer, c.msg); break;
        case proto::WorkerMessage::kStart: DoStart(c.peer, c.msg); break;
        case proto::WorkerMessage::kCancel: DoCancel(c.peer, c.msg); break;
        default: break;
      }
    }
    if (batcher->running() > 0) {
      std::vector<TokenEvent> events;
      Status st = batcher->Step(&events);
      if (!st.ok()) {
        // The model refused the whole step (e.g. no free KV block): fail
        // every running request rather than spin.
        std::fprintf(stderr, "%s: decode step failed: %s\n", options.name.c_str(),
                     st.ToString().c_str());
        std::vector<uint64_t> all;
        for (const auto& [id, r] : running) all.push_back(id);
        for (uint64_t id : all) {
          const Origin o = running[id].origin;
          std::vector<TokenEvent> ignored;
          (void)batcher->Cancel(id, &ignored);
          SendError(o, st);
          ids.erase(OriginKey(o.peer, o.request_id));
          running.erase(id);
          --depth;
        }
      } else {
        Deliver(events);
      }
    }
    const auto now = SteadyClock::now();
    if (now - last_sweep > std::chrono::seconds(1)) {
      last_sweep = now;
      for (auto it = prepared.begin(); it != prepared.end();) {
        if (now - it->second.created > kPrepareTimeout) {
          std::fprintf(stderr, "%s: request %llu was prepared but never started; dropped\n",
                       options.name.c_str(),
                       static_cast<unsigned long long>(it->second.origin.request_id));
          ids.erase(OriginKey(it->second.origin.peer, it->second.origin.request_id));
          DropOwnSlices(it->second);
          it = prepared.erase(it);
          --depth;
        } else {
          ++it;
        }
      }
    }
    free_blocks = wm.model->kv_cache().free_blocks();
  }
}

DecodeService::DecodeService(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<DecodeService>> DecodeService::Start(const DecodeServiceOptions& options) {
  if (options.chunk_tokens <= 0) return InvalidArgument("--chunk-tokens must be positive");
  if (options.max_batch <= 0) return InvalidArgument("--max-batch must be positive");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  engine::EngineOptions eo;
  eo.kv_tokens = options.kv_tokens;
  eo.threads = options.threads;
  KDN_ASSIGN_OR_RETURN(impl->wm, control::LoadWorkerModel(options.model_dir, eo));
  KDN_ASSIGN_OR_RETURN(impl->store,
                       control::MakeWorkerStore(options.host_bytes, options.store_endpoint));
  impl->staging = std::make_unique<kvbus::HostTier>(options.staging_bytes);
  KDN_ASSIGN_OR_RETURN(impl->receiver, kvbus::ListenTcp(options.kvbus_listen, *impl->staging));
  impl->kvbus_endpoint = impl->receiver->endpoint();
  impl->total_blocks = impl->wm.model->kv_cache().num_blocks();
  impl->free_blocks = impl->wm.model->kv_cache().free_blocks();
  Impl* raw = impl.get();
  KDN_ASSIGN_OR_RETURN(impl->server,
                       control::ControlServer::Start(
                           options.listen, [raw](control::ControlServer& srv,
                                                 const std::string& peer, proto::WorkerMessage m) {
                             raw->OnMessage(srv, peer, std::move(m));
                           }));
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
  impl_->server.reset();
  impl_->receiver.reset();
}

const std::string& DecodeService::endpoint() const { return impl_->server->endpoint(); }
const std::string& DecodeService::kvbus_endpoint() const { return impl_->kvbus_endpoint; }

}  // namespace kdn::decode_worker
