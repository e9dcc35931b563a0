#pragma once
// Decoder: the decode worker's request logic (docs/serving.md, "One request,
// on the wire", steps 2 and 4), driven by DecodeService as Prefiller is by
// PrefillService. A request's life:
//
//  1. Prepare: the request is checked, the longest prefix of its prompt
//     that the KV pool holds resident (a conversation this worker finished,
//     kvbridge/resident.h) is attached by reference, KV blocks are reserved
//     for the rest of the prompt and a growth margin (KvTokensAdmitted: what
//     it needs now, not its whole max_tokens), and a load of the leading chunks past
//     the resident ones that the KDN holds, then of the tail pieces past
//     them (docs/kvbus.md, "Tail keys"), is queued on the store I/O thread
//     (none when the pool holds all but less than a chunk of the prompt:
//     the next turn of a conversation it kept is prepared at once). When the load is in, Advance
//     copies them into the reserved blocks and reports a PrepareDone with how many leading tokens
//     it placed; the prefill worker sends none of those. A request prepared for local prefill
//     (docs/serving.md, "Two paths") instead computes the prompt tokens it lacks here, in Advance,
//     between decode steps: all at once when no request runs, else at most
//     local_prefill_step_tokens per step, so that running streams keep
//     their pace (and never more per Prefill call than the engine's
//     max_prefill_tokens: a longer piece goes in several calls). Its first token is drawn here and
//     reported as a LocalPrefillDone by an Advance that then returns, before any decode step; the
//     next Advance (or a Cancel before it) publishes its prompt's spans in the pool and stores
//     them, as a prefill worker does, and it joins the batch with no Start (events from its
//     second token: the router sends the first).
//  2. Start: the prefill worker has pushed the rest of the prompt's KV as
//     layer slices and sampled the first token. With a SliceLanding (the
//     CPU pool, docs/kvbus.md "Landing in place"), the slices were
//     registered when the load came in and landed straight in the reserved
//     blocks: nothing is copied. Otherwise they wait in the staging tier and
//     are copied into the blocks now (counted in start_copy_bytes). The
//     request joins the continuous batch (Batcher). A Start that comes
//     while the load is still out waits for it.
//  3. Advance: one decode step for every running request; token events out.
//     Running requests take KV blocks as they grow. When the next step
//     needs more blocks than are free, the most recently admitted requests
//     are preempted (never a blended one, which holds its whole length from
//     Prepare): each one's KV, prompt and tokens generated so far, is
//     published in the pool and stored in the KDN as a finished
//     conversation's is, its blocks go back, and it waits. Preempted
//     requests resume first, oldest admitted first, once the free blocks
//     hold one and a block for each running request: its KV is attached
//     from the pool or loaded from the KDN, what neither holds any more is
//     recomputed (counted), and it goes on from its last token, with no
//     event repeated or skipped and, seeded, the same tokens. While any
//     waits, Prepare admits nothing new.
//  4. Finish (length, stop, context, Cancel, or a failed step): the full
//     chunks of prompt + output that the load did not bring, and the tail
//     pieces past the last of them, are copied out of the cache and handed
//     to the store I/O thread, which stores those the KDN lacks; the
//     request's blocks go back at once, staying resident in the pool under
//     the conversation's keys until it needs them. The next turn of the
//     chat, routed here, attaches the conversation down to its last token;
//     anywhere else it loads it from the KDN. (Chunks another
//     worker stored meanwhile are copied out too, and skipped there: asking
//     the store first would hold the blocks across a round trip.) A blended
//     request's KV is not what a full prefill computes: it is neither loaded
//     nor stored by prefix key.
//
// Events: every id that Prepare returns ends with exactly one TokenEvent
// whose `finished` is set ("cancelled" after Cancel; `error` set when it
// failed: the slices never arrived, the batch was full, a decode step
// failed, or it was prepared and neither started nor renewed within
// prepare_timeout).
// After that event the id is unknown to the Decoder.
//
// KDN store I/O: every Get, Contains and Put on `store` runs on the store
// I/O thread (`store_io`, a JobThread; the worker's lookups have their own), never
// on the caller's thread: the compute loop never waits on the network. Jobs
// hold the store and a mailbox shared with the Decoder, never the Decoder or
// the KV cache, so the Decoder may be destroyed with jobs still queued. A
// failed load leaves the rest of the prompt to the prefill worker; a failed
// Put is logged and counted (DecoderStats) and costs only reuse; when more
// than max_pending_store_bytes wait to be stored, a finished conversation is
// not stored (counted too) rather than let memory grow without bound.
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
#include "kdn/control/prefix_kv.h"
#include "kdn/decode_worker/batcher.h"
#include "kdn/decode_worker/slice_landing.h"
#include "kdn/engine/engine.h"
#include "kdn/text/tokenizer.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/key.h"

