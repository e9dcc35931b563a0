#pragma once
// Decoder: the decode worker's executor (docs/serving.md, "The decode
// worker: scheduler and executor"), driven by DecodeService as Prefiller is
// by PrefillService. DecodeScheduler decides; the Decoder carries its plans
// out: it reserves, loads and places KV, runs the engine (local prefill
// pieces, the Batcher's decode steps), preempts and resumes, stores
// finished conversations, and reports events. A request's life (Prepare,
// Start, Advance, Finish) is told in the docs.
//
// Events: every id that Prepare returns ends with exactly one TokenEvent
// whose `finished` is set ("cancelled" after Cancel; `error` set when it
// failed: the slices never arrived, the batch was full, a decode step
// failed, or it was prepared and neither started nor renewed within
// prepare_timeout). After that event the id is unknown to the Decoder.
//
// KDN store I/O: every Get, Contains and Put on `store` runs on the store
// I/O thread (`store_io`, a JobThread; the worker's lookups have their own),
// never on the caller's thread. Jobs hold the store and a mailbox shared
// with the Decoder, never the Decoder or the KV cache, so the Decoder may be
// destroyed with jobs still queued. A failed load leaves the rest of the
// prompt to the prefill worker; a failed Put is logged and counted and costs
// only reuse; when more than max_pending_store_bytes wait to be stored, a
// finished conversation is not stored (counted too).
//
// Threads: not thread-safe. One thread (the worker's compute thread) makes
// every call, and is the only one to use the Model while the Decoder lives.
// `model`, `tokenizer`, `staging` and `store_io` must outlive the Decoder;
// `store`, and whatever `on_load_done` touches, must outlive every job on
// `store_io` (stop the JobThread before destroying them).

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "kdn/common/job_thread.h"
#include "kdn/common/status.h"
#include "kdn/kvbridge/prefix_kv.h"
#include "kdn/decode_worker/batcher.h"
#include "kdn/decode_worker/decode_request.h"
#include "kdn/decode_worker/decode_scheduler.h"
#include "kdn/decode_worker/slice_landing.h"
#include "kdn/engine/engine.h"
#include "kdn/text/tokenizer.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/kv_events.h"
#include "kdn/kvbus/transfer_plan.h"

