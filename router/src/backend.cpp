#include "kdn/router/backend.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <zmq.hpp>

#include "kdn/common/log.h"
#include "kdn/control/control_server.h"
#include "kdn/control/convert.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/zmq_check.h"
#include "kdn/kvbus/zmq_curve.h"
#include "kdn/text/output_text.h"
#include "serving.pb.h"

namespace kdn::router {

namespace {

using Clock = std::chrono::steady_clock;

enum class Phase { kLookup, kQueued, kPrepare, kPrefill, kDecode };

struct Worker {
  WorkerView view;
  std::unique_ptr<zmq::socket_t> sock;
  // ZeroMQ's monitor of sock (a PAIR on its inproc endpoint): tells at once
  // when the worker's connection closes, so that a process that is gone is
  // down in milliseconds, not after worker_timeout of silence.
  std::unique_ptr<zmq::socket_t> monitor;
  Clock::time_point last_heard{};
  Clock::time_point last_ping{};
  bool heard = false;
  kvbus::ChunkKey fingerprint;
  int chunk_tokens = 0;
  std::string kvbus_endpoint;
};

struct Request {
  uint64_t id = 0;
  Job job;
  JobCallback cb;
  Phase phase = Phase::kLookup;
  std::vector<kvbus::ChunkKey> keys;
  // worker -> leading prompt tokens whose KV it reaches (-1: no answer)
  std::map<size_t, int64_t> prefix;
  std::vector<kvbus::ChunkKey> segment_keys;  // a blend request's documents
  std::map<size_t, int64_t> segment_tokens_held;  // worker -> document tokens it holds
  int lookups_pending = 0;
  Clock::time_point arrival, deadline, last_token;
  Clock::time_point queued_at;  // when it last began to wait (kQueued)
  size_t p = 0, d = 0;
  bool prefill_sent = false;
  bool first_token_seen = false;
  int64_t decode_held_tokens = 0;  // from the decode worker's PrepareReply
  int prefill_retries = 0;         // prefill workers lost before the first token
  std::string transfer_id;
  Usage usage;
  // Every token sent to the client so far, the first included.
  std::vector<int32_t> generated;
  // Decode workers lost (docs/serving.md, "A decode worker lost"), each
  // once: never chosen again for it, as what they may still send is about
  // a request that has moved on.
  std::set<size_t> lost_decode;
  // Of job.tokens, the last resumed_tokens are generated ones, carried into
  // its prompt by the last resume.
  int64_t resumed_tokens = 0;

  // Times it was resumed: once per decode worker lost.
  int Resumes() const { return static_cast<int>(lost_decode.size()); }

  int64_t PromptTokens() const {
    return static_cast<int64_t>(job.tokens.size()) - resumed_tokens;
  }
};

struct Command {
  enum class Kind { kSubmit, kInject, kCancel } kind;
  uint64_t id = 0;
  Job job;
  InjectJob inject;
  JobCallback cb;
  Clock::time_point arrival;
};

struct Injection {
  InjectJob job;
  JobCallback cb;
  std::deque<size_t> todo;  // documents not yet sent (or to send again)
  int in_flight = 0;
  InjectProgress progress;
};

// One document of an injection at one prefill worker.
struct InjectPart {
  uint64_t injection = 0;
  size_t document = 0;
  size_t worker = 0;
};

// Documents in flight per prefill worker: enough to keep it busy, few enough
// that progress means something and other requests are not queued behind a
// whole batch.
constexpr int kInjectPerWorker = 2;

}  // namespace

struct Backend::Impl {
  BackendOptions options;
  const text::Tokenizer* tokenizer = nullptr;
  Metrics* metrics = nullptr;
  zmq::context_t ctx{1};
  uint64_t nonce = 0;

  std::mutex mu;  // guards commands, wake, next_id, snapshot
  std::deque<Command> commands;
  zmq::socket_t wake{ctx, zmq::socket_type::push};
  uint64_t next_id = 1;
  std::vector<WorkerView> snapshot;

  std::atomic<bool> stop{false};
  std::thread thread;

  // The backend thread's alone.
  zmq::socket_t inbox{ctx, zmq::socket_type::pull};
  std::vector<Worker> workers;
  std::map<uint64_t, Request> requests;
  // Requests in kQueued, oldest first (ids of requests gone meanwhile are
  // skipped when met).
  std::deque<uint64_t> queued;
  std::map<uint64_t, Injection> injections;
  std::map<uint64_t, InjectPart> inject_parts;  // by message id
  uint64_t next_part_id = uint64_t{1} << 62;    // apart from the jobs' ids
  bool have_identity = false;
  kvbus::ChunkKey fingerprint;
  int chunk_tokens = 0;
  // Failures that can repeat on every turn of the loop.
  LogLimiter send_errors, bad_messages, loop_errors;

  double MsSince(Clock::time_point t) const {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  }

  void Send(size_t w, uint64_t request_id, proto::WorkerMessage& m) {
    m.set_request_id(request_id);
    std::string body = m.SerializeAsString();
    try {
      // Never block the loop: a worker that stopped reading is found out by
      // its silence.
      (void)workers[w].sock->send(zmq::buffer(body), zmq::send_flags::dontwait);
    } catch (const zmq::error_t& e) {
      send_errors.Error("{} sending to {}: {}", ReqId{request_id}, workers[w].view.name, e.what());
    }
  }

  bool Usable(size_t w, const char* role) const {
    const Worker& wk = workers[w];
    return wk.view.role == role && wk.view.up && wk.view.compatible;
  }

  // Tells worker `w` to let request `id` go.
  void SendCancel(size_t w, uint64_t id) {
    proto::WorkerMessage cancel;
    cancel.mutable_cancel();
    Send(w, id, cancel);
  }