namespace kdn::decode_worker {

// Lanes of the store I/O thread (JobThread lanes, most urgent first):
// lookups a router waits on (about a second; DecodeService runs them on a
// thread of their own), then loads a Prepare reply waits on, then stores
// nobody waits on.
inline constexpr int kLookupLane = 0;
inline constexpr int kLoadLane = 1;
inline constexpr int kStoreLane = 2;
inline constexpr int kStoreLanes = 3;

// A request as the decode worker takes it (from a router's prepare).
struct DecodeRequest {
  std::vector<int32_t> tokens;  // the prompt
  std::string ns;               // the tenant's cache namespace
  // Unique per request; names the slices of the prompt's partial tail (of
  // the whole prompt when blended).
  std::string transfer_id;
  // The prompt's KV was fused by blend: nothing loaded or stored by prefix key.
  bool blended = false;
  // Prefill it here (step 1); neither blended nor resumed.
  bool local_prefill = false;
  // The leading tokens its lookup reached (pool and lower tiers): a local
  // prefill loads nothing when the pool holds as many.
  int64_t lookup_tokens = 0;
  // The router's request id, shown in the Decoder's log lines (ReqId) only.
  uint64_t request_id = 0;
  // Sampling, max_tokens, stops; spec.id is set by Prepare. A resumed
  // request's spec.generated are the last tokens of `tokens`.
  RequestSpec spec;