namespace kdn::decode_worker {

struct DecoderOptions {
  int chunk_tokens = kvbus::kDefaultChunkTokens;
  int max_batch = 32;
  // A prepared request neither started nor renewed (Renew) this long after
  // Prepare or its last renewal is dropped. Its router renews it with every
  // ping (250 ms) while its prefill is queued or running, so this lapses
  // only for a request its router no longer has (docs/serving.md,
  // "Reservations").
  std::chrono::milliseconds prepare_timeout{60000};
  // Bytes of finished conversations' chunks waiting for the store I/O
  // thread above which a finished conversation is not stored.
  uint64_t max_pending_store_bytes = uint64_t{1} << 30;
  // The shortest tail match used (kvbus::MatchPrefix).
  int64_t min_tail_tokens = kvbus::kMinTailTokens;
  // Called on the store I/O thread when a load is in, so that the compute
  // loop calls Advance. Must be quick and must not call the Decoder.
  std::function<void()> on_load_done;
  // Keep finished conversations resident in the pool and attach them
  // (false: every prefix is loaded from the KDN; for benchmarks).
  bool resident = true;
  // The most prompt tokens of local prefills computed between two decode
  // steps while requests run (none run: all at once). Bounds what a local
  // prefill adds to the running streams' inter-token latency.
  int local_prefill_step_tokens = 64;
  // SchedulerOptions::admission_reserve: the share of the pool a new
  // request leaves free while others hold blocks.
  double admission_reserve = 0.01;
  // Where pushed slices land in place (borrowed; outlives the Decoder);
  // null: in the staging tier. Needs a pool addressable as one region
  // (engine::KvCache::Memory).
  SliceLanding* landing = nullptr;
  // Blocks of a request dropped while a sender may still write into them
  // (SliceLanding::Forget) are reused only this long after: the kvbus
  // receiver's lease.
  std::chrono::milliseconds landing_quarantine{30000};
  // Time for prepare_timeout; steady_clock::now when empty (tests inject one).
  std::function<std::chrono::steady_clock::time_point()> clock;
  // The worker's KV event stream (kdn/kvbus/kv_events.h), borrowed: the
  // full chunks of each prompt and finished conversation are described to
  // it. Null: no stream.
  kvbus::HostTierEvents* events = nullptr;
};

struct DecoderStats {
  int prepared = 0;  // prepared and not started (loads out included)
  int running = 0;   // in the batch
  int free_kv_blocks = 0;
  int total_kv_blocks = 0;
  uint64_t chunks_loaded = 0;        // chunks and tail pieces placed from the KDN at Prepare
  uint64_t kv_bytes_loaded = 0;      // their KV, copied into the pool
  uint64_t resident_hit_tokens = 0;  // prompt tokens attached from the pool at Prepare
  engine::ResidentStats resident;    // the pool's resident index
  // Of finished conversations' chunks handed to the store I/O thread:
  uint64_t chunks_stored = 0;         // Put
  uint64_t chunks_already_held = 0;   // not Put: the store had them
  uint64_t chunks_store_failed = 0;   // a Put failed: that chunk and the rest of its conversation
  uint64_t chunks_store_dropped = 0;  // never handed over: too many bytes waiting
  uint64_t store_bytes_pending = 0;   // handed over, not yet stored
  // Local prefill (placement's inputs and /metrics):
  int64_t local_backlog_tokens = 0;   // prompt tokens of local prefills still to compute
  double step_ms = 0;                 // decode steps, recent average (0: none yet)
  double prefill_ms_per_token = 0;    // local prefill pieces, recent average (0: none yet)
  uint64_t local_prefills = 0;        // finished (first token drawn)
  uint64_t local_prefill_tokens = 0;  // prompt tokens computed by local prefills
  // Pushed KV: slices that landed in place, and bytes copied into blocks at
  // Start from the staging tier (0 when every slice landed in place).
  uint64_t slices_landed = 0;
  uint64_t start_copy_bytes = 0;
  int quarantined_blocks = 0;  // held back from reuse, now (landing_quarantine)
  // Free blocks a new request must leave while others hold blocks
  // (admission_reserve of the pool; 0 while none do).
  int64_t admission_reserve_blocks = 0;
  // Preemption: requests waiting to resume now, and the KV blocks
  // their resumes need; preemptions so far; resumes that found all the KV
  // stored at preemption (pool or KDN) and those that recomputed some, and
  // the tokens recomputed.
  int preempted = 0;
  int64_t resume_kv_blocks = 0;
  uint64_t preemptions = 0;
  uint64_t resumed_by_load = 0;
  uint64_t resumed_by_recompute = 0;
  uint64_t resume_recomputed_tokens = 0;
};

class Decoder {
 public:
  // `fingerprint` is the model's (chunks of another model are never
  // placed); `store` is the worker's KDN view; `staging` is where the kvbus
  // receiver puts pushed layer slices. All borrowed (see above).
  Decoder(engine::Engine& model, const text::Tokenizer& tokenizer, kvbus::ChunkKey fingerprint,
          kvbus::ChunkStore& store, kvbus::HostTier& staging, JobThread& store_io,
          DecoderOptions options);
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  // Step 1. Returns the request's id. INVALID_ARGUMENT for an empty prompt,
  // one that leaves no room in the model's context, ids outside the
  // vocabulary, max_tokens < 1 or bad sampling parameters;
  // RESOURCE_EXHAUSTED when too few KV blocks are free for what it needs now
  // (KvTokensAdmitted) or preempted requests wait to resume; INVALID_ARGUMENT
  // too when its whole length (prompt + max_tokens) passes the pool. On
  // error nothing is held. A blended prompt (nothing to load) gets its
  // PrepareDone in `out` at once. INVALID_ARGUMENT too for a local prefill
  // of a blended or resumed request (those keep the prefill worker's path).
  Result<uint64_t> Prepare(DecodeRequest request, DecoderOutput* out);