  void Fail(uint64_t id, const Status& st) {
    auto it = requests.find(id);
    if (it == requests.end()) return;
    Request& r = it->second;
    // Tell the workers involved to let go.
    if (r.phase != Phase::kLookup && r.phase != Phase::kQueued) SendCancel(r.d, r.id);
    if (r.prefill_sent && r.phase == Phase::kPrefill) SendCancel(r.p, r.id);
    JobEvent ev;
    ev.kind = JobEvent::Kind::kError;
    ev.error = st;
    JobCallback cb = std::move(r.cb);
    requests.erase(it);
    cb(std::move(ev));
  }

  // Ends request `it` with `ev` (its last text and tokens, finish_reason).
  void Finish(std::map<uint64_t, Request>::iterator it, JobEvent ev) {
    ev.kind = JobEvent::Kind::kDone;
    ev.usage = it->second.usage;
    JobCallback cb = std::move(it->second.cb);
    requests.erase(it);
    cb(std::move(ev));
  }

  // One token of `r` goes to its client now: the time to the first token,
  // or since the one before.
  void TokenOut(Request& r) {
    const auto now = Clock::now();
    if (metrics) {
      if (!r.first_token_seen) {
        metrics->Ttft(std::chrono::duration<double>(now - r.arrival).count());
      } else {
        metrics->InterToken(std::chrono::duration<double>(now - r.last_token).count());
      }
    }
    r.first_token_seen = true;
    r.last_token = now;
  }

  void UpdateSnapshot() {
    std::vector<WorkerView> v;
    for (const Worker& w : workers) v.push_back(w.view);
    std::lock_guard<std::mutex> lock(mu);
    snapshot = std::move(v);
  }

  void TakeInfo(size_t w, const proto::WorkerInfo& info) {
    Worker& wk = workers[w];
    if (!info.name().empty()) wk.view.name = info.name();
    wk.view.queue_depth = info.queue_depth();
    wk.view.max_batch = info.max_batch();
    wk.view.queue_tokens = info.queue_tokens();
    wk.view.free_kv_blocks = info.free_kv_blocks();
    wk.view.total_kv_blocks = info.total_kv_blocks();
    wk.view.max_context = info.max_context();
    wk.view.health = info.health().code() != 0 ? info.health().message() : "";
    wk.view.host_id = info.host_id();
    wk.view.kv_transport = info.kv_transport();
    wk.view.kv_transports.clear();
    for (const proto::TransportCounters& t : info.kv_transports()) {
      wk.view.kv_transports.push_back({t.transport(), t.chunks(), t.bytes(), t.seconds()});
    }
    const proto::KvCodecCounters& kc = info.kv_codec();
    wk.view.kv_codec = {kc.encoded_chunks(), kc.raw_bytes(), kc.encoded_bytes(),
                        kc.decoded_chunks(), kc.decode_errors()};
    wk.view.store_unreachable = info.store_unreachable();
    wk.view.leased_kv_blocks = info.leased_kv_blocks();
    wk.view.kvbus_leased_bytes = info.kvbus_leased_bytes();
    if (info.role() != wk.view.role) {
      if (wk.view.compatible) {
        LogError("{} is a {} worker, not {}; not using it", wk.view.endpoint, info.role(),
                 wk.view.role);
      }
      wk.view.compatible = false;
      return;
    }
    if (!info.kvbus_endpoint().empty()) wk.kvbus_endpoint = info.kvbus_endpoint();
    auto fp = control::KeyFromBytes(info.model_fingerprint());
    if (!fp.ok()) return;
    if (!have_identity) {
      have_identity = true;
      fingerprint = *fp;
      chunk_tokens = info.chunk_tokens();
      LogInfo("model {}, chunks of {} tokens (from {})", fingerprint.ToHex(), chunk_tokens,
              wk.view.name);
    }
    const bool ok = *fp == fingerprint && info.chunk_tokens() == chunk_tokens;
    if (!ok && wk.view.compatible) {
      LogError("{} serves another model or chunk size ({}, {}) than the others ({}, {}); not "
               "using it",
               wk.view.name, fp->ToHex(), info.chunk_tokens(), fingerprint.ToHex(), chunk_tokens);
    }
    wk.view.compatible = ok;
  }

  void OnSubmit(Command& c) {
    Request r;
    r.id = c.id;
    r.job = std::move(c.job);
    r.cb = std::move(c.cb);
    r.arrival = c.arrival;
    requests.emplace(r.id, std::move(r));
    Request& req = requests[c.id];
    if (LogEnabled(LogLevel::kInfo)) {
      std::string blend;
      if (req.job.blend) {
        blend = fmt::format(", {} documents", req.job.blend->segment_tokens.size());
      }
      LogInfo("{} accepted {}: {} prompt tokens, max_tokens {}{}", ReqId{req.id},
              req.job.route.empty() ? "a job" : req.job.route, req.job.tokens.size(),
              req.job.max_tokens, blend);
    }
    if (Status st = StartLookup(req); !st.ok()) Fail(req.id, st);
  }

