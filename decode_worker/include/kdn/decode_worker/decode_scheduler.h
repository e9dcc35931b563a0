#pragma once
// DecodeScheduler: the decode worker's decisions, with no engine, store or
// socket (docs/serving.md, "The decode worker: scheduler and executor").
// It follows each request through its phases and, once per Decoder::Advance,
// turns the free KV blocks and the time into a StepPlan; the Decoder carries
// the plan out (engine calls, KV placement, events) and tells the scheduler
// what only the carrying out can know: that a load is in, a Start came, a
// request was preempted, or a planned action failed.
//
// A request's phases:
//   kLoading    prepared; a load from the KDN is out
//   kReady      prepared, its load in; it waits for its Start
//   kLocal      prefilled here: its tokens past `have` are computed in
//               pieces between decode steps (a resume too: the tokens the
//               pool and the KDN no longer held)
//   kFirstSent  a local prefill whose first token went out; the next plan
//               admits it
//   kRunning    in the batch
//   kPreempted  out of the batch for want of blocks, holding none
//
// What it decides:
// - Admission (CanPrepare, LeavesReserve): a place in the batch (running,
//   prepared and preempted requests count), no preempted request waiting,
//   and, while other requests hold blocks, a reserve of free blocks left
//   after the reservation (admission_reserve of the pool) for the running
//   requests to grow into.
// - Expiry: a prepared request, not prefilled here, neither started nor
//   renewed for prepare_timeout.
// - Resumes: preempted requests, oldest admitted first, while the free
//   blocks hold each one's resume blocks and a block per running request.
// - Local prefill: pieces, oldest request first, of at most
//   local_prefill_step_tokens a plan while requests run (idle_prefill_tokens
//   when none run), each at most max_prefill_tokens. A plan that completes a
//   local prefill runs no decode step (its first token goes out first), and
//   the next plan steps before it computes anything.
// - Preemption: the running requests that may be preempted for the step,
//   newest admitted first, never a blended one. Only the KV cache knows how
//   many blocks a preemption frees (a request's blocks may be shared with
//   the pool's resident spans), so the Decoder preempts them in that order
//   until the step's blocks are free.
//
// Schedule commits its plan to the scheduler's own state: expired requests
// are gone, admitted and completed resumes run, planned pieces are counted
// computed, a completed local prefill's first token is out. The Decoder
// calls Forget for a planned action that failed and ResumeDeferred for a
// resume the cache could not reserve.
//
// Not thread-safe: the Decoder's thread alone calls it.

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::decode_worker {

struct SchedulerOptions {
  int max_batch = 32;
  // A prepared request neither started nor renewed this long is dropped.
  std::chrono::milliseconds prepare_timeout{60000};
  // The most prompt tokens of local prefills computed between two decode
  // steps while requests run.
  int64_t local_prefill_step_tokens = 64;
  // The most prompt tokens of local prefills one plan computes while none
  // run (at least local_prefill_step_tokens): whole prompts and large
  // pieces compute faster than small ones, and the worker answers its
  // routers between plans, so a plan of every queued prompt at once could
  // outlast a router's wait for a prepare's reply.
  int64_t idle_prefill_tokens = 2048;
  // The most prompt tokens one engine prefill call takes.
  int64_t max_prefill_tokens = INT64_MAX;
  // The share of the pool's blocks a new request must leave free, while
  // others hold blocks (vLLM keeps 1%): room for the running requests to
  // grow, so that one admitted just now is not preempted a few tokens later.
  double admission_reserve = 0.01;
};

enum class RequestPhase { kLoading, kReady, kLocal, kFirstSent, kRunning, kPreempted };

// A prepared request (or a resume) as the scheduler sees it.
struct PreparedInfo {
  bool local = false;    // prefilled here (a resume is)
  bool blended = false;  // never preempted
  int64_t tokens = 0;    // its sequence's tokens: prompt, and a resume's generated ones
  int64_t have = 0;      // leading tokens whose KV it holds now
  bool loading = false;  // a load from the KDN is out
};

// Tokens [first, first + count) of a local prefill's (or resume's) sequence
// to compute; count 0: a resume with nothing left to compute.
struct PrefillPiece {
  uint64_t id = 0;
  int64_t first = 0;
  int64_t count = 0;
  bool last = false;    // its KV is whole after this piece
  bool resume = false;  // a resume: it rejoins the batch after its last piece
};

struct StepPlan {
  std::vector<uint64_t> expire;  // prepared requests to drop, past prepare_timeout
  std::vector<uint64_t> admit;   // local prefills whose first token went out
  std::vector<uint64_t> resume;  // preempted requests to reserve blocks for, in order
  std::vector<PrefillPiece> prefill;
  bool step = false;              // run one decode step for the batch
  std::vector<uint64_t> preempt;  // with step: who may be preempted for it, in order
};

class DecodeScheduler {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  explicit DecodeScheduler(SchedulerOptions options) : options_(options) {}

  // RESOURCE_EXHAUSTED when the batch is full (running, prepared and
  // preempted requests) or preempted requests wait to resume.
  Status CanPrepare() const;
  // After a new request's reservation: RESOURCE_EXHAUSTED when it leaves
  // fewer than the reserve free while other requests hold blocks.
  Status LeavesReserve(int64_t free_blocks, int64_t total_blocks) const;
  // That reserve, of a pool of `total_blocks`: 0 while no request is here.
  int64_t ReserveBlocks(int64_t total_blocks) const;

  // A new request was prepared (its blocks reserved) at `now`.
  void Prepared(uint64_t id, const PreparedInfo& info, TimePoint now);
  // Its load is in: its KV holds `have` leading tokens. What comes next:
  enum class Next { kWaitForStart, kBegin, kCompute };
  Next LoadIn(uint64_t id, int64_t have);
  // Its Start came: true when it begins now, false when it waits for its
  // load (LoadIn then says kBegin).
  bool StartCame(uint64_t id);
  // It joins the batch now (a Start's, or a cancelled local prefill's whose
  // first token went out).
  void Started(uint64_t id);
  // Its router still wants it; false when `id` is not prepared here.
  bool Renew(uint64_t id, TimePoint now);
  // A running request left the batch for want of blocks; it resumes as a
  // local prefill of `tokens` (its prompt and generated tokens but the
  // last), which takes `resume_blocks`.
  void Preempted(uint64_t id, int64_t tokens, int64_t resume_blocks);
  // A planned resume reserved its blocks: its KV holds `have` leading
  // tokens, and a load may be out for more.
  void Resumed(uint64_t id, int64_t have, bool loading, TimePoint now);
  // A planned resume the KV cache could not reserve: it waits on.
  void ResumeDeferred(uint64_t id);
  // The request is gone (finished, cancelled, failed, dropped).
  void Forget(uint64_t id);

  // The plan for one Advance, committed (see above).
  StepPlan Schedule(TimePoint now, int64_t free_blocks);

  // Whether a plan now would do anything besides expiry.
  bool HasWork(int64_t free_blocks) const;

  std::optional<RequestPhase> Phase(uint64_t id) const;
  struct Counts {
    int prepared = 0;  // loading, ready, local, first token out
    int running = 0;
    int preempted = 0;
    int64_t resume_blocks = 0;         // of the preempted requests
    int64_t local_backlog_tokens = 0;  // of local prefills and resumes, still to compute
  };
  Counts counts() const;

 private:
  struct Entry {
    RequestPhase phase = RequestPhase::kLoading;
    bool local = false;
    bool blended = false;
    bool resume = false;  // preempted, on its way back
    bool start_waiting = false;
    TimePoint renewed;
    int64_t tokens = 0;
    int64_t have = 0;
    uint64_t order = 0;  // its admission's: the newest is preempted first
    int64_t resume_blocks = 0;
  };
  Entry* Find(uint64_t id);
  void Run(Entry& e);  // into the batch; a new admission gets the next order
  void PlanPrefill(StepPlan& plan);
  int Running() const;

  const SchedulerOptions options_;
  std::map<uint64_t, Entry> entries_;
  std::deque<uint64_t> local_queue_;        // kLocal, oldest first
  std::deque<uint64_t> first_sent_;         // kFirstSent, oldest first
  std::map<uint64_t, uint64_t> preempted_;  // order -> id: oldest admitted first
  uint64_t next_order_ = 0;
  // The last plan sent first tokens and put off the running requests' step.
  bool step_owed_ = false;
};

}  // namespace kdn::decode_worker