  // The prompt's tokens, less those a resumed request generated before.
  int64_t PromptTokens() const {
    return static_cast<int64_t>(tokens.size() - spec.generated.size());
  }
};

// The KV a request's Prepare reserves, in tokens: kdn::KvTokensAdmitted
// (common/kv_block.h) of the tokens it is sent, within the model's context.
int64_t KvTokensAdmitted(const DecodeRequest& r, int64_t max_context);

// A Prepare's load is in: the leading `held_tokens` tokens of the prompt
// (full chunks, then tail pieces) are in the request's blocks and need not
// travel.
struct PrepareDone {
  uint64_t id = 0;
  int64_t held_tokens = 0;
  int64_t resident_tokens = 0;  // of held_tokens, attached from the pool
};

// A local prefill is done: its first token is drawn and it runs. Its
// events start at the second token (the router sends the first).
struct LocalPrefillDone {
  uint64_t id = 0;
  int32_t first_token = -1;
  int64_t held_tokens = 0;      // leading prompt tokens it did not compute (pool and KDN)
  int64_t resident_tokens = 0;  // of held_tokens, attached from the pool
  int64_t computed_tokens = 0;
  uint64_t kv_bytes_loaded = 0;  // KV copied into the pool from its lower tiers
};

// What Decoder calls produce, appended in order.
struct DecoderOutput {
  std::vector<PrepareDone> prepared;
  std::vector<LocalPrefillDone> prefilled;  // before `events`, which may follow them
  std::vector<TokenEvent> events;
  bool empty() const { return prepared.empty() && prefilled.empty() && events.empty(); }
};

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
  // Preemption (step 3): requests waiting to resume now, and the KV blocks
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
  // INVALID_ARGUMENT for kv_tokens on a request that is not blended, or
  // past its prompt.
  Status Start(uint64_t id, int32_t first_token, bool first_token_sent, DecoderOutput* out,
               int64_t kv_tokens = 0);

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
  // them), drops prepared requests past prepare_timeout (local prefills
  // never: they need no Start), admits the local prefills whose first token
  // the last Advance reported, computes local prefills (bounded while
  // requests run; a failed one fails its request) and runs one decode step
  // for the batch, unless a local prefill finished: then it returns with
  // that first token, and the step comes with the next Advance. Before the
  // step it resumes preempted requests that fit, and preempts when the step
  // needs more blocks than are free (step 3). A failed step fails every
  // running request.
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
    uint64_t order = 0;         // its admission's (Running::order)
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
    std::optional<int32_t> start;  // a Start waiting for the load: its first token
    TimePoint renewed;             // prepared, or last renewed by its router (Renew)
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
    uint64_t order = 0;       // admissions before it: the newest is preempted first
  };
  // Preempted, waiting to resume: the Prepared it resumes as.
  struct Preempted {
    uint64_t id = 0;
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
  // Erases from staging the slices named for this request alone (its
  // partial tail; a blended prompt's whole KV), which only
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
  // The load of local prefill `id` is in: it waits for its compute.
  void QueueLocal(uint64_t id, Prepared& p);
  // Computes local prefills, oldest first, up to the step's budget. A
  // finished one's first token goes out with this Advance; what is not on
  // its way (publishing and storing its prompt's KV, admitting it, the next
  // decode step) waits for the next (AdmitLocal).
  void RunLocalPrefills(DecoderOutput* out);
  // Local prefill `id`, whose first token went out: its prompt's KV
  // published and stored, then admitted into the batch.
  void AdmitLocal(uint64_t id, int32_t first_token, DecoderOutput* out);
  // The prompt tokens a prepared request may take from the pool and the
  // KDN: all of them, or all but the last when it is prefilled here (the
  // last is computed for its logits; a resume needs none).
  static int64_t HeldLimit(const Prepared& p);
  // The shortest tail match it takes: any for a resume (its tail was
  // stored whole), else options.min_tail_tokens.
  int64_t MinTail(const Prepared& p) const;
  // Step 3: preempts the newest running requests until the next step's
  // blocks are free (none left to preempt: the step fails as before).
  void MakeRoomForStep();
  void Preempt(uint64_t id);
  // Prepares preempted requests, oldest admitted first, while they fit.
  void ResumePreempted();
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
  std::unique_ptr<Batcher> batcher_;
  std::map<uint64_t, Prepared> prepared_;
  std::map<uint64_t, Running> running_;
  uint64_t next_id_ = 1;
  uint64_t chunks_loaded_ = 0;
  uint64_t kv_bytes_loaded_ = 0;
  uint64_t resident_hit_tokens_ = 0;
  uint64_t chunks_store_dropped_ = 0;
  std::deque<uint64_t> local_queue_;  // local prefills whose load is in, oldest first
  // Local prefills whose first token went out, not admitted yet: id, token.
  std::deque<std::pair<uint64_t, int32_t>> first_sent_;
  // The last Advance sent first tokens and put off the running requests'
  // step: the next one steps before it computes any local prefill.
  bool step_owed_ = false;
  std::deque<std::pair<TimePoint, engine::KvSequence>> quarantine_;  // by release time
  uint64_t start_copy_bytes_ = 0;
  double step_ms_ = 0;  // recent averages (exponential)
  double prefill_ms_per_token_ = 0;
  uint64_t local_prefills_ = 0;
  uint64_t local_prefill_tokens_ = 0;
  uint64_t next_order_ = 0;
  std::map<uint64_t, Preempted> preempted_;  // by Resume::order: oldest admitted first
  uint64_t preemptions_ = 0;
  uint64_t resumed_by_load_ = 0;
  uint64_t resumed_by_recompute_ = 0;
  uint64_t resume_recomputed_tokens_ = 0;
};

}  // namespace kdn::decode_worker
