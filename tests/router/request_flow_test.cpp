// The request flow (kdn/router/request_flow.h) against fake workers: a
// WorkerLink that records what the router sends, and replies the tests build.
// No sockets: each test steps a request through its phases by hand.
#include "kdn/router/request_flow.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <thread>
#include <tuple>

#include "kdn/control/convert.h"
#include "kdn/kvbus/kv_events.h"
#include "serving.pb.h"

namespace kdn::router {
namespace {

using Phase = RequestFlow::Phase;
using Body = proto::WorkerMessage::BodyCase;

constexpr size_t kP0 = 0, kP1 = 1, kD0 = 2, kD1 = 3;

struct Sent {
  size_t worker;
  uint64_t id;
  proto::WorkerMessage m;
};

class FakeLink : public WorkerLink {
 public:
  void Send(size_t worker, uint64_t request_id, proto::WorkerMessage& m) override {
    m.set_request_id(request_id);
    sent.push_back({worker, request_id, m});
  }
  // The messages of kind `body` sent since the last Take, and forgets all.
  std::vector<Sent> Take(Body body) {
    std::vector<Sent> out;
    for (Sent& s : sent) {
      if (s.m.body_case() == body) out.push_back(std::move(s));
    }
    sent.clear();
    return out;
  }
  std::vector<Sent> sent;
};

WorkerView Worker(Role role, std::string name) {
  WorkerView v;
  v.name = std::move(name);
  v.role = role;
  v.up = v.compatible = true;
  if (role == Role::kDecode) {
    v.free_kv_blocks = v.total_kv_blocks = 64;
    v.max_context = 2048;
    v.kvbus_endpoint = "tcp://kv-" + v.name;
  }
  return v;
}

std::vector<int32_t> ByteIds() {
  std::vector<int32_t> ids(256);
  std::iota(ids.begin(), ids.end(), 0);
  return ids;
}

class RequestFlowTest : public ::testing::Test {
 protected:
  RequestFlowTest()
      : workers_({Worker(Role::kPrefill, "p0"), Worker(Role::kPrefill, "p1"),
                  Worker(Role::kDecode, "d0"), Worker(Role::kDecode, "d1")}),
        ledger_(4),
        tokenizer_(ByteIds(), 258, 256, 257) {
    identity_.known = true;
    identity_.chunk_tokens = 16;
    options_.max_queued = 2;
    // The prefill worker's path unless a test says otherwise (the local
    // path's tests are at the end).
    options_.disaggregation = Disaggregation::kAlways;
  }
  void Start() {
    flow_ = std::make_unique<RequestFlow>(options_, workers_, identity_, ledger_, link_, tokenizer_,
                                          nullptr, 42);
  }
  // Submits a request of `prompt` (bytes) and `max_tokens`; its events go to events_[id].
  uint64_t Submit(const std::string& prompt, int max_tokens = 8, uint64_t id = 1) {
    if (!flow_) Start();
    Job job;
    job.tokens.assign(prompt.begin(), prompt.end());
    job.max_tokens = max_tokens;
    job.sampling.temperature = 0;
    flow_->Submit(
        id, std::move(job), [this, id](JobEvent ev) { events_[id].push_back(ev); },
        RequestFlow::Clock::now());
    return id;
  }
  Phase PhaseOf(uint64_t id) {
    Phase p = Phase::kLookup;
    EXPECT_TRUE(flow_->PhaseOf(id, &p));
    return p;
  }
  void Reply(size_t w, uint64_t id, proto::WorkerMessage m) {
    m.set_request_id(id);
    flow_->OnMessage(w, m);
  }
  // Every worker asked answers the lookup with `prefix` tokens (decode
  // worker d1: `d1_prefix`).
  void AnswerLookups(uint64_t id, int prefix = 0, int d1_prefix = 0) {
    for (const Sent& s : link_.Take(Body::kLookup)) {
      proto::WorkerMessage m;
      m.mutable_lookup_reply()->set_prefix_tokens(s.worker == kD1 ? d1_prefix : prefix);
      Reply(s.worker, id, m);
    }
  }
  void AnswerPrepare(size_t w, uint64_t id, const Status& st = Status::Ok()) {
    proto::WorkerMessage m;
    control::StatusToProto(st, m.mutable_prepare_reply()->mutable_error());
    Reply(w, id, m);
  }
  void AnswerPrefill(size_t w, uint64_t id, int32_t first, const std::string& transfer_id) {
    proto::WorkerMessage m;
    m.mutable_prefill_reply()->set_first_token(first);
    m.mutable_prefill_reply()->set_transfer_id(transfer_id);
    Reply(w, id, m);
  }
  void SendTokens(size_t w, uint64_t id, const std::string& text, bool finished) {
    proto::WorkerMessage m;
    for (char c : text) {
      auto* e = m.mutable_tokens()->add_events();
      e->set_token(static_cast<unsigned char>(c));
      e->set_text(std::string(1, c));
    }
    if (finished) {
      auto* e = m.mutable_tokens()->add_events();
      e->set_token(-1);
      e->set_finished(true);
      e->set_finish_reason("length");
    }
    Reply(w, id, m);
  }
  // Steps request `id` from its lookup to its first token: prefill at `p`,
  // decode at `d` (by the lookup's answers). Returns the prefill sent.
  proto::PrefillRequest ToFirstToken(uint64_t id, size_t p, size_t d, int32_t first = 'x') {
    AnswerLookups(id, 0, d == kD1 ? 16 : 0);
    auto prepares = link_.Take(Body::kPrepare);
    EXPECT_EQ(prepares.size(), 1u);
    EXPECT_EQ(prepares.at(0).worker, d);
    AnswerPrepare(d, id);
    auto prefills = link_.Take(Body::kPrefill);
    EXPECT_EQ(prefills.size(), 1u);
    EXPECT_EQ(prefills.at(0).worker, p);
    const proto::PrefillRequest pf = prefills.at(0).m.prefill();
    EXPECT_EQ(pf.decode_endpoint(), workers_[d].kvbus_endpoint);
    AnswerPrefill(p, id, first, pf.transfer_id());
    return pf;
  }
  // Steps request `id` from its lookup to its prefill sent (and not
  // answered): {its decode worker, the prefill sent, to which worker}.
  std::tuple<size_t, proto::PrefillRequest, size_t> ToPrefill(uint64_t id) {
    AnswerLookups(id);
    const size_t d = link_.Take(Body::kPrepare).at(0).worker;
    AnswerPrepare(d, id);
    const Sent pf = link_.Take(Body::kPrefill).at(0);
    return {d, pf.m.prefill(), pf.worker};
  }
  // Worker `w` goes down, as the pool would tell the flow.
  void Down(size_t w) {
    workers_[w].up = false;
    flow_->OnWorkerDown(w, "stopped answering");
  }