  // Step 2. NOT_FOUND, with nothing changed, when `id` is not a prepared
  // request (unknown, started, finished or dropped); INVALID_ARGUMENT when a
  // Start for it is already waiting, or it is prefilled here (it needs none). Otherwise OK, and the
  // request either runs (its first event in `out`), fails (its finished event with `error` in
  // `out`), or waits for its load (a later Advance does the rest). `first_token_sent`: the router
  // has sent the first token to the client itself, so the request's events begin at the second
  // (RequestSpec). `kv_tokens`: the KV slots the prefill worker pushed, when
  // fewer than the prompt's tokens (a blend over pruned documents; 0: one
  // per token); the request goes on at the prompt's length all the same.
  // `kv_holes`: those slots' holes (StartRequest.kv_holes, a blend over a
  // document pruned per head), set once the KV is placed.
  // INVALID_ARGUMENT for kv_tokens or holes on a request that is not
  // blended, kv_tokens past its prompt, or holes of another size.
  Status Start(uint64_t id, int32_t first_token, bool first_token_sent, DecoderOutput* out,
               int64_t kv_tokens = 0, std::string kv_holes = {});

  // Its router still wants prepared request `id` (its prefill is queued or
  // running): prepare_timeout counts from now. False, with nothing changed,
  // when `id` is not a prepared request.
  bool Renew(uint64_t id);

  // Ends a prepared, running or preempted request: its "cancelled" event in
  // `out`, its blocks free when this returns (a running request's
  // conversation is stored as for any finish). NOT_FOUND when `id` is not
  // here.
  Status Cancel(uint64_t id, DecoderOutput* out);

  // Takes in the loads that are in (PrepareDone, then any Start waiting for
  // them), then carries out the scheduler's plan: drops prepared requests
  // past prepare_timeout, admits the local prefills whose first token the
  // last Advance reported, reserves blocks for the resumes that fit,
  // computes the planned local prefill pieces (a failed one fails its
  // request; a finished one's first token goes out now, and the decode step
  // with the next Advance), preempts as the step needs and runs one decode
  // step for the batch. A failed step fails every running request.
  void Advance(DecoderOutput* out);

  // Whether Advance has work now (running requests, loads that are in,
  // local prefills ready to compute or whose first token went out, a
  // preempted request that fits), so that a driver knows when it may sleep.
  bool Busy() const;

  DecoderStats Stats() const;

 private:
  using TimePoint = std::chrono::steady_clock::time_point;
  // A preempted request on its way back: prepared as a local prefill of
  // its prompt and generated tokens but the last (which need no logits:
  // `pending`, drawn before, is the token it goes on from).
  struct Resume {
    int32_t pending = -1;
    int64_t stored_tokens = 0;  // published and stored at preemption
  };
  // From Prepare to Start.
  struct Prepared {
    DecodeRequest request;
    std::vector<kvbus::ChunkKey> keys;  // the prompt's prefix keys; none when blended
    engine::KvSequence seq;             // blocks for the whole prompt
    int64_t resident_tokens = 0;        // leading tokens attached from the pool
    int64_t held_tokens = -1;           // -1 while the load is out
    // The KV slots pushed (StartRequest.kv_tokens): fewer than the prompt's
    // tokens over pruned documents; 0 until the Start, or one per token.
    int64_t kv_tokens = 0;
    std::string kv_holes;          // their holes (StartRequest.kv_holes); empty: none
    std::optional<int32_t> start;  // its Start's first token (it may wait for the load)
    int32_t local_first = -1;      // a local prefill's first token, once drawn
    uint64_t kv_bytes_loaded = 0;  // placed from the lower tiers
    std::optional<Resume> resume;  // set: a preempted request resuming
  };
  // From Start to the finish: what storing the conversation needs.
  struct Running {
    std::vector<int32_t> prompt;
    std::string ns;
    bool blended = false;
    int64_t held_tokens = 0;  // leading tokens the KDN gave: their full chunks not stored again
    uint64_t request_id = 0;  // the router's (DecodeRequest::request_id)
  };
  // Preempted, waiting to resume: the Prepared it resumes as.
  struct Preempted {
    DecodeRequest request;  // prompt + generated but the last; spec.generated those
    Resume resume;
  };
  struct Mailbox;  // shared with the store I/O thread's jobs
  using LoadedSpan = kvbus::FetchedSpan;