  // Asks every live worker how much of `req`'s prompt it reaches (phase
  // kLookup); Choose takes it on once they have answered. UNAVAILABLE, with
  // nothing sent, when no worker of a role is up.
  Status StartLookup(Request& req) {
    if (!have_identity) return Unavailable("no worker has answered yet");
    bool any_p = false, any_d = false;
    for (size_t w = 0; w < workers.size(); ++w) {
      any_p |= Usable(w, "prefill");
      any_d |= Usable(w, "decode") && req.lost_decode.count(w) == 0;
    }
    if (!any_p || !any_d) {
      return Unavailable(std::string("no ") + (any_p ? "decode" : "prefill") + " worker is up");
    }
    const kvbus::KeyContext kctx{fingerprint, req.job.ns, chunk_tokens};
    req.keys = kvbus::PrefixKeys(kctx, req.job.tokens);
    req.segment_keys.clear();
    if (req.job.blend) {
      const int32_t* t = req.job.tokens.data() + req.job.blend->head_tokens;
      for (int len : req.job.blend->segment_tokens) {
        req.segment_keys.push_back(kvbus::SegmentKey(kctx, {t, static_cast<size_t>(len)}));
        t += len;
      }
    }
    // Unique per request and per sending: a resumed request's late replies
    // and slices from before are told apart.
    const uint64_t salt = nonce ^ (static_cast<uint64_t>(req.Resumes()) << 56);
    uint8_t tid[16];
    for (int i = 0; i < 8; ++i) {
      tid[i] = static_cast<uint8_t>(salt >> (8 * i));
      tid[8 + i] = static_cast<uint8_t>(req.id >> (8 * i));
    }
    req.transfer_id.assign(reinterpret_cast<const char*>(tid), 16);
    proto::WorkerMessage m;
    auto* lk = m.mutable_lookup();
    lk->set_ns(req.job.ns);
    for (const kvbus::ChunkKey& k : req.keys) lk->add_keys(control::KeyToBytes(k));
    if (!req.job.blend) {
      // For the tail step of the prefix match (docs/kvbus.md, "Tail keys").
      lk->mutable_tokens()->Add(req.job.tokens.begin(), req.job.tokens.end());
    }
    for (const kvbus::ChunkKey& k : req.segment_keys) {
      lk->add_segment_keys(control::KeyToBytes(k));
    }
    req.prefix.clear();
    req.segment_tokens_held.clear();
    req.lookups_pending = 0;
    for (size_t w = 0; w < workers.size(); ++w) {
      if (!Usable(w, "prefill") && !Usable(w, "decode")) continue;
      if (req.lost_decode.count(w) != 0) continue;
      req.prefix[w] = -1;
      ++req.lookups_pending;
      Send(w, req.id, m);
    }
    req.phase = Phase::kLookup;
    req.deadline = Clock::now() + options.lookup_timeout;
    return Status::Ok();
  }

  // Whether decode worker `w` has room for `r`: KV for prompt + max_tokens
  // and a place in its batch, as it last reported (less what was sent to it
  // since).
  bool HasRoom(size_t w, const Request& r) const {
    const WorkerView& v = workers[w].view;
    return v.free_kv_blocks >= NeedBlocks(r) && (v.max_batch <= 0 || v.queue_depth < v.max_batch);
  }

  // The KV blocks (16 tokens each) a decode worker reserves for `r`: its
  // prompt and max_tokens.
  static int64_t NeedBlocks(const Request& r) {
    return (r.PromptTokens() + r.job.max_tokens + 15) / 16;
  }

  // Request `r` waits for a decode worker with room (or is refused when the
  // queue is full). `front`: it had its turn and goes back to the head.
  void Park(Request& r, bool front) {
    if (!front && static_cast<int>(queued.size()) >= options.max_queued) {
      Fail(r.id, ResourceExhausted("every decode worker is full and " +
                                   std::to_string(queued.size()) +
                                   " requests already wait (--max-queued)"));
      return;
    }
    if (r.phase != Phase::kQueued) {
      r.queued_at = Clock::now();
      r.deadline = r.queued_at + options.queue_timeout;
      LogDebug("{} queued: no decode worker has room for {} + {} tokens; {} waiting", ReqId{r.id},
               r.job.tokens.size(), r.job.max_tokens, queued.size() + 1);
    }
    r.phase = Phase::kQueued;
    if (front) {
      queued.push_front(r.id);
    } else {
      queued.push_back(r.id);
    }
  }

  // Gives waiting requests, oldest first, to decode workers with room; stops
  // at the first that still finds none (arrival order is kept).
  void DrainQueue() {
    while (!queued.empty()) {
      auto it = requests.find(queued.front());
      if (it == requests.end() || it->second.phase != Phase::kQueued) {
        queued.pop_front();
        continue;
      }
      Request& r = it->second;
      bool room = false;
      for (const auto& [w, held] : r.prefix) room |= held >= 0 && Usable(w, "decode") && HasRoom(w, r);
      if (!room) break;
      queued.pop_front();
      if (metrics) {
        metrics->QueueWait(std::chrono::duration<double>(Clock::now() - r.queued_at).count());
      }
      Choose(r);
    }
  }

  void Choose(Request& r) {
    const auto n = static_cast<int64_t>(r.job.tokens.size());
    int64_t best_cost = INT64_MAX;
    bool have_p = false, have_d = false;
    for (const auto& [w, held_tokens] : r.prefix) {
      if (held_tokens < 0 || !Usable(w, "prefill")) continue;
      int64_t cost = 0;
      if (r.job.blend) {
        // Held documents cost their recomputed share; the rest is computed.
        const double held = static_cast<double>(r.segment_tokens_held[w]);
        cost = n - static_cast<int64_t>(held * (1.0 - r.job.blend->recompute_ratio));
      } else {
        cost = n - std::min<int64_t>(held_tokens, n - 1);  // the last token is computed
      }
      cost += workers[w].view.queue_tokens;
      if (cost < best_cost) {
        best_cost = cost;
        r.p = w;
        have_p = true;
      }
    }
    // Decode: the worker holding most of the conversation, then the least
    // busy; only workers with room for the whole request.
    const int64_t need_blocks = NeedBlocks(r);
    int64_t best_prefix = -1;
    int best_depth = INT32_MAX;
    bool up_d = false, any_d = false;
    for (auto [w, held_tokens] : r.prefix) {
      if (held_tokens < 0 || !Usable(w, "decode")) continue;
      const WorkerView& v = workers[w].view;
      up_d = true;
      // A worker that could never hold it is no reason to wait.
      any_d |= v.total_kv_blocks <= 0 || v.total_kv_blocks >= need_blocks;
      if (!HasRoom(w, r)) continue;
      if (r.job.blend) held_tokens = 0;  // a blended prompt reuses nothing it holds
      if (held_tokens > best_prefix ||
          (held_tokens == best_prefix && v.queue_depth < best_depth)) {
        best_prefix = held_tokens;
        best_depth = v.queue_depth;
        r.d = w;
        have_d = true;
      }
    }
    if (!have_p) {
      Fail(r.id, Unavailable("no prefill worker answered"));
      return;
    }
    if (!have_d) {
      if (!up_d) {
        Fail(r.id, Unavailable("no decode worker is up"));
      } else if (any_d) {
        // A resumed request was admitted before: it waits ahead of the new.
        Park(r, /*front=*/r.Resumes() > 0);
      } else {
        Fail(r.id, InvalidArgument("no decode worker can hold " +
                                   std::to_string(r.PromptTokens()) + " + " +
                                   std::to_string(r.job.max_tokens) + " tokens of KV"));
      }
      return;
    }
    proto::WorkerMessage m;
    auto* pr = m.mutable_prepare();
    for (int32_t t : r.job.tokens) pr->add_tokens(t);
    pr->set_ns(r.job.ns);
    control::SamplingToProto(r.job.sampling, pr->mutable_sampling());
    pr->set_max_tokens(r.job.max_tokens);
    for (int32_t s : r.job.stop_ids) pr->add_stop_ids(s);
    for (const std::string& s : r.job.stop_strings) pr->add_stop_strings(s);
    pr->set_transfer_id(r.transfer_id);
    pr->set_blended(r.job.blend.has_value());
    pr->set_generated_tokens(static_cast<int32_t>(r.resumed_tokens));
    // Before the prepare goes out, so that the line comes before the decode
    // worker's about it.
    LogInfo("{} routed: prefill {} (reaches {} tokens), decode {} (holds {} tokens)",
            ReqId{r.id}, workers[r.p].view.name, r.prefix[r.p], workers[r.d].view.name,
            r.job.blend ? 0 : r.prefix[r.d]);
    Send(r.d, r.id, m);
    // Count the request against the worker until it next reports.
    ++workers[r.d].view.queue_depth;
    workers[r.d].view.free_kv_blocks -= static_cast<int>(need_blocks);
    workers[r.p].view.queue_tokens += n;
    r.phase = Phase::kPrepare;
    r.deadline = Clock::now() + options.prepare_timeout;
  }