  BackendOptions options_;
  WorkerViews workers_;
  ModelIdentity identity_;
  Ledger ledger_;
  FakeLink link_;
  text::ByteTokenizer tokenizer_;
  std::unique_ptr<RequestFlow> flow_;
  std::map<uint64_t, std::vector<JobEvent>> events_;
};

TEST_F(RequestFlowTest, ARequestGoesThroughLookupPreparePrefillAndDecode) {
  const uint64_t id = Submit("Hello world");
  EXPECT_EQ(PhaseOf(id), Phase::kLookup);
  EXPECT_EQ(link_.sent.size(), 4u);  // every worker is asked
  AnswerLookups(id, 0, /*d1_prefix=*/16);
  EXPECT_EQ(PhaseOf(id), Phase::kPrepare);
  auto prepares = link_.Take(Body::kPrepare);
  ASSERT_EQ(prepares.size(), 1u);
  EXPECT_EQ(prepares[0].worker, kD1);  // it holds more of the prompt
  EXPECT_EQ(prepares[0].m.prepare().generated_tokens(), 0);
  EXPECT_EQ(ledger_.at(kD1).requests, 1);  // reserved until d1 reports
  EXPECT_EQ(ledger_.at(kD1).kv_blocks, KvBlocksFor(11 + 8));
  EXPECT_EQ(ledger_.at(kP0).prefill_tokens, 11);
  AnswerPrepare(kD1, id);
  EXPECT_EQ(PhaseOf(id), Phase::kPrefill);
  auto prefills = link_.Take(Body::kPrefill);
  ASSERT_EQ(prefills.size(), 1u);
  AnswerPrefill(prefills[0].worker, id, 'A', prefills[0].m.prefill().transfer_id());
  EXPECT_EQ(PhaseOf(id), Phase::kDecode);
  auto starts = link_.Take(Body::kStart);
  ASSERT_EQ(starts.size(), 1u);
  EXPECT_EQ(starts[0].worker, kD1);
  EXPECT_EQ(starts[0].m.start().first_token(), 'A');
  SendTokens(kD1, id, "bc", /*finished=*/true);
  EXPECT_EQ(flow_->size(), 0u);
  const auto& ev = events_[id];
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].text, "A");
  EXPECT_EQ(ev[1].kind, JobEvent::Kind::kDone);
  EXPECT_EQ(ev[1].text, "bc");
  EXPECT_EQ(ev[1].usage.completion_tokens, 3);
  EXPECT_EQ(ev[1].usage.prompt_tokens, 11);
}

