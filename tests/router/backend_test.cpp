// The router's Backend against real workers on loopback, in one process:
// docs/design.md step 5, the first token reaches the client as soon as the
// prefill worker has it, before the decode worker produces anything.
//
// HeldDecodeWorker stands in for a decode worker held back (busy, or slow to
// admit): it takes requests and their KV like kdn-decode but decodes
// nothing, records what the router tells it, and sends token events only when
// a test says so. The tests wait for what the router sends it, never for a
// length of time, so they cannot depend on the machine's speed.
#include "kdn/router/backend.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <deque>
#include <mutex>

#include "kdn/testing/temp_dir.h"
#include "kdn/testing/tiny_model.h"
#include "kdn/control/control_server.h"
#include "kdn/control/convert.h"
#include "kdn/worker/worker_setup.h"
#include "kdn/decode_worker/decode_service.h"
#include "kdn/engine/generate.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/transport.h"
#include "kdn/prefill_worker/prefill_service.h"

namespace kdn::router {
namespace {

using kdn::testing::TempDir;

constexpr auto kWait = std::chrono::seconds(30);  // only ever reached by a failing test
constexpr int kChunk = 16;

// What the router told the held decode worker about one request.
struct Told {
  proto::WorkerMessage::BodyCase body = proto::WorkerMessage::BODY_NOT_SET;
  int32_t first_token = -1;
  bool first_token_sent = false;
};

class HeldDecodeWorker {
 public:
  // `role` "prefill": it stands in for a prefill worker instead, which
  // records the prefill requests it gets and answers none.
  explicit HeldDecodeWorker(const std::filesystem::path& model_dir, std::string role = "decode")
      : role_(std::move(role)) {
    auto wm = worker::LoadWorkerModel(model_dir, {.kv_tokens = 256, .threads = 1});
    EXPECT_TRUE(wm.ok()) << wm.status().ToString();
    wm_ = std::move(wm).value();
    std::vector<std::unique_ptr<kvbus::ChunkStore>> tiers;
    tiers.push_back(std::make_unique<kvbus::HostTier>(16u << 20));
    store_ = std::make_unique<kvbus::TieredStore>(std::move(tiers));
    auto receiver = kvbus::Listen("tcp://127.0.0.1:0", staging_);
    EXPECT_TRUE(receiver.ok()) << receiver.status().ToString();
    receiver_ = std::move(receiver).value();
    auto server = control::ControlServer::Start(
        "tcp://127.0.0.1:0", [this](control::ControlServer& srv, const std::string& peer,
                                    proto::WorkerMessage m) { OnMessage(srv, peer, m); });
    EXPECT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
  }

  const std::string& endpoint() const { return server_->endpoint(); }
  const worker::WorkerModel& model() const { return wm_; }

  // The next Start or Cancel the router sends for request `id`.
  Told WaitForWord(uint64_t id) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, kWait, [&] { return !told_[id].empty(); });
    if (told_[id].empty()) return {};
    Told t = told_[id].front();
    told_[id].pop_front();
    return t;
  }

  // Sends token events for request `id`, as a decode step would.
  void SendTokens(uint64_t id, const std::vector<int32_t>& tokens, const std::string& finish) {
    std::lock_guard<std::mutex> lock(mu_);
    proto::WorkerMessage m;
    m.set_request_id(id);
    for (size_t i = 0; i < tokens.size(); ++i) {
      auto* e = m.mutable_tokens()->add_events();
      e->set_token(tokens[i]);
      e->set_text(wm_.tokenizer->Decode(std::span<const int32_t>(&tokens[i], 1)));
      if (i + 1 == tokens.size() && !finish.empty()) {
        e->set_finished(true);
        e->set_finish_reason(finish);
      }
    }
    server_->Send(peer_, m);
  }