  void OnMessage(size_t w, const proto::WorkerMessage& m) {
    if (m.body_case() == proto::WorkerMessage::kInfo) {
      TakeInfo(w, m.info());
      DrainQueue();
      return;
    }
    if (m.body_case() == proto::WorkerMessage::kInjectReply) {
      OnInjectReply(w, m);
      return;
    }
    auto it = requests.find(m.request_id());
    if (it == requests.end()) return;  // finished or cancelled meanwhile
    Request& r = it->second;
    switch (m.body_case()) {
      case proto::WorkerMessage::kLookupReply: {
        TakeInfo(w, m.lookup_reply().info());
        auto pit = r.prefix.find(w);
        if (r.phase != Phase::kLookup || pit == r.prefix.end() || pit->second >= 0) return;
        pit->second = std::max(0, m.lookup_reply().prefix_tokens());
        if (r.job.blend) {
          int64_t held = 0;
          const auto& flags = m.lookup_reply().segments_held();
          for (int i = 0; i < flags.size() && i < static_cast<int>(r.segment_keys.size()); ++i) {
            if (flags[i]) held += r.job.blend->segment_tokens[i];
          }
          r.segment_tokens_held[w] = held;
        }
        if (--r.lookups_pending == 0) Choose(r);
        return;
      }
      case proto::WorkerMessage::kPrepareReply: {
        if (r.phase != Phase::kPrepare || w != r.d) return;
        Status st = control::StatusFromProto(m.prepare_reply().error());
        if (st.code() == StatusCode::kResourceExhausted) {
          // Full after all (the view was stale): back to the head of the
          // queue, no prefill spent.
          LogDebug("{} {} is full: {}; queued again", ReqId{r.id}, workers[w].view.name,
                   st.message());
          workers[w].view.free_kv_blocks = 0;
          Park(r, /*front=*/true);
          return;
        }
        if (!st.ok()) {
          Fail(r.id, st.WithContext(workers[w].view.name));
          return;
        }
        if (workers[r.d].kvbus_endpoint.empty()) {
          Fail(r.id, Unavailable(workers[r.d].view.name + " has not said where it takes KV"));
          return;
        }
        r.decode_held_tokens = m.prepare_reply().held_tokens();
        LogDebug("{} prepared: {} holds {} prompt tokens; prefill to {}", ReqId{r.id},
                 workers[r.d].view.name, r.decode_held_tokens, workers[r.p].view.name);
        SendPrefill(r);
        return;
      }
      case proto::WorkerMessage::kPrefillReply: {
        if (r.phase != Phase::kPrefill || w != r.p) return;
        const proto::PrefillReply& pr = m.prefill_reply();
        // A reply to an earlier sending of a resumed request (a worker
        // before this echo sends none).
        if (!pr.transfer_id().empty() && pr.transfer_id() != r.transfer_id) return;
        Status st = control::StatusFromProto(pr.error());
        if (!st.ok()) {
          Fail(r.id, st.WithContext(workers[w].view.name));
          return;
        }
        // A resumed request's prefill carries on a stream its client has;
        // the figures of its prompt are its first prefill's.
        const bool resumed = !r.generated.empty();
        LogInfo("{} prefill done by {}{}: {} cached ({} from tail pieces, {} blended, {} of them "
                "recomputed), {} computed, {} bytes of KV sent, {} slices skipped, {} token after "
                "{:.1f} ms",
                ReqId{r.id}, workers[w].view.name, resumed ? " (resumed)" : "", pr.cached_tokens(),
                pr.tail_tokens(), pr.blended_tokens(), pr.recomputed_tokens(),
                pr.computed_tokens(), pr.kv_bytes_sent(), pr.slices_skipped(),
                resumed ? "next" : "first", MsSince(r.arrival));
        if (!resumed) {
          r.usage.prompt_tokens = static_cast<int>(r.job.tokens.size());
          r.usage.cached_tokens = pr.cached_tokens();
          r.usage.blended = r.job.blend.has_value();
          r.usage.blended_tokens = pr.blended_tokens();
          r.usage.recomputed_tokens = pr.recomputed_tokens();
        }
        if (metrics) {
          if (!resumed) {
            metrics->PromptTokens(pr.cached_tokens() - pr.blended_tokens(),
                                  pr.blended_tokens() - pr.recomputed_tokens(),
                                  pr.recomputed_tokens(), pr.computed_tokens(), pr.tail_tokens());
          }
          metrics->KvMoved(pr.kv_bytes_sent(), pr.slices_skipped());
        }
        // Step 5: the first token goes to the client now, shown by the
        // decode worker's own rules (text::OutputText: stop strings, partial
        // characters), so that its text and the decode worker's from the
        // second token on join up. A resumed request's token follows the
        // ones its client has, replayed first.
        text::OutputText output(*tokenizer,
                                {r.job.max_tokens, r.job.stop_ids, r.job.stop_strings});
        const int64_t max_context = workers[r.d].view.max_context;
        if (!output.Replay(r.generated, r.PromptTokens(), max_context)) {
          Fail(r.id, Internal("resumed after the tokens that end it"));
          return;
        }
        text::TextDelta first = output.Add(pr.first_token(),
                                           static_cast<int64_t>(r.job.tokens.size()), max_context);
        TokenOut(r);
        r.generated.push_back(pr.first_token());
        r.usage.completion_tokens = static_cast<int>(r.generated.size());
        if (metrics) metrics->GeneratedTokens(1);
        JobEvent ev;
        ev.tokens = 1;
        ev.text = std::move(first.text);
        if (first.finished) {
          // Nothing left to decode: the decode worker frees what it holds.
          SendCancel(r.d, r.id);
          ev.finish_reason = first.finish_reason;
          Finish(it, std::move(ev));
          return;
        }
        r.cb(std::move(ev));
        proto::WorkerMessage sm;
        sm.mutable_start()->set_first_token(pr.first_token());
        sm.mutable_start()->set_first_token_sent(true);
        Send(r.d, r.id, sm);
        r.phase = Phase::kDecode;
        return;
      }
      case proto::WorkerMessage::kTokens: {
        if (w != r.d || (r.phase != Phase::kDecode && r.phase != Phase::kPrepare)) return;
        JobEvent ev;
        bool finished = false;
        for (const proto::TokenEvent& e : m.tokens().events()) {
          Status st = control::StatusFromProto(e.error());
          if (!st.ok()) {
            Fail(r.id, st.WithContext(workers[w].view.name));
            return;
          }
          if (e.token() >= 0) {
            TokenOut(r);
            r.generated.push_back(e.token());
            ++ev.tokens;
          }
          ev.text += e.text();
          if (e.finished()) {
            finished = true;
            ev.finish_reason = e.finish_reason();
          }
        }
        r.usage.completion_tokens += ev.tokens;
        if (metrics) metrics->GeneratedTokens(ev.tokens);
        if (finished) {
          Finish(it, std::move(ev));
        } else if (ev.tokens > 0 || !ev.text.empty()) {
          r.cb(std::move(ev));
        }
        return;
      }
      default:
        return;
    }
  }