TEST_F(RequestFlowTest, AFirstTokenThatEndsTheRequestReleasesTheDecodeWorker) {
  const uint64_t id = Submit("Hello", /*max_tokens=*/1);
  ToFirstToken(id, kP0, kD0);
  EXPECT_EQ(flow_->size(), 0u);
  ASSERT_EQ(events_[id].size(), 1u);
  EXPECT_EQ(events_[id][0].kind, JobEvent::Kind::kDone);
  EXPECT_EQ(events_[id][0].finish_reason, "length");
  auto cancels = link_.Take(Body::kCancel);
  ASSERT_EQ(cancels.size(), 1u);  // the decode worker's reservation, not the prefill worker
  EXPECT_EQ(cancels[0].worker, kD0);
}

TEST_F(RequestFlowTest, WithNoRoomARequestWaitsAndGoesOnWhenAWorkerReports) {
  workers_[kD0].free_kv_blocks = workers_[kD1].free_kv_blocks = 0;
  const uint64_t id = Submit("Hello world");
  AnswerLookups(id);
  EXPECT_EQ(PhaseOf(id), Phase::kQueued);
  EXPECT_EQ(flow_->Waiting(), 1);
  EXPECT_TRUE(link_.Take(Body::kPrepare).empty());  // no prefill spent on it
  workers_[kD0].free_kv_blocks = 64;
  flow_->OnReport();
  EXPECT_EQ(PhaseOf(id), Phase::kPrepare);
  EXPECT_EQ(link_.Take(Body::kPrepare).at(0).worker, kD0);
}

TEST_F(RequestFlowTest, PastMaxQueuedARequestIsRefusedAndAWaitEndsAtItsDeadline) {
  workers_[kD0].free_kv_blocks = workers_[kD1].free_kv_blocks = 0;
  for (uint64_t id : {1, 2, 3}) {
    Submit("Hello", 8, id);
    AnswerLookups(id);
  }
  EXPECT_EQ(flow_->Waiting(), 2);
  ASSERT_EQ(events_[3].size(), 1u);
  EXPECT_EQ(events_[3][0].error.code(), StatusCode::kResourceExhausted);
  flow_->Tick(RequestFlow::Clock::now() + options_.queue_timeout + std::chrono::seconds(1));
  EXPECT_EQ(flow_->size(), 0u);
  EXPECT_EQ(events_[1].at(0).error.code(), StatusCode::kUnavailable);
}

TEST_F(RequestFlowTest, ARequestNoDecodeWorkerCouldHoldIsRefused) {
  const uint64_t id = Submit(std::string(2000, 'a'), 100);
  AnswerLookups(id);
  ASSERT_EQ(events_[id].size(), 1u);
  EXPECT_EQ(events_[id][0].error.code(), StatusCode::kInvalidArgument);
}

TEST_F(RequestFlowTest, ADecodeWorkerFullAfterAllSendsTheRequestBackToTheQueue) {
  workers_[kD1].up = false;
  const uint64_t id = Submit("Hello");
  AnswerLookups(id);
  AnswerPrepare(kD0, id, ResourceExhausted("full"));
  EXPECT_EQ(PhaseOf(id), Phase::kQueued);
  EXPECT_TRUE(link_.Take(Body::kPrefill).empty());
  ledger_.Clear(kD0);  // d0 reports room again
  flow_->OnReport();
  EXPECT_EQ(PhaseOf(id), Phase::kPrepare);
}