 private:
  void OnMessage(control::ControlServer& srv, const std::string& peer,
                 const proto::WorkerMessage& m) {
    auto info = [this](proto::WorkerInfo* i) {
      i->set_name("held-" + role_);
      i->set_role(role_);
      i->set_model_fingerprint(control::KeyToBytes(wm_.fingerprint));
      i->set_chunk_tokens(kChunk);
      i->set_max_context(wm_.model->config().max_context);
      i->set_kvbus_endpoint(receiver_->endpoint());
      i->set_free_kv_blocks(1000);
      i->set_total_kv_blocks(1000);
    };
    if (worker::AnswerQuery(srv, peer, m, *store_, {wm_.fingerprint, "", kChunk}, info)) return;
    std::lock_guard<std::mutex> lock(mu_);
    peer_ = peer;
    if (m.has_prepare()) {
      proto::WorkerMessage reply;
      reply.set_request_id(m.request_id());
      reply.mutable_prepare_reply()->set_held_tokens(0);
      srv.Send(peer, reply);
      return;
    }
    Told t{m.body_case()};
    if (m.has_start()) {
      t.first_token = m.start().first_token();
      t.first_token_sent = m.start().first_token_sent();
    }
    told_[m.request_id()].push_back(t);
    cv_.notify_all();
  }

  const std::string role_;
  worker::WorkerModel wm_;
  std::unique_ptr<kvbus::TieredStore> store_;
  kvbus::HostTier staging_{64u << 20};
  std::unique_ptr<kvbus::Receiver> receiver_;
  std::unique_ptr<control::ControlServer> server_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::deque<Told>> told_;  // guarded by mu_
  std::string peer_;                           // guarded by mu_
};

// A job's events as its client sees them.
class Client {
 public:
  JobCallback Callback() {
    return [this](JobEvent ev) {
      std::lock_guard<std::mutex> lock(mu_);
      events_.push_back(std::move(ev));
      cv_.notify_all();
    };
  }
  std::vector<JobEvent> Events() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }
  // Every event, once the job has ended (or what came within kWait).
  std::vector<JobEvent> WaitForEnd() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, kWait, [&] {
      return !events_.empty() && events_.back().kind != JobEvent::Kind::kTokens;
    });
    return events_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<JobEvent> events_;  // guarded by mu_
};

std::string JoinedText(const std::vector<JobEvent>& events) {
  std::string s;
  for (const JobEvent& e : events) s += e.text;
  return s;
}

// The value of an unlabelled sample of a Prometheus page (-1 if absent).
double Sample(const std::string& page, const std::string& name) {
  const auto at = page.find("\n" + name + " ");
  return at == std::string::npos ? -1 : std::stod(page.substr(at + name.size() + 2));
}

class BackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(kdn::testing::WriteTinyModel(dir_.path()).ok());
    auto tok = text::Tokenizer::Load(dir_.path());
    ASSERT_TRUE(tok.ok());
    tokenizer_ = std::move(tok).value();
    auto p = prefill_worker::PrefillService::Start({.model_dir = dir_.path(),
                                                    .host_bytes = 16u << 20,
                                                    .chunk_tokens = kChunk,
                                                    .engine = {.kv_tokens = 1024, .threads = 1}});
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    prefill_ = std::move(p).value();
  }

  // Starts the backend over the prefill worker and `decode_endpoint`, and
  // waits until it has heard from both.
  // `prefill_before`: prefill workers listed before the real one (chosen
  // first when their costs tie); `decode_after`: decode workers listed after
  // `decode_endpoint` (chosen after it when all else ties).
  void StartBackend(const std::string& decode_endpoint,
                    std::chrono::milliseconds worker_timeout = std::chrono::seconds(3),
                    std::vector<std::string> prefill_before = {},
                    std::vector<std::string> decode_after = {}) {
    BackendOptions o;
    o.prefill_endpoints = std::move(prefill_before);
    o.prefill_endpoints.push_back(prefill_->endpoint());
    o.decode_endpoints = {decode_endpoint};
    o.decode_endpoints.insert(o.decode_endpoints.end(), decode_after.begin(), decode_after.end());
    o.worker_timeout = worker_timeout;
    o.resume = resume_;
    // These tests drive the prefill worker's path, with a fake decode
    // worker that never prefills (tests/router covers the local path).
    o.disaggregation = Disaggregation::kAlways;
    auto b = Backend::Start(o, *tokenizer_, &metrics_);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    backend_ = std::move(b).value();
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    for (;;) {
      const auto workers = backend_->Workers();
      if (std::all_of(workers.begin(), workers.end(), [](const WorkerView& w) {
            return w.up && w.compatible && w.max_context > 0;
          })) {
        return;
      }
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the workers never answered";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  // A real decode worker on the test's model.
  Result<std::unique_ptr<decode_worker::DecodeService>> StartDecodeService() const {
    return decode_worker::DecodeService::Start({.model_dir = dir_.path(),
                                                .host_bytes = 16u << 20,
                                                .staging_bytes = 16u << 20,
                                                .chunk_tokens = kChunk,
                                                .engine = {.kv_tokens = 1024, .threads = 1}});
  }

  WorkerView DecodeView() const {
    for (const WorkerView& w : backend_->Workers()) {
      if (w.role == Role::kDecode) return w;
    }
    return {};
  }

  Job GreedyJob(const std::string& prompt, int max_tokens) {
    Job job;
    job.tokens = tokenizer_->Encode(prompt, true);
    job.sampling.temperature = 0;
    job.max_tokens = max_tokens;
    return job;
  }

  TempDir dir_;
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::unique_ptr<prefill_worker::PrefillService> prefill_;
  Metrics metrics_;
  bool resume_ = true;                // BackendOptions::resume of StartBackend
  std::unique_ptr<Backend> backend_;  // last: stopped first
};

// Greedy continuation of `job` by the engine alone.
std::vector<int32_t> EngineTokens(const worker::WorkerModel& wm, const Job& job, int n) {
  auto g = engine::Generate(*wm.model, job.tokens, {.max_tokens = n, .sampling = job.sampling});
  EXPECT_TRUE(g.ok());
  return g.ok() ? g->tokens : std::vector<int32_t>{};
}

TEST_F(BackendTest, FirstTokenReachesTheClientBeforeTheDecodeWorkerStarts) {
  HeldDecodeWorker d(dir_.path());
  StartBackend(d.endpoint());
  const Job job = GreedyJob("Hello world", 3);
  const std::vector<int32_t> want = EngineTokens(d.model(), job, 3);
  ASSERT_EQ(want.size(), 3u);
  ASSERT_LT(want[0], 128) << "precondition: the first token is ASCII, shown at once";
  Client client;
  const uint64_t id = backend_->Submit(job, client.Callback());

  const Told start = d.WaitForWord(id);
  ASSERT_EQ(start.body, proto::WorkerMessage::kStart);
  // By the time the decode worker is asked to start, the client has the
  // first token, and the decode worker is told not to send it again.
  const std::vector<JobEvent> early = client.Events();
  ASSERT_EQ(early.size(), 1u) << "the first token did not reach the client before the decode "
                                 "worker was started";
  EXPECT_EQ(early[0].kind, JobEvent::Kind::kTokens);
  EXPECT_EQ(early[0].tokens, 1);
  EXPECT_EQ(early[0].text, std::string(1, static_cast<char>(want[0])));
  EXPECT_EQ(start.first_token, want[0]);
  EXPECT_TRUE(start.first_token_sent);
  EXPECT_EQ(Sample(metrics_.Render({}), "kdn_ttft_seconds_count"), 1);

  // The decode worker goes on from the second token.
  d.SendTokens(id, {want[1], want[2]}, "length");
  const std::vector<JobEvent> all = client.WaitForEnd();
  ASSERT_EQ(all.back().kind, JobEvent::Kind::kDone);
  EXPECT_EQ(all.back().finish_reason, "length");
  EXPECT_EQ(all.back().usage.completion_tokens, 3);
  EXPECT_EQ(all.back().usage.prompt_tokens, static_cast<int>(job.tokens.size()));
  EXPECT_EQ(JoinedText(all), tokenizer_->Decode(want));
  const std::string page = metrics_.Render({});
  EXPECT_EQ(Sample(page, "kdn_ttft_seconds_count"), 1);
  EXPECT_EQ(Sample(page, "kdn_generated_tokens_total"), 3);
  EXPECT_EQ(Sample(page, "kdn_inter_token_seconds_count"), 2);
}

TEST_F(BackendTest, AFirstTokenThatEndsTheRequestFinishesItWithoutTheDecodeWorker) {
  HeldDecodeWorker d(dir_.path());
  StartBackend(d.endpoint());
  const Job base = GreedyJob("Hello world", 8);
  const int32_t first = EngineTokens(d.model(), base, 1).at(0);
  ASSERT_LT(first, 128) << "precondition: the first token is ASCII";
  const std::string first_text(1, static_cast<char>(first));
  struct Case {
    const char* name;
    Job job;
    std::string reason, text;
  };
  std::vector<Case> cases = {{"max_tokens 1", GreedyJob("Hello world", 1), "length", first_text},
                             {"stop token", base, "stop", first_text},
                             {"stop string", base, "stop", ""}};
  cases[1].job.stop_ids = {first};
  cases[2].job.stop_strings = {first_text};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Client client;
    const uint64_t id = backend_->Submit(c.job, client.Callback());
    // The decode worker is told to let go of what it reserved, not to start.
    ASSERT_EQ(d.WaitForWord(id).body, proto::WorkerMessage::kCancel);
    const std::vector<JobEvent> events = client.WaitForEnd();
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0].kind, JobEvent::Kind::kDone);
    EXPECT_EQ(events[0].tokens, 1);
    EXPECT_EQ(events[0].text, c.text);
    EXPECT_EQ(events[0].finish_reason, c.reason);
    EXPECT_EQ(events[0].usage.completion_tokens, 1);
  }
  EXPECT_EQ(Sample(metrics_.Render({}), "kdn_ttft_seconds_count"), 3);
  EXPECT_EQ(Sample(metrics_.Render({}), "kdn_generated_tokens_total"), 3);
}