  void OnInject(Command& c) {
    Injection inj;
    inj.job = std::move(c.inject);
    inj.cb = std::move(c.cb);
    inj.progress.total = static_cast<int>(inj.job.documents.size());
    for (size_t i = 0; i < inj.job.documents.size(); ++i) inj.todo.push_back(i);
    LogInfo("{} accepted /v1/kdn/inject: {} documents", ReqId{c.id}, inj.job.documents.size());
    injections.emplace(c.id, std::move(inj));
    PumpInjection(c.id);
  }

  // Sends documents to prefill workers with room; ends the injection when
  // every document is done, or fails the rest when no prefill worker is up.
  void PumpInjection(uint64_t id) {
    auto it = injections.find(id);
    if (it == injections.end()) return;
    Injection& inj = it->second;
    std::map<size_t, int> busy;
    for (const auto& [pid, part] : inject_parts) ++busy[part.worker];
    bool any_up = false;
    while (!inj.todo.empty()) {
      size_t best = workers.size();
      for (size_t w = 0; w < workers.size(); ++w) {
        if (!Usable(w, "prefill")) continue;
        any_up = true;
        if (busy[w] >= kInjectPerWorker) continue;
        if (best == workers.size() || busy[w] < busy[best] ||
            (busy[w] == busy[best] &&
             workers[w].view.queue_tokens < workers[best].view.queue_tokens)) {
          best = w;
        }
      }
      if (best == workers.size()) break;
      const size_t doc = inj.todo.front();
      inj.todo.pop_front();
      proto::WorkerMessage m;
      auto* ir = m.mutable_inject();
      for (int32_t t : inj.job.documents[doc]) ir->add_tokens(t);
      ir->set_ns(inj.job.ns);
      const uint64_t part_id = next_part_id++;
      inject_parts[part_id] = {id, doc, best};
      ++busy[best];
      ++inj.in_flight;
      // The document travels under an id of its own: the prefill worker's
      // lines about it carry that one.
      LogDebug("{} document {} ({} tokens) to {} as {}", ReqId{id}, doc,
               inj.job.documents[doc].size(), workers[best].view.name, ReqId{part_id});
      Send(best, part_id, m);
    }
    if (!inj.todo.empty() && !any_up && inj.in_flight == 0) {
      if (inj.progress.done == 0) {
        JobEvent ev;
        ev.kind = JobEvent::Kind::kError;
        ev.error = Unavailable("no prefill worker is up");
        JobCallback cb = std::move(inj.cb);
        injections.erase(it);
        cb(std::move(ev));
        return;
      }
      while (!inj.todo.empty()) {
        DocumentDone(inj, inj.todo.front(), "no prefill worker is up");
        inj.todo.pop_front();
      }
    }
    if (inj.todo.empty() && inj.in_flight == 0) {
      JobEvent ev;
      ev.kind = JobEvent::Kind::kDone;
      ev.progress = inj.progress;
      JobCallback cb = std::move(inj.cb);
      injections.erase(it);
      cb(std::move(ev));
    }
  }