TEST_F(RequestFlowTest, APrefillWorkerLostBeforeTheFirstTokenIsReplacedByTheOther) {
  const uint64_t id = Submit("Hello world");
  AnswerLookups(id);
  AnswerPrepare(link_.Take(Body::kPrepare).at(0).worker, id);
  auto first = link_.Take(Body::kPrefill);
  ASSERT_EQ(first.size(), 1u);
  const size_t lost = first[0].worker;
  Down(lost);
  auto again = link_.Take(Body::kPrefill);
  ASSERT_EQ(again.size(), 1u);
  EXPECT_NE(again[0].worker, lost);
  EXPECT_EQ(PhaseOf(id), Phase::kPrefill);
  EXPECT_TRUE(events_[id].empty());  // the client saw nothing of it
  Down(again[0].worker);             // no prefill worker is left
  EXPECT_EQ(events_[id].at(0).error.code(), StatusCode::kUnavailable);
}

TEST_F(RequestFlowTest, ADecodeWorkerLostMidStreamResumesAtAnotherWithTheTokensSoFar) {
  const uint64_t id = Submit("Hello", 8);
  ToFirstToken(id, kP0, kD1, 'A');
  SendTokens(kD1, id, "bc", false);
  link_.sent.clear();
  Down(kD1);
  ASSERT_EQ(link_.sent.at(0).m.body_case(), Body::kCancel);
  EXPECT_EQ(link_.sent.at(0).worker, kD1);  // should it only be quiet, it stops
  // Looked up again, never at the lost worker, with "Abc" in its prompt.
  EXPECT_EQ(PhaseOf(id), Phase::kLookup);
  const std::vector<Sent> sent = link_.sent;
  ASSERT_EQ(sent.size(), 4u);  // the cancel, then three lookups
  for (size_t i = 1; i < sent.size(); ++i) {
    EXPECT_EQ(sent[i].m.body_case(), Body::kLookup);
    EXPECT_NE(sent[i].worker, kD1);
  }
  const auto& tokens = sent[1].m.lookup().tokens();
  EXPECT_EQ(std::string(tokens.begin(), tokens.end()), "HelloAbc");
  AnswerLookups(id);
  auto prepares = link_.Take(Body::kPrepare);
  ASSERT_EQ(prepares.size(), 1u);
  EXPECT_EQ(prepares[0].worker, kD0);
  EXPECT_EQ(prepares[0].m.prepare().generated_tokens(), 3);
  AnswerPrepare(kD0, id);
  auto prefills = link_.Take(Body::kPrefill);
  ASSERT_EQ(prefills.size(), 1u);
  EXPECT_EQ(prefills[0].m.prefill().generated_tokens(), 3);
  AnswerPrefill(prefills[0].worker, id, 'd', prefills[0].m.prefill().transfer_id());
  SendTokens(kD0, id, "e", true);
  std::string text;
  for (const JobEvent& ev : events_[id]) text += ev.text;
  EXPECT_EQ(text, "Abcde");  // one stream, unbroken
  EXPECT_EQ(events_[id].back().kind, JobEvent::Kind::kDone);
  EXPECT_EQ(events_[id].back().usage.completion_tokens, 5);
  EXPECT_EQ(events_[id].back().usage.prompt_tokens, 5);  // its first prefill's
}

TEST_F(RequestFlowTest, WithResumeOffALostDecodeWorkerFailsTheRequest) {
  options_.resume = false;
  const uint64_t id = Submit("Hello", 8);
  ToFirstToken(id, kP0, kD1);
  Down(kD1);
  EXPECT_EQ(flow_->size(), 0u);
  EXPECT_EQ(events_[id].back().error.code(), StatusCode::kUnavailable);
}

TEST_F(RequestFlowTest, ALateReplyToAnEarlierSendingIsIgnored) {
  const uint64_t id = Submit("Hello", 8);
  const proto::PrefillRequest pf = ToFirstToken(id, kP0, kD1);
  Down(kD1);
  AnswerLookups(id);
  AnswerPrepare(kD0, id);
  const auto prefills = link_.Take(Body::kPrefill);
  ASSERT_EQ(prefills.size(), 1u);
  EXPECT_NE(prefills[0].m.prefill().transfer_id(), pf.transfer_id());
  AnswerPrefill(prefills[0].worker, id, 'z', pf.transfer_id());  // the old one
  EXPECT_EQ(PhaseOf(id), Phase::kPrefill);
}