  // Engine and chunk-bridge calls all live in the few helpers below (and in
  // the Batcher's decode step), so that a backend interface replaces them in
  // one place.
  Status ValidateRequest(const DecodeRequest& r) const;
  Status ReserveKv(Prepared& p);
  // Places a load's chunks and tail pieces, in order, up to the first that
  // does not go in; returns the leading tokens placed.
  int64_t PlaceLoaded(Prepared& p, const std::vector<LoadedSpan>& loaded);
  // Takes the slices that landed in place (`landed`) and copies the others
  // from the staging tier.
  Status PlacePushedSlices(Prepared& p, const std::set<kvbus::ChunkKey>& landed);
  // The regions of its first `kv_tokens` the prefill worker pushes to
  // request `p`: past the tokens it holds, each named for it alone.
  std::vector<kvbus::KvRegion> PushedRegions(const Prepared& p, int64_t kv_tokens) const;
  // Erases from staging the slices pushed for this request, which only
  // PlacePushedSlices would otherwise have taken.
  void DropOwnSlices(const Prepared& p);
  // Registers with the SliceLanding the slices prepared request `id` will
  // be pushed, each where it goes in its blocks (its load is in).
  void ExpectSlices(uint64_t id, const Prepared& p);
  // A prepared request leaves without starting: its slices are forgotten
  // and its blocks, should a sender still be writing, held back.
  void Drop(uint64_t id, Prepared p);
  // Keeps `seq`'s blocks from reuse for landing_quarantine; ReleaseHeldBack
  // (Prepare, Advance) frees those whose time is up.
  void HoldBack(uint64_t request_id, engine::KvSequence seq);
  void ReleaseHeldBack();
  TimePoint Now() const;  // options_.clock, or steady_clock
  // `request_id` (the router's) is for log lines.
  std::vector<std::shared_ptr<const kvbus::Chunk>> CopyOutChunks(
      uint64_t request_id, const engine::KvSequence& seq,
      const std::vector<kvbus::KeyedSpan>& spans);
  uint64_t ChunkBytes(int64_t tokens) const;  // a chunk of `tokens` tokens, serialized