  // Counts one document; `error` empty: it is in the KDN.
  void DocumentDone(Injection& inj, size_t doc, const std::string& error, bool held = false) {
    ++inj.progress.done;
    inj.progress.tokens += static_cast<int64_t>(inj.job.documents[doc].size());
    if (!error.empty()) {
      ++inj.progress.failed;
      inj.progress.errors.emplace_back(static_cast<int>(doc), error);
    } else if (held) {
      ++inj.progress.already_held;
    } else {
      ++inj.progress.stored;
    }
    if (metrics) {
      metrics->Injected(error.empty() ? (held ? "already_held" : "stored") : "failed",
                        inj.job.documents[doc].size());
    }
  }

  void OnInjectReply(size_t w, const proto::WorkerMessage& m) {
    auto pit = inject_parts.find(m.request_id());
    if (pit == inject_parts.end() || pit->second.worker != w) return;
    const InjectPart part = pit->second;
    inject_parts.erase(pit);
    auto it = injections.find(part.injection);
    if (it == injections.end()) return;  // its client went away
    Injection& inj = it->second;
    --inj.in_flight;
    Status st = control::StatusFromProto(m.inject_reply().error());
    if (!st.ok()) {
      LogWarn("{} document {} failed at {} ({}): {}", ReqId{part.injection}, part.document,
              workers[w].view.name, ReqId{m.request_id()}, st.ToString());
    }
    DocumentDone(inj, part.document,
                 st.ok() ? "" : st.WithContext(workers[w].view.name).ToString(),
                 m.inject_reply().already_held());
    if (inj.cb) {
      JobEvent ev;
      ev.kind = JobEvent::Kind::kProgress;
      ev.progress = inj.progress;
      ev.progress.errors.clear();  // only the final event lists them
      inj.cb(std::move(ev));
    }
    PumpInjection(part.injection);
  }

  // A prefill worker went down: its documents go to another.
  void RequeueInjections(size_t w) {
    std::vector<uint64_t> touched;
    for (auto it = inject_parts.begin(); it != inject_parts.end();) {
      if (it->second.worker != w) {
        ++it;
        continue;
      }
      auto inj = injections.find(it->second.injection);
      if (inj != injections.end()) {
        --inj->second.in_flight;
        inj->second.todo.push_front(it->second.document);
        touched.push_back(it->second.injection);
      }
      it = inject_parts.erase(it);
    }
    for (uint64_t id : touched) PumpInjection(id);
  }

  // Sends request `r`'s prefill to its prefill worker r.p, the KV to go to
  // its decode worker r.d (prepared).
  void SendPrefill(Request& r) {
    proto::WorkerMessage pm;
    auto* pf = pm.mutable_prefill();
    for (int32_t t : r.job.tokens) pf->add_tokens(t);
    pf->set_ns(r.job.ns);
    control::SamplingToProto(r.job.sampling, pf->mutable_sampling());
    pf->set_decode_endpoint(workers[r.d].kvbus_endpoint);
    pf->set_decode_held_tokens(static_cast<int32_t>(r.decode_held_tokens));
    pf->set_transfer_id(r.transfer_id);
    pf->set_generated_tokens(static_cast<int32_t>(r.resumed_tokens));
    if (r.job.blend) {
      auto* b = pf->mutable_blend();
      b->set_head_tokens(r.job.blend->head_tokens);
      for (int len : r.job.blend->segment_tokens) b->add_segment_tokens(len);
      b->set_recompute_ratio(r.job.blend->recompute_ratio);
      b->set_check_layer(r.job.blend->check_layer);
    }
    Send(r.p, r.id, pm);
    r.prefill_sent = true;
    r.phase = Phase::kPrefill;
  }

  // Request `r` lost its prefill worker before its first token: the least
  // busy other prefill worker takes the prefill (the decode worker still
  // holds the reservation; KV the lost worker already pushed is skipped).
  // False if there is none, or the request has been moved twice already.
  bool RetryPrefill(Request& r) {
    constexpr int kMaxPrefillRetries = 2;
    if (r.prefill_retries >= kMaxPrefillRetries) return false;
    const size_t lost = r.p;
    bool found = false;
    for (size_t x = 0; x < workers.size(); ++x) {
      if (x == lost || !Usable(x, "prefill")) continue;
      if (!found || workers[x].view.queue_tokens < workers[r.p].view.queue_tokens) r.p = x;
      found = true;
    }
    if (!found) {
      r.p = lost;
      return false;
    }
    ++r.prefill_retries;
    LogWarn("{} prefill worker {} lost before the first token: prefill sent again, to {}",
            ReqId{r.id}, workers[lost].view.name, workers[r.p].view.name);
    SendPrefill(r);
    return true;
  }

  // Request `r` lost its decode worker (`why`): it starts over from the
  // lookup, never to that worker again, with the tokens its client has as
  // the tail of its prompt (docs/serving.md, "A decode worker lost"). Its
  // prefill worker, if it has one at work, is told to let it go. False,
  // with nothing changed, when resuming is off or spent, or no decode
  // worker is left to take it.
  bool Resume(Request& r, const std::string& why) {
    if (!options.resume || r.Resumes() >= options.max_resumes) return false;
    bool other = false;
    for (size_t x = 0; x < workers.size(); ++x) {
      other |= x != r.d && r.lost_decode.count(x) == 0 && Usable(x, "decode");
    }
    if (!other) return false;
    if (r.prefill_sent && r.phase == Phase::kPrefill) SendCancel(r.p, r.id);
    // Should the worker only have gone quiet, it stops for good.
    SendCancel(r.d, r.id);
    r.lost_decode.insert(r.d);
    const int64_t carried = static_cast<int64_t>(r.generated.size()) - r.resumed_tokens;
    r.job.tokens.insert(r.job.tokens.end(), r.generated.end() - carried, r.generated.end());
    r.resumed_tokens = static_cast<int64_t>(r.generated.size());
    r.prefill_sent = false;
    r.decode_held_tokens = 0;
    r.prefill_retries = 0;
    LogWarn("{} decode worker {} {} after {} tokens: resuming elsewhere ({} of {})", ReqId{r.id},
            workers[r.d].view.name, why, r.generated.size(), r.Resumes(), options.max_resumes);
    if (metrics) metrics->Resumed(static_cast<int>(r.generated.size()));
    if (Status st = StartLookup(r); !st.ok()) {
      Fail(r.id, st);  // not reached: a decode worker is up (checked above)
    }
    return true;
  }