TEST_F(RequestFlowTest, CancellingReleasesTheWorkersThatHoldTheRequest) {
  const uint64_t id = Submit("Hello", 8);
  AnswerLookups(id);
  const size_t d = link_.Take(Body::kPrepare).at(0).worker;
  AnswerPrepare(d, id);
  const size_t p = link_.Take(Body::kPrefill).at(0).worker;
  EXPECT_TRUE(flow_->Cancel(id));
  auto cancels = link_.Take(Body::kCancel);
  ASSERT_EQ(cancels.size(), 2u);
  EXPECT_EQ(cancels[0].worker, d);
  EXPECT_EQ(cancels[1].worker, p);
  EXPECT_TRUE(events_[id].empty());
  EXPECT_FALSE(flow_->Cancel(id));
}

TEST_F(RequestFlowTest, PingsRenewTheReservationsOfRequestsWaitingForTheirPrefill) {
  // Each request to its prefill: prepared at its decode worker, its prefill
  // sent (and waiting in that worker's queue).
  const auto to_prefill = [&](uint64_t id, const std::string& prompt) {
    Submit(prompt, 8, id);
    for (size_t d : {kD0, kD1}) {
      const std::vector<uint64_t> held = flow_->HeldOn(d);
      EXPECT_EQ(std::count(held.begin(), held.end(), id), 0) << "nothing is prepared in a lookup";
    }
    return ToPrefill(id);
  };
  const auto [da, pfa, pa] = to_prefill(1, "Hello");
  EXPECT_EQ(flow_->HeldOn(da), std::vector<uint64_t>{1});
  const auto [db, pfb, pb] = to_prefill(2, "Hello world");
  std::vector<uint64_t> both = flow_->HeldOn(da);
  if (db != da) both.push_back(flow_->HeldOn(db).at(0));
  std::sort(both.begin(), both.end());
  EXPECT_EQ(both, (std::vector<uint64_t>{1, 2}));
  // 1's prefill answers: started, its reservation is no longer waiting.
  AnswerPrefill(pa, 1, 'x', pfa.transfer_id());
  EXPECT_EQ(PhaseOf(1), Phase::kDecode);
  EXPECT_EQ(flow_->HeldOn(db), std::vector<uint64_t>{2});
  if (da != db) {
    EXPECT_TRUE(flow_->HeldOn(da).empty());
  }
  (void)pfb;
  (void)pb;
}

TEST_F(RequestFlowTest, AReservationDroppedWhileThePrefillWaitsFailsTheRequestAndLetsThePrefillGo) {
  const uint64_t id = Submit("Hello", 8);
  const auto [d, pf, p] = ToPrefill(id);
  ASSERT_EQ(PhaseOf(id), Phase::kPrefill);
  proto::WorkerMessage m;
  auto* e = m.mutable_tokens()->add_events();
  e->set_token(-1);
  e->set_finished(true);
  control::StatusToProto(Status(StatusCode::kDeadlineExceeded, "its reservation lapsed"),
                         e->mutable_error());
  Reply(d, id, m);
  ASSERT_EQ(events_[id].size(), 1u);
  EXPECT_EQ(events_[id][0].kind, JobEvent::Kind::kError);
  EXPECT_NE(events_[id][0].error.message().find(workers_[d].name), std::string::npos)
      << events_[id][0].error.ToString();
  EXPECT_EQ(flow_->size(), 0u);
  auto cancels = link_.Take(Body::kCancel);
  ASSERT_EQ(cancels.size(), 2u);
  EXPECT_EQ(cancels[1].worker, p) << "the prefill worker drops it if it is still queued";
}

TEST_F(RequestFlowTest, ALookupPastItsDeadlineGoesOnWithTheAnswersItHas) {
  const uint64_t id = Submit("Hello", 8);
  for (const Sent& s : link_.Take(Body::kLookup)) {
    if (s.worker == kD1) continue;  // d1 never answers
    proto::WorkerMessage m;
    m.mutable_lookup_reply();
    Reply(s.worker, id, m);
  }
  EXPECT_EQ(PhaseOf(id), Phase::kLookup);
  flow_->Tick(RequestFlow::Clock::now() + options_.lookup_timeout + std::chrono::seconds(1));
  EXPECT_EQ(PhaseOf(id), Phase::kPrepare);
  EXPECT_EQ(link_.Take(Body::kPrepare).at(0).worker, kD0);
}