TEST_F(BackendTest, AClientGoneAfterTheFirstTokenCancelsItAtTheDecodeWorker) {
  HeldDecodeWorker d(dir_.path());
  StartBackend(d.endpoint());
  Client client;
  const uint64_t id = backend_->Submit(GreedyJob("Hello world", 8), client.Callback());
  ASSERT_EQ(d.WaitForWord(id).body, proto::WorkerMessage::kStart);
  ASSERT_EQ(client.Events().size(), 1u);
  backend_->Cancel(id);
  EXPECT_EQ(d.WaitForWord(id).body, proto::WorkerMessage::kCancel);
  // Tokens the decode worker sent before it heard are dropped: a later
  // request, whose messages come after them on the same connection, ends
  // while the cancelled one has seen nothing more.
  d.SendTokens(id, {'a', 'b'}, "");
  Client later;
  const uint64_t id2 = backend_->Submit(GreedyJob("Hello world", 1), later.Callback());
  EXPECT_EQ(d.WaitForWord(id2).body, proto::WorkerMessage::kCancel);
  EXPECT_EQ(later.WaitForEnd().back().kind, JobEvent::Kind::kDone);
  EXPECT_EQ(client.Events().size(), 1u);
}

// With a real decode worker: what the router shows of the first token and
// what the decode worker sends after it join up, even when the first token is
// held back (it may begin a stop string), and a request that its first token
// ends gives the decode worker's KV back.
// A decode worker whose connection closes (its process is gone) is down at
// once, from ZeroMQ's monitor: its running request fails without waiting for
// worker_timeout, here an hour, which the test's wait never reaches.
TEST_F(BackendTest, AWorkerWhoseConnectionClosesIsDownAtOnce) {
  auto d = std::make_unique<HeldDecodeWorker>(dir_.path());
  StartBackend(d->endpoint(), std::chrono::hours(1));
  Client client;
  const uint64_t id = backend_->Submit(GreedyJob("Hello world", 8), client.Callback());
  ASSERT_EQ(d->WaitForWord(id).body, proto::WorkerMessage::kStart);
  d.reset();  // closes its control socket, as a process that dies does
  const std::vector<JobEvent> events = client.WaitForEnd();
  ASSERT_FALSE(events.empty());
  ASSERT_EQ(events.back().kind, JobEvent::Kind::kError);
  EXPECT_NE(events.back().error.message().find("closed its connection"), std::string::npos)
      << events.back().error.ToString();
  EXPECT_FALSE(DecodeView().up);
}