  // Worker `w` is down (`why`: "stopped answering", "closed its
  // connection"): its requests go on elsewhere where they can (Resume,
  // RetryPrefill) and fail otherwise, its lookups count as misses, its
  // injections go to another prefill worker. It is up again once it is
  // heard from.
  void MarkDown(size_t w, const std::string& why) {
    Worker& wk = workers[w];
    wk.view.up = false;
    wk.heard = false;
    LogWarn("{} ({}) {}", wk.view.name, wk.view.endpoint, why);
    // Published before its requests fail, so that whoever hears of a failure
    // (the client, /health) already sees the worker down.
    UpdateSnapshot();
    std::vector<uint64_t> doomed, to_choose, to_resume;
    for (auto& [id, r] : requests) {
      const bool uses_d = r.phase != Phase::kLookup && r.phase != Phase::kQueued && r.d == w;
      const bool uses_p = r.phase == Phase::kPrefill && r.p == w;
      // Before the first token nothing has reached the client: another
      // prefill worker can take the request over.
      if (uses_p && !uses_d && RetryPrefill(r)) continue;
      if (uses_d) {
        to_resume.push_back(id);  // after this loop: Resume may fail it
      } else if (uses_p) {
        doomed.push_back(id);
      }
      auto pit = r.prefix.find(w);
      if (r.phase == Phase::kLookup && pit != r.prefix.end() && pit->second < 0) {
        r.prefix.erase(pit);
        if (--r.lookups_pending == 0) to_choose.push_back(id);
      }
    }
    const Status lost = Unavailable(wk.view.role + " worker " + wk.view.name + " " + why);
    for (uint64_t id : to_resume) {
      auto it = requests.find(id);
      if (it != requests.end() && !Resume(it->second, why)) doomed.push_back(id);
    }
    for (uint64_t id : doomed) Fail(id, lost);
    if (wk.view.role == "prefill") RequeueInjections(w);
    for (uint64_t id : to_choose) {
      auto it = requests.find(id);
      if (it != requests.end()) Choose(it->second);
    }
  }

  // Takes the monitor events of worker `w`: a closed connection marks it
  // down at once.
  void OnMonitorEvents(size_t w) {
    for (;;) {
      zmq::message_t event, endpoint;
      if (!workers[w].monitor->recv(event, zmq::recv_flags::dontwait)) return;
      if (event.more()) (void)workers[w].monitor->recv(endpoint, zmq::recv_flags::none);
      uint16_t id = 0;
      if (event.size() >= sizeof(id)) std::memcpy(&id, event.data(), sizeof(id));
      if (id == ZMQ_EVENT_DISCONNECTED && workers[w].view.up) {
        MarkDown(w, "closed its connection");
        UpdateSnapshot();
      }
    }
  }

  void Tick() {
    const auto now = Clock::now();
    bool changed = false;
    for (size_t w = 0; w < workers.size(); ++w) {
      Worker& wk = workers[w];
      if (now - wk.last_ping >= options.ping_interval) {
        proto::WorkerMessage m;
        m.mutable_info_request();
        Send(w, 0, m);
        wk.last_ping = now;
      }
      const bool silent = !wk.heard || now - wk.last_heard > options.worker_timeout;
      if (wk.view.up && silent) {
        MarkDown(w, "stopped answering");
        changed = true;
      }
    }
    // Deadlines: lookups go ahead with the answers they have.
    std::vector<uint64_t> late_lookup, late_prepare, late_queued;
    for (auto& [id, r] : requests) {
      if (now < r.deadline) continue;
      if (r.phase == Phase::kLookup) late_lookup.push_back(id);
      if (r.phase == Phase::kPrepare) late_prepare.push_back(id);
      if (r.phase == Phase::kQueued) late_queued.push_back(id);
    }
    for (uint64_t id : late_queued) {
      Fail(id, Unavailable("no decode worker had room within " +
                           std::to_string(options.queue_timeout.count() / 1000) +
                           " s (--queue-timeout-ms)"));
    }
    DrainQueue();
    if (metrics) {
      // Counted from the requests, not the queue, which may still hold the
      // ids of requests cancelled or timed out while they waited.
      int waiting = 0;
      for (const auto& [id, r] : requests) waiting += r.phase == Phase::kQueued;
      metrics->QueueDepth(waiting);
    }
    for (uint64_t id : late_lookup) {
      auto it = requests.find(id);
      if (it != requests.end()) {
        it->second.lookups_pending = 0;
        Choose(it->second);
      }
    }
    for (uint64_t id : late_prepare) {
      Fail(id, Unavailable("the decode worker did not answer in time"));
    }
    if (changed) UpdateSnapshot();
  }