// Under load a live worker's answer can come late: past the lookup's
// deadline it counts as holding nothing, and the request is still served
// (by it, when no worker of its role answered at all); a worker down by
// then is left out.
TEST_F(RequestFlowTest, AWorkerSilentPastTheLookupsDeadlineCountsAsHoldingNothing) {
  const uint64_t id = Submit("Hello", 8);
  for (const Sent& s : link_.Take(Body::kLookup)) {
    if (s.worker == kP0 || s.worker == kP1) continue;  // no prefill worker answers in time
    proto::WorkerMessage m;
    m.mutable_lookup_reply()->set_prefix_tokens(0);
    Reply(s.worker, id, m);
  }
  workers_[kP1].up = false;  // and p1 is down by the deadline
  flow_->Tick(RequestFlow::Clock::now() + options_.lookup_timeout + std::chrono::seconds(1));
  ASSERT_EQ(PhaseOf(id), Phase::kPrepare);
  const size_t d = link_.Take(Body::kPrepare).at(0).worker;
  AnswerPrepare(d, id);
  const auto prefills = link_.Take(Body::kPrefill);
  ASSERT_EQ(prefills.size(), 1u);
  EXPECT_EQ(prefills[0].worker, kP0);
  // Its answer, arriving now, changes nothing.
  proto::WorkerMessage late;
  late.mutable_lookup_reply()->set_prefix_tokens(5);
  Reply(kP0, id, late);
  EXPECT_EQ(PhaseOf(id), Phase::kPrefill);
}

TEST_F(RequestFlowTest, NoWorkerOfARoleUpFailsAtOnce) {
  workers_[kP0].up = workers_[kP1].up = false;
  const uint64_t id = Submit("Hello");
  ASSERT_EQ(events_[id].size(), 1u);
  EXPECT_EQ(events_[id][0].error.code(), StatusCode::kUnavailable);
  EXPECT_TRUE(link_.sent.empty());
}

}  // namespace
}  // namespace kdn::router

namespace kdn::router {
namespace {

// --- The local path (docs/serving.md, "Two paths").

class LocalPathTest : public RequestFlowTest {
 protected:
  LocalPathTest() { options_.disaggregation = Disaggregation::kAuto; }
  // d1 holds 16 of the prompt and p0, p1 nothing: auto takes d1 locally.
  proto::PrepareRequest ToLocalPrefill(uint64_t id) {
    AnswerLookups(id, 0, 16);
    auto prepares = link_.Take(Body::kPrepare);
    EXPECT_EQ(prepares.size(), 1u);
    EXPECT_EQ(prepares.at(0).worker, kD1);
    EXPECT_TRUE(prepares.at(0).m.prepare().local_prefill());
    AnswerPrepare(kD1, id);
    EXPECT_EQ(PhaseOf(id), Phase::kPrefill);
    EXPECT_TRUE(link_.Take(Body::kPrefill).empty()) << "no prefill worker is asked";
    return prepares.at(0).m.prepare();
  }
};

TEST_F(LocalPathTest, TheDecodeWorkerPrefillsAndStreamsWithNoStart) {
  const uint64_t id = Submit("Hello world, again");
  const proto::PrepareRequest pr = ToLocalPrefill(id);
  EXPECT_EQ(ledger_.at(kD1).local_tokens, 18 - 16);
  EXPECT_EQ(ledger_.at(kP0).prefill_tokens + ledger_.at(kP1).prefill_tokens, 0);
  AnswerPrefill(kD1, id, 'A', pr.transfer_id());
  EXPECT_EQ(PhaseOf(id), Phase::kDecode);
  EXPECT_TRUE(link_.Take(Body::kStart).empty()) << "it runs already";
  SendTokens(kD1, id, "bc", /*finished=*/true);
  const auto& ev = events_[id];
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].text, "A");
  EXPECT_EQ(ev[1].text, "bc");
  EXPECT_EQ(ev[1].kind, JobEvent::Kind::kDone);
  EXPECT_EQ(flow_->size(), 0u);
}

TEST_F(LocalPathTest, TheRoutersFlagAndTheRequestsFieldForceEitherPath) {
  options_.disaggregation = Disaggregation::kAlways;
  Submit("Hello world, again", 8, 1);
  AnswerLookups(1, 0, 16);
  auto prepares = link_.Take(Body::kPrepare);
  ASSERT_EQ(prepares.size(), 1u);
  EXPECT_FALSE(prepares[0].m.prepare().local_prefill());
  // A request's own field overrides the router's.
  Job job;
  const std::string prompt = "Hello world, again";
  job.tokens.assign(prompt.begin(), prompt.end());
  job.sampling.temperature = 0;
  job.disaggregation = Disaggregation::kNever;
  flow_->Submit(
      2, std::move(job), [this](JobEvent ev) { events_[2].push_back(ev); },
      RequestFlow::Clock::now());
  AnswerLookups(2, 0, 0);
  prepares = link_.Take(Body::kPrepare);
  ASSERT_EQ(prepares.size(), 1u);
  EXPECT_TRUE(prepares[0].m.prepare().local_prefill());
}