  void PostLoad(uint64_t id, const Prepared& p);
  void PostStore(uint64_t request_id, std::vector<std::shared_ptr<const kvbus::Chunk>> chunks,
                 int lane);
  // Assembles and admits a prepared request whose load is in.
  void Begin(uint64_t id, int32_t first_token, DecoderOutput* out);
  // Admits `p` (its prompt's KV all in its sequence) into the batch.
  Status Admit(uint64_t id, Prepared p, int32_t first_token, DecoderOutput* out);
  // The KV of local prefill `id` past what the pool and the KDN gave is
  // computed on top of it.
  void QueueLocal(Prepared& p);
  // Carries out one planned piece of a local prefill or resume. A local
  // prefill's last piece draws its first token, which goes out with this
  // Advance; publishing and storing its prompt's KV and admitting it wait
  // for the next plan (AdmitLocal).
  void RunPiece(const PrefillPiece& piece, DecoderOutput* out);
  // The prepared request a piece computes, or null when it is gone or the
  // piece is not where the plan put it.
  Prepared* PieceTarget(const PrefillPiece& piece);
  // After a piece's tokens were computed in `ms` (its last token's logits
  // in `logits`): the counters, and for a last piece its first token or
  // its resume.
  void PieceDone(const PrefillPiece& piece, Prepared& p, const std::vector<float>& logits,
                 double ms, DecoderOutput* out);
  // The plan's pieces computed in the decode step's pass (docs/serving.md,
  // "The decode worker: scheduler and executor"); false, with nothing
  // done, when that pass fails (then the pieces and the step run apart, so
  // that a failure falls on whom it concerns).
  bool StepWithPieces(const std::vector<PrefillPiece>& pieces, DecoderOutput* out);
  // Local prefill `id`, whose first token went out: its prompt's KV
  // published and stored, then admitted into the batch.
  void AdmitLocal(uint64_t id, DecoderOutput* out);
  // The prompt tokens a prepared request may take from the pool and the
  // KDN: all of them, or all but the last when it is prefilled here (the
  // last is computed for its logits; a resume needs none).
  static int64_t HeldLimit(const Prepared& p);
  // The shortest tail match it takes: any for a resume (its tail was
  // stored whole), else options.min_tail_tokens.
  int64_t MinTail(const Prepared& p) const;
  // Preempts `candidates`, in order, until the next step's blocks are free
  // (none left: the step fails as before).
  void MakeRoomForStep(const std::vector<uint64_t>& candidates);
  void Preempt(uint64_t id);
  // Reserves blocks for preempted request `id` and loads or queues its KV;
  // false, with it preempted still, when the blocks are not there.
  bool StartResume(uint64_t id);
  int64_t ResumeBlocks(const Preempted& q) const;
  // A resume whose KV is all in its sequence rejoins the batch.
  void FinishResume(uint64_t id, DecoderOutput* out);
  // Publishes the spans of `tokens` (the KV `seq` holds) in the pool, and
  // hands those past the first `held_tokens`' full chunks to the store.
  // `lane`: the store I/O thread's lane (a preemption's go ahead of the
  // loads that follow, its resume's among them).
  void PublishAndStore(uint64_t request_id, const engine::KvSequence& seq,
                       std::span<const int32_t> tokens, int64_t held_tokens, const std::string& ns,
                       int lane = kStoreLane);
  // The Batcher's finish hook: hands the conversation's chunks to the store.
  void StoreConversation(uint64_t id, const engine::KvSequence& seq,
                         const std::vector<int32_t>& generated);
  static TokenEvent Failure(uint64_t id, Status st);

  // Constant after construction.
  engine::Engine& model_;
  const kvbus::ChunkKey fingerprint_;
  kvbus::ChunkStore& store_;
  kvbus::HostTier& staging_;
  JobThread& store_io_;
  const DecoderOptions options_;
  std::shared_ptr<Mailbox> mailbox_;

  // The calling thread's alone.
  DecodeScheduler scheduler_;
  std::unique_ptr<Batcher> batcher_;
  std::map<uint64_t, Prepared> prepared_;
  std::map<uint64_t, Running> running_;
  uint64_t next_id_ = 1;
  uint64_t chunks_loaded_ = 0;
  uint64_t kv_bytes_loaded_ = 0;
  uint64_t resident_hit_tokens_ = 0;
  uint64_t chunks_store_dropped_ = 0;
  std::deque<std::pair<TimePoint, engine::KvSequence>> quarantine_;  // by release time
  uint64_t start_copy_bytes_ = 0;
  double step_ms_ = 0;  // recent averages (exponential)
  double prefill_ms_per_token_ = 0;
  uint64_t local_prefills_ = 0;
  uint64_t local_prefill_tokens_ = 0;
  std::map<uint64_t, Preempted> preempted_;  // by id
  uint64_t preemptions_ = 0;
  uint64_t resumed_by_load_ = 0;
  uint64_t resumed_by_recompute_ = 0;
  uint64_t resume_recomputed_tokens_ = 0;
};

}  // namespace kdn::decode_worker