  void Loop() {
    std::vector<zmq::pollitem_t> items;
    items.push_back({inbox.handle(), 0, ZMQ_POLLIN, 0});
    for (Worker& w : workers) items.push_back({w.sock->handle(), 0, ZMQ_POLLIN, 0});
    for (Worker& w : workers) items.push_back({w.monitor->handle(), 0, ZMQ_POLLIN, 0});
    auto last_snapshot = Clock::now();
    while (!stop.load(std::memory_order_relaxed)) {
      try {
        zmq::poll(items.data(), items.size(), std::chrono::milliseconds(50));
        if (items[0].revents & ZMQ_POLLIN) {
          zmq::message_t m;
          while (inbox.recv(m, zmq::recv_flags::dontwait)) {
          }
          std::deque<Command> todo;
          {
            std::lock_guard<std::mutex> lock(mu);
            todo.swap(commands);
          }
          for (Command& c : todo) {
            if (c.kind == Command::Kind::kSubmit) {
              OnSubmit(c);
            } else if (c.kind == Command::Kind::kInject) {
              OnInject(c);
            } else if (injections.erase(c.id) != 0) {
              // Its documents in flight finish; their replies are dropped.
            } else {
              auto it = requests.find(c.id);
              if (it != requests.end()) {
                const Request& r = it->second;
                // A queued one is skipped when the queue reaches its id.
                if (r.phase != Phase::kLookup && r.phase != Phase::kQueued) SendCancel(r.d, r.id);
                if (r.phase == Phase::kPrefill) SendCancel(r.p, r.id);
                requests.erase(it);
              }
            }
          }
        }
        for (size_t w = 0; w < workers.size(); ++w) {
          if (!(items[w + 1].revents & ZMQ_POLLIN)) continue;
          for (int k = 0; k < 256; ++k) {
            zmq::message_t msg;
            if (!workers[w].sock->recv(msg, zmq::recv_flags::dontwait)) break;
            Worker& wk = workers[w];
            wk.last_heard = Clock::now();
            wk.heard = true;
            if (!wk.view.up) {
              wk.view.up = true;
              LogInfo("{} ({}) is up", wk.view.endpoint, wk.view.role);
            }
            proto::WorkerMessage wm;
            if (!wm.ParseFromArray(msg.data(), static_cast<int>(msg.size()))) {
              bad_messages.Warn("dropping an undecodable message from {}", wk.view.name);
              continue;
            }
            OnMessage(w, wm);
          }
        }
        for (size_t w = 0; w < workers.size(); ++w) {
          if (items[1 + workers.size() + w].revents & ZMQ_POLLIN) OnMonitorEvents(w);
        }
        Tick();
        if (Clock::now() - last_snapshot > std::chrono::milliseconds(100)) {
          UpdateSnapshot();
          last_snapshot = Clock::now();
        }
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) return;
        loop_errors.Error("backend: {}", e.what());
      }
    }
  }
};

Backend::Backend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Backend>> Backend::Start(const BackendOptions& options,
                                                const text::Tokenizer& tokenizer,
                                                Metrics* metrics) {
  if (options.prefill_endpoints.empty()) return InvalidArgument("no prefill worker given");
  if (options.decode_endpoints.empty()) return InvalidArgument("no decode worker given");
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->tokenizer = &tokenizer;
  impl->metrics = metrics;
  std::random_device rd;
  impl->nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  // Request ids count up from a random point, so that two runs of a router
  // almost never share one in their logs: 30 random bits above a 32-bit
  // count, below the injection parts' ids (1 << 62).
  impl->next_id = ((impl->nonce >> 7) & 0x3fffffff) << 32 | 1;
  try {
    char name[64];
    std::snprintf(name, sizeof(name), "inproc://router-backend-%p", static_cast<void*>(impl.get()));
    impl->inbox.bind(name);
    impl->wake.set(zmq::sockopt::linger, 0);
    impl->wake.connect(name);
    auto add = [&](const std::string& ep, const char* role) {
      Worker w;
      w.view.name = ep;
      w.view.role = role;
      w.view.endpoint = ep;
      w.sock = std::make_unique<zmq::socket_t>(impl->ctx, zmq::socket_type::dealer);
      KDN_RETURN_IF_ERROR(kvbus::SecureClient(*w.sock, options.curve));
      w.sock->set(zmq::sockopt::linger, 0);
      w.sock->set(zmq::sockopt::sndhwm, 100000);
      w.sock->set(zmq::sockopt::maxmsgsize, control::kMaxControlFrameBytes);
      char mon[96];
      std::snprintf(mon, sizeof(mon), "inproc://router-backend-%p-monitor-%zu",
                    static_cast<void*>(impl.get()), impl->workers.size());
      if (zmq_socket_monitor(w.sock->handle(), mon, ZMQ_EVENT_DISCONNECTED) != 0) {
        return kvbus::ZmqErrorStatus(zmq_errno(), "monitoring the connection to " + ep);
      }
      w.monitor = std::make_unique<zmq::socket_t>(impl->ctx, zmq::socket_type::pair);
      w.monitor->set(zmq::sockopt::linger, 0);
      w.monitor->connect(mon);
      w.sock->connect(ep);
      impl->workers.push_back(std::move(w));
      return Status::Ok();
    };
    for (const std::string& ep : options.prefill_endpoints) KDN_RETURN_IF_ERROR(add(ep, "prefill"));
    for (const std::string& ep : options.decode_endpoints) KDN_RETURN_IF_ERROR(add(ep, "decode"));
  } catch (const zmq::error_t& e) {
    return kvbus::ZmqErrorStatus(e.num(), "connecting to the workers");
  }
  impl->UpdateSnapshot();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Loop(); });
  return std::unique_ptr<Backend>(new Backend(std::move(impl)));
}

Backend::~Backend() {
  impl_->stop = true;
  if (impl_->thread.joinable()) impl_->thread.join();
}

uint64_t Backend::Submit(Job job, JobCallback callback) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const uint64_t id = impl_->next_id++;
  impl_->commands.push_back(
      {Command::Kind::kSubmit, id, std::move(job), {}, std::move(callback), Clock::now()});
  (void)impl_->wake.send(zmq::str_buffer("s"), zmq::send_flags::dontwait);
  return id;
}

uint64_t Backend::Inject(InjectJob job, JobCallback callback) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const uint64_t id = impl_->next_id++;
  Command c{Command::Kind::kInject, id, {}, std::move(job), std::move(callback), Clock::now()};
  impl_->commands.push_back(std::move(c));
  (void)impl_->wake.send(zmq::str_buffer("i"), zmq::send_flags::dontwait);
  return id;
}

void Backend::Cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->commands.push_back({Command::Kind::kCancel, id, {}, {}, {}, Clock::now()});
  (void)impl_->wake.send(zmq::str_buffer("c"), zmq::send_flags::dontwait);
}

std::vector<WorkerView> Backend::Workers() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->snapshot;
}

}  // namespace kdn::router