TEST_F(LocalPathTest, AFailedLocalPrefillFailsTheRequest) {
  const uint64_t id = Submit("Hello world, again");
  ToLocalPrefill(id);
  proto::WorkerMessage m;
  auto* e = m.mutable_tokens()->add_events();
  e->set_token(-1);
  e->set_finished(true);
  control::StatusToProto(Internal("engine failed"), e->mutable_error());
  Reply(kD1, id, m);
  ASSERT_EQ(events_[id].size(), 1u);
  EXPECT_EQ(events_[id][0].kind, JobEvent::Kind::kError);
  EXPECT_EQ(flow_->size(), 0u);
}

TEST_F(LocalPathTest, ADecodeWorkerLostMidLocalPrefillResumesOnThePrefillWorkersPath) {
  const uint64_t id = Submit("Hello world, again");
  ToLocalPrefill(id);
  Down(kD1);
  EXPECT_EQ(PhaseOf(id), Phase::kLookup);  // resumed: asked again, d1 left out
  AnswerLookups(id, 0, 0);
  auto prepares = link_.Take(Body::kPrepare);
  ASSERT_EQ(prepares.size(), 1u);
  EXPECT_EQ(prepares[0].worker, kD0);
  EXPECT_FALSE(prepares[0].m.prepare().local_prefill()) << "a resumed request is not local";
  AnswerPrepare(kD0, id);
  auto prefills = link_.Take(Body::kPrefill);
  ASSERT_EQ(prefills.size(), 1u);
  AnswerPrefill(prefills[0].worker, id, 'A', prefills[0].m.prefill().transfer_id());
  ASSERT_EQ(link_.Take(Body::kStart).size(), 1u);
  SendTokens(kD0, id, "bc", true);
  ASSERT_EQ(events_[id].size(), 2u);
  EXPECT_EQ(events_[id][0].text + events_[id][1].text, "Abc");
}

TEST_F(LocalPathTest, ACancelledLocalPrefillIsCancelledOnceAtItsDecodeWorker) {
  const uint64_t id = Submit("Hello world, again");
  ToLocalPrefill(id);
  EXPECT_TRUE(flow_->Cancel(id));
  const auto cancels = link_.Take(Body::kCancel);
  ASSERT_EQ(cancels.size(), 1u);
  EXPECT_EQ(cancels[0].worker, kD1);
}