// A prefill worker lost before the first token (its connection closes)
// loses no request: the prefill goes to another prefill worker, the decode
// worker keeps its reservation, and the client sees only the answer.
TEST_F(BackendTest, APrefillWorkerLostBeforeTheFirstTokenIsReplaced) {
  auto d = StartDecodeService();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  auto lost = std::make_unique<HeldDecodeWorker>(dir_.path(), "prefill");
  StartBackend((*d)->endpoint(), std::chrono::hours(1), {lost->endpoint()});
  auto wm = worker::LoadWorkerModel(dir_.path(), {.kv_tokens = 256, .threads = 1});
  ASSERT_TRUE(wm.ok());
  const Job job = GreedyJob("Hello world", 6);
  const std::vector<int32_t> want = EngineTokens(*wm, job, 6);
  Client client;
  const uint64_t id = backend_->Submit(job, client.Callback());
  ASSERT_EQ(lost->WaitForWord(id).body, proto::WorkerMessage::kPrefill);
  EXPECT_TRUE(client.Events().empty());
  lost.reset();  // closes its control socket, as a process that dies does
  const std::vector<JobEvent> events = client.WaitForEnd();
  ASSERT_FALSE(events.empty());
  ASSERT_EQ(events.back().kind, JobEvent::Kind::kDone) << events.back().error.ToString();
  EXPECT_EQ(JoinedText(events), tokenizer_->Decode(want));
  EXPECT_EQ(events.back().usage.completion_tokens, 6);
}

// A decode worker lost mid-stream (its connection closes) loses no request
// (docs/serving.md, "A decode worker lost"): the router sends the prompt and
// the tokens its client has to another decode worker, by way of a prefill
// worker, and the stream goes on, token for token what an uninterrupted run
// gives, greedy or seeded.
TEST_F(BackendTest, ADecodeWorkerLostMidStreamIsResumedElsewhere) {
  auto d = StartDecodeService();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  auto lost = std::make_unique<HeldDecodeWorker>(dir_.path());
  StartBackend(lost->endpoint(), std::chrono::hours(1), {}, {(*d)->endpoint()});
  auto wm = worker::LoadWorkerModel(dir_.path(), {.kv_tokens = 256, .threads = 1});
  ASSERT_TRUE(wm.ok());
  constexpr int kMax = 10;
  // The tiny model's logits are steep: only a high temperature makes its
  // seeded draws differ from token to token.
  for (const float temperature : {0.0f, 100.0f}) {
    SCOPED_TRACE(::testing::Message() << "temperature " << temperature);
    // Prompts apart, so that the decode worker that holds the first one's
    // conversation is not chosen for the second by its prefix.
    Job job = GreedyJob(temperature == 0 ? "Hello world, resumed" : "Seeded, and resumed", kMax);
    job.sampling.temperature = temperature;
    job.sampling.seed = 11;
    const std::vector<int32_t> want = EngineTokens(*wm, job, kMax);
    ASSERT_EQ(want.size(), static_cast<size_t>(kMax));
    Client client;
    const uint64_t id = backend_->Submit(job, client.Callback());
    const Told start = lost->WaitForWord(id);
    ASSERT_EQ(start.body, proto::WorkerMessage::kStart);
    ASSERT_EQ(start.first_token, want[0]);
    // Two more tokens reach the client; then the worker dies.
    lost->SendTokens(id, {want[1], want[2]}, "");
    for (int i = 0; i < 3000 && client.Events().size() < 2; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_EQ(client.Events().size(), 2u);
    lost.reset();  // closes its control socket, as a process that dies does
    const std::vector<JobEvent> events = client.WaitForEnd();
    ASSERT_FALSE(events.empty());
    ASSERT_EQ(events.back().kind, JobEvent::Kind::kDone) << events.back().error.ToString();
    EXPECT_EQ(JoinedText(events), tokenizer_->Decode(want));
    int tokens = 0;
    for (const JobEvent& e : events) tokens += e.tokens;
    EXPECT_EQ(tokens, kMax);
    EXPECT_EQ(events.back().usage.completion_tokens, kMax);
    EXPECT_EQ(events.back().usage.prompt_tokens, static_cast<int>(job.tokens.size()));
    EXPECT_EQ(events.back().finish_reason, "length");
    // The next request goes to the live worker from the start.
    lost = std::make_unique<HeldDecodeWorker>(dir_.path());
    backend_.reset();
    StartBackend(lost->endpoint(), std::chrono::hours(1), {}, {(*d)->endpoint()});
  }
  const std::string page = metrics_.Render({});
  EXPECT_EQ(Sample(page, "kdn_requests_resumed_total"), 2);
  EXPECT_EQ(Sample(page, "kdn_resumed_tokens_total"), 6);
}

// With resuming off, the same loss fails the request.
TEST_F(BackendTest, WithoutResumeADecodeWorkerLostFailsItsRequests) {
  auto d = StartDecodeService();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  auto lost = std::make_unique<HeldDecodeWorker>(dir_.path());
  resume_ = false;
  StartBackend(lost->endpoint(), std::chrono::hours(1), {}, {(*d)->endpoint()});
  Client client;
  const uint64_t id = backend_->Submit(GreedyJob("Hello world", 8), client.Callback());
  ASSERT_EQ(lost->WaitForWord(id).body, proto::WorkerMessage::kStart);
  lost.reset();
  const std::vector<JobEvent> events = client.WaitForEnd();
  ASSERT_FALSE(events.empty());
  ASSERT_EQ(events.back().kind, JobEvent::Kind::kError);
  EXPECT_NE(events.back().error.message().find("closed its connection"), std::string::npos)
      << events.back().error.ToString();
}

TEST_F(BackendTest, TheRouterAndARealDecodeWorkerShowEachTokenOnce) {
  auto d = StartDecodeService();
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  StartBackend((*d)->endpoint());
  auto wm = worker::LoadWorkerModel(dir_.path(), {.kv_tokens = 256, .threads = 1});
  ASSERT_TRUE(wm.ok());
  const int total_blocks = DecodeView().total_kv_blocks;

  Job job = GreedyJob("Hello world", 12);
  const std::vector<int32_t> want = EngineTokens(*wm, job, 12);
  const std::string text = tokenizer_->Decode(want);
  for (const bool hold_first : {false, true}) {
    SCOPED_TRACE(hold_first ? "first token held back" : "first token shown");
    if (hold_first) {
      // A stop string that begins with the first token's text and never
      // completes: the router must hold that text back, and the decode
      // worker show it with the second token.
      std::string stop = text.substr(0, 1);
      for (char c : std::string("~#@%^|")) {
        if (text.find(c) == std::string::npos) {
          stop += c;
          break;
        }
      }
      ASSERT_EQ(stop.size(), 2u);
      job.stop_strings = {stop};
    }
    Client client;
    backend_->Submit(job, client.Callback());
    const std::vector<JobEvent> events = client.WaitForEnd();
    ASSERT_EQ(events.back().kind, JobEvent::Kind::kDone) << events.back().error.ToString();
    EXPECT_EQ(events[0].tokens, 1);
    EXPECT_EQ(events[0].text, hold_first ? "" : text.substr(0, 1));
    EXPECT_EQ(JoinedText(events), text);
    EXPECT_EQ(events.back().usage.completion_tokens, 12);
    int tokens = 0;
    for (const JobEvent& e : events) tokens += e.tokens;
    EXPECT_EQ(tokens, 12);
  }

  Client one;
  backend_->Submit(GreedyJob("Hello world", 1), one.Callback());
  const std::vector<JobEvent> events = one.WaitForEnd();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].text, text.substr(0, 1));
  // The decode worker freed the request it never started.
  const auto deadline = std::chrono::steady_clock::now() + kWait;
  for (;;) {
    const WorkerView v = DecodeView();
    if (v.queue_depth == 0 && v.free_kv_blocks == total_blocks) break;
    ASSERT_LT(std::chrono::steady_clock::now(), deadline)
        << "the decode worker still holds " << v.queue_depth << " requests and "
        << total_blocks - v.free_kv_blocks << " KV blocks";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace
}  // namespace kdn::router