// Pins (docs/serving.md, "Pinning a prefix"): a request's cache_control
// pins the whole chunks of its prefix at every worker; a later request that
// reaches the pin shows it in its usage; past the tenant's bound, 429.
TEST_F(RequestFlowTest, APinnedPrefixIsKeptAtEveryWorkerAndShownInUsage) {
  PinBook pins(100 * 40);  // 100 tokens at 40 bytes each
  Start();
  flow_->SetPins(&pins, 40);
  auto submit = [&](uint64_t id, const std::string& prompt, std::optional<PinSpec> pin) {
    Job job;
    job.tokens.assign(prompt.begin(), prompt.end());
    job.max_tokens = 2;
    job.pin = pin;
    job.tenant = "t";
    flow_->Submit(
        id, std::move(job), [this, id](JobEvent ev) { events_[id].push_back(ev); },
        RequestFlow::Clock::now());
  };
  const std::string context(40, 'c');  // two whole chunks of 16, and 8 more
  submit(1, context + "question one", PinSpec{40, std::chrono::seconds(60)});
  std::vector<Sent> keeps;
  for (Sent& s : link_.sent) {
    if (s.m.body_case() == Body::kKeep) keeps.push_back(s);
  }
  ASSERT_EQ(keeps.size(), 4u);  // every worker
  EXPECT_EQ(keeps[0].m.keep().keys_size(), 2);
  EXPECT_EQ(keeps[0].m.keep().lease_ms(), 60000u);
  ToFirstToken(1, kP0, kD0);
  SendTokens(kD0, 1, "y", true);
  ASSERT_EQ(events_[1].back().kind, JobEvent::Kind::kDone);
  EXPECT_EQ(events_[1].back().usage.pinned_tokens, 32);
  EXPECT_GT(events_[1].back().usage.pin_expires_at, 0);
  ASSERT_EQ(pins.List("t", RequestFlow::Clock::now()).size(), 1u);

  // Another question over the same context reaches the pin.
  submit(2, context + "question two", std::nullopt);
  ToFirstToken(2, kP1, kD1);  // the first one's reservations are on p0 and d0
  SendTokens(kD1, 2, "z", true);
  EXPECT_EQ(events_[2].back().usage.pinned_tokens, 32);
  EXPECT_EQ(pins.List("t", RequestFlow::Clock::now()).at(0).hits, 1u);

  // A pin of 96 tokens more would take the tenant past 100: refused before
  // any worker is asked.
  link_.sent.clear();
  submit(3, std::string(100, 'd'), PinSpec{100, std::chrono::seconds(60)});
  ASSERT_EQ(events_[3].size(), 1u);
  EXPECT_EQ(events_[3][0].kind, JobEvent::Kind::kError);
  EXPECT_EQ(events_[3][0].error.code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(link_.sent.empty());
  // Shorter than a chunk: nothing to pin, served as any request.
  submit(4, "short", PinSpec{5, std::chrono::seconds(60)});
  EXPECT_EQ(PhaseOf(4), Phase::kLookup);
  EXPECT_TRUE(link_.Take(Body::kKeep).empty());
}

// Lookups from the event stream (docs/serving.md): a worker whose KV events
// the router follows in sync is not asked about a request without
// documents; its prefix is what its events say it holds. Asked as ever: for
// a blend request, and at a worker with a shared tier.
TEST_F(RequestFlowTest, AWorkerWhoseEventsAreFollowedIsNotAskedAndPlacedByThem) {
  const std::string prompt(40, 'e');  // two chunks of 16, and 8 more
  const std::vector<int32_t> tokens(prompt.begin(), prompt.end());
  const std::vector<kvbus::ChunkKey> keys =
      kvbus::PrefixKeys({identity_.fingerprint, "", identity_.chunk_tokens}, tokens);
  ASSERT_EQ(keys.size(), 2u);
  auto pub = kvbus::KvEventPublisher::Start({.endpoint = "tcp://127.0.0.1:0",
                                             .replay_endpoint = "tcp://127.0.0.1:0",
                                             .batch_window = std::chrono::milliseconds(1)});
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  (*pub)->Publish({.kind = kvbus::KvEvent::Kind::kStored,
                   .keys = keys,
                   .tokens = std::vector<int32_t>(32, 'e'),
                   .block_size = 16});
  KvFollower follower;
  follower.Follow(kP1, (*pub)->endpoint(), (*pub)->replay_endpoint(), "", "s1");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (follower.Prefix(kP1, keys) != 2u && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(follower.Prefix(kP1, keys), 2u) << "the follower never caught up";
  Start();
  flow_->SetFollower(&follower);

  const uint64_t id = Submit(prompt);
  std::vector<size_t> asked;
  for (const Sent& s : link_.sent) asked.push_back(s.worker);
  EXPECT_EQ(asked, (std::vector<size_t>{kP0, kD0, kD1}));
  // The others hold nothing: the prefill goes to p1, which holds two chunks
  // (ToFirstToken checks where it went).
  ToFirstToken(id, kP1, kD0);

  // A blend request asks every worker (about its documents too).
  link_.sent.clear();
  Job blend;
  blend.tokens = tokens;
  blend.max_tokens = 2;
  blend.blend = BlendSpec{};
  blend.blend->head_tokens = 1;
  blend.blend->segment_tokens = {30};
  flow_->Submit(
      2, std::move(blend), [](JobEvent) {}, RequestFlow::Clock::now());
  EXPECT_EQ(link_.Take(Body::kLookup).size(), 4u);

  // So does a worker with a shared tier, whose lookups reach more than its
  // host tier announces.
  proto::StoreTier shared;
  shared.set_held_here(false);
  workers_[kP1].store_tiers = {shared};
  Submit(prompt, 8, 3);
  EXPECT_EQ(link_.Take(Body::kLookup).size(), 4u);
}

}  // namespace
}  // namespace kdn::router
