#include "kdn/decode_worker/decoder.h"

#include <algorithm>
#include <chrono>
#include <mutex>

#include "kdn/common/log.h"
#include "kdn/kvbridge/prefix_kv.h"
#include "kdn/worker/worker_setup.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbridge/resident.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/prefix_io.h"

namespace kdn::decode_worker {

// What the Decoder and its store jobs share. Jobs hold it by shared_ptr, so
// it outlives a Decoder destroyed with jobs still queued.
struct Decoder::Mailbox {
  struct Load {
    uint64_t id = 0;
    std::vector<LoadedSpan> chunks;  // leading, in order
  };

  // Constant after construction.
  std::function<void()> on_load_done;

  Mutex mu;
  std::vector<Load> loads KDN_GUARDED_BY(mu);  // in, not yet taken by Advance

  std::atomic<uint64_t> stored{0};
  std::atomic<uint64_t> already_held{0};
  std::atomic<uint64_t> failed{0};
  std::atomic<uint64_t> bytes_pending{0};
};

Decoder::Decoder(engine::Engine& model, const text::Tokenizer& tokenizer,
                 kvbus::ChunkKey fingerprint, kvbus::ChunkStore& store, kvbus::HostTier& staging,
                 JobThread& store_io, DecoderOptions options)
    : model_(model),
      fingerprint_(fingerprint),
      store_(store),
      staging_(staging),
      store_io_(store_io),
      options_(std::move(options)),
      mailbox_(std::make_shared<Mailbox>()),
      scheduler_(SchedulerOptions{
          .max_batch = options_.max_batch,
          .prepare_timeout = options_.prepare_timeout,
          .local_prefill_step_tokens = options_.local_prefill_step_tokens,
          .max_prefill_tokens = model.max_prefill_tokens(),
          .admission_reserve = options_.admission_reserve,
      }),
      batcher_(std::make_unique<Batcher>(model, tokenizer, options_.max_batch)) {
  mailbox_->on_load_done = options_.on_load_done;
  batcher_->SetFinishHook(
      [this](uint64_t id, const engine::KvSequence& seq, const std::vector<int32_t>& generated) {
        StoreConversation(id, seq, generated);
      });
}

Decoder::~Decoder() = default;

// ---------------------------------------------------------------------------
// Engine and chunk-bridge calls: the Decoder's only uses of engine:: types
// besides the sequences it moves around (the Batcher runs the decode steps).

Status Decoder::ValidateRequest(const DecodeRequest& r) const {
  const model::ModelConfig& c = model_.config();
  if (r.tokens.empty()) return InvalidArgument("empty prompt");
  if (static_cast<int64_t>(r.tokens.size()) >= c.max_context) {
    return InvalidArgument("a prompt of " + std::to_string(r.tokens.size()) +
                           " tokens leaves no room in the model's context of " +
                           std::to_string(c.max_context));
  }
  for (int32_t t : r.tokens) {
    if (t < 0 || t >= c.vocab_size) {
      return InvalidArgument("token id " + std::to_string(t) + " is outside the vocabulary");
    }
  }
  if (r.spec.max_tokens < 1) return InvalidArgument("max_tokens must be at least 1");
  const size_t g = r.spec.generated.size();
  if (g >= r.tokens.size() || g >= static_cast<size_t>(r.spec.max_tokens)) {
    return InvalidArgument("generated_tokens " + std::to_string(g) +
                           " must be fewer than the tokens sent (" +
                           std::to_string(r.tokens.size()) + ") and than max_tokens (" +
                           std::to_string(r.spec.max_tokens) + ")");
  }
  if (r.local_prefill && (r.blended || g > 0)) {
    return InvalidArgument(std::string("a ") + (r.blended ? "blended" : "resumed") +
                           " request is not prefilled on the decode worker");
  }
  if (r.emphasis && (!r.blended || r.emphasis->heads != c.num_heads)) {
    return InvalidArgument(!r.blended
                               ? "emphasis goes with a blended request only"
                               : "an emphasis for " + std::to_string(r.emphasis->heads) +
                                     " query heads, on a model of " + std::to_string(c.num_heads));
  }
  // Admitted by what it needs now, it must still fit the pool whole, alone.
  const int64_t whole = std::min<int64_t>(r.PromptTokens() + r.spec.max_tokens, c.max_context);
  const int64_t pool = int64_t{model_.kv_cache().num_blocks()} * engine::kKvBlockTokens;
  if (whole > pool) {
    return InvalidArgument(std::to_string(r.PromptTokens()) + " prompt tokens + max_tokens " +
                           std::to_string(r.spec.max_tokens) + " pass the KV pool of " +
                           std::to_string(pool) + " tokens");
  }
  return model::ValidateSamplingParams(r.spec.sampling);
}

int64_t Decoder::HeldLimit(const Prepared& p) {
  const auto n = static_cast<int64_t>(p.request.tokens.size());
  return p.request.local_prefill && !p.resume ? n - 1 : n;
}

int64_t Decoder::MinTail(const Prepared& p) const {
  return p.resume ? 1 : options_.min_tail_tokens;
}

int64_t KvTokensAdmitted(const DecodeRequest& r, int64_t max_context) {
  const auto sent = static_cast<int64_t>(r.tokens.size());
  return std::min(kdn::KvTokensAdmitted(sent, r.PromptTokens() + r.spec.max_tokens, r.blended),
                  max_context);
}

Status Decoder::ReserveKv(Prepared& p) {
  engine::KvCache& cache = model_.kv_cache();
  p.seq = cache.NewSequence();
  if (p.request.emphasis) KDN_RETURN_IF_ERROR(p.seq.SetAttentionBias(*p.request.emphasis));
  if (!p.request.blended && options_.resident) {
    const kvbus::KeyContext ctx{fingerprint_, p.request.ns, options_.chunk_tokens};
    KDN_ASSIGN_OR_RETURN(p.resident_tokens,
                         kvbridge::AttachResidentPrefix(cache, p.seq, ctx, p.request.tokens, p.keys,
                                                        HeldLimit(p), MinTail(p)));
  }
  // What it needs now; its later tokens take blocks as they come.
  return cache.Reserve(p.seq, KvTokensAdmitted(p.request, model_.config().max_context));
}

int64_t Decoder::PlaceLoaded(Prepared& p, const std::vector<LoadedSpan>& loaded) {
  const kvbridge::PlacedPrefix placed =
      kvbridge::PlacePrefix(model_.kv_cache(), p.seq, loaded, p.resident_tokens);
  chunks_loaded_ += placed.chunks;
  kv_bytes_loaded_ += placed.kv_bytes;
  p.kv_bytes_loaded += placed.kv_bytes;
  return std::max(placed.tokens, p.resident_tokens);
}

void Decoder::Drop(uint64_t id, Prepared p) {
  DropOwnSlices(p);
  if (options_.landing != nullptr && options_.landing->Forget(id).unsafe) {
    HoldBack(p.request.request_id, std::move(p.seq));
  }
}

void Decoder::HoldBack(uint64_t request_id, engine::KvSequence seq) {
  if (seq.blocks().empty()) return;
  // A prefill worker may still be writing into these blocks.
  LogInfo("{} its {} KV blocks are held back for {} ms: a push into them may still be under way",
          ReqId{request_id}, seq.blocks().size(), options_.landing_quarantine.count());
  quarantine_.emplace_back(Now() + options_.landing_quarantine, std::move(seq));
}

void Decoder::ReleaseHeldBack() {
  const TimePoint now = Now();
  while (!quarantine_.empty() && quarantine_.front().first <= now) quarantine_.pop_front();
}

Decoder::TimePoint Decoder::Now() const {
  return options_.clock ? options_.clock() : std::chrono::steady_clock::now();
}

std::vector<std::shared_ptr<const kvbus::Chunk>> Decoder::CopyOutChunks(
    uint64_t request_id, const engine::KvSequence& seq,
    const std::vector<kvbus::KeyedSpan>& spans) {
  std::vector<std::shared_ptr<const kvbus::Chunk>> chunks;
  for (const kvbus::KeyedSpan& s : spans) {
    auto chunk = kvbridge::ChunkFromPagedKv(model_.kv_cache(), seq, s.first, s.count, s.key,
                                            fingerprint_, model_.kv_dtype());
    if (!chunk.ok()) {
      LogError("{} copying a chunk out of the KV cache: {}", ReqId{request_id},
               chunk.status().ToString());
      break;  // prefix keys: the chunks past a missing one are never reached
    }
    chunks.push_back(*std::move(chunk));
  }
  return chunks;
}

uint64_t Decoder::ChunkBytes(int64_t tokens) const {
  const engine::KvCache& cache = model_.kv_cache();
  return kvbus::Chunk::kHeaderBytes + static_cast<uint64_t>(tokens) * cache.token_stride() * 2 *
                                          cache.num_layers() * kdn::DTypeSize(model_.kv_dtype());
}

DecoderStats Decoder::Stats() const {
  DecoderStats s;
  const DecodeScheduler::Counts c = scheduler_.counts();
  s.prepared = c.prepared;
  s.running = static_cast<int>(batcher_->running());
  s.free_kv_blocks = model_.kv_cache().free_blocks();
  s.total_kv_blocks = model_.kv_cache().num_blocks();
  s.chunks_loaded = chunks_loaded_;
  s.kv_bytes_loaded = kv_bytes_loaded_;
  s.resident_hit_tokens = resident_hit_tokens_;
  s.resident = model_.kv_cache().resident_stats();
  s.chunks_stored = mailbox_->stored.load();
  s.chunks_already_held = mailbox_->already_held.load();
  s.chunks_store_failed = mailbox_->failed.load();
  s.chunks_store_dropped = chunks_store_dropped_;
  s.store_bytes_pending = mailbox_->bytes_pending.load();
  s.local_backlog_tokens = c.local_backlog_tokens;
  s.step_ms = step_ms_;
  s.prefill_ms_per_token = prefill_ms_per_token_;
  s.local_prefills = local_prefills_;
  s.local_prefill_tokens = local_prefill_tokens_;
  if (options_.landing != nullptr) s.slices_landed = options_.landing->Stats().landed;
  s.start_copy_bytes = start_copy_bytes_;
  for (const auto& [at, seq] : quarantine_)
    s.quarantined_blocks += static_cast<int>(seq.blocks().size());
  s.preempted = c.preempted;
  s.resume_kv_blocks = c.resume_blocks;
  s.admission_reserve_blocks = scheduler_.ReserveBlocks(s.total_kv_blocks);
  s.preemptions = preemptions_;
  s.resumed_by_load = resumed_by_load_;
  s.resumed_by_recompute = resumed_by_recompute_;
  s.resume_recomputed_tokens = resume_recomputed_tokens_;
  return s;
}

// ---------------------------------------------------------------------------
// Store I/O: jobs for the store I/O thread. They touch the store and the
// mailbox only.

void Decoder::PostLoad(uint64_t id, const Prepared& p) {
  store_io_.Post(
      kLoadLane, [mb = mailbox_, &store = store_, id, keys = p.keys, tokens = p.request.tokens,
                  limit = HeldLimit(p), min_tail = MinTail(p), resident = p.resident_tokens,
                  dtype = model_.kv_dtype(),
                  ctx = kvbus::KeyContext{fingerprint_, p.request.ns, options_.chunk_tokens}] {
        // Full chunks, then the tail pieces past them. A miss, an unreachable
        // store or a chunk of another making ends it: the prefill worker sends
        // the rest.
        Mailbox::Load load{
            id, kvbus::FetchPrefix(store, ctx, tokens, keys, limit, min_tail, resident, dtype)};
        {
          MutexLock lock(mb->mu);
          mb->loads.push_back(std::move(load));
        }
        if (mb->on_load_done) mb->on_load_done();
      });
}

void Decoder::PostStore(uint64_t request_id,
                        std::vector<std::shared_ptr<const kvbus::Chunk>> chunks, int lane) {
  uint64_t bytes = 0;
  for (const auto& c : chunks) bytes += c->size();
  mailbox_->bytes_pending += bytes;
  LogDebug("{} storing {} chunks ({} bytes) of its conversation", ReqId{request_id}, chunks.size(),
           bytes);
  store_io_.Post(
      lane, [mb = mailbox_, &store = store_, chunks = std::move(chunks), bytes, request_id] {
        const kvbus::PutOutcome put = kvbus::PutMissing(store, chunks);
        mb->stored += put.stored;
        mb->already_held += put.already_held;
        if (!put.error.ok()) {
          const uint64_t total = (mb->failed += put.not_stored);
          LogError(
              "{} storing a conversation's chunk failed, {} of its chunks not stored ({} so "
              "far): {}",
              ReqId{request_id}, put.not_stored, total, put.error.ToString());
        }
        mb->bytes_pending -= bytes;
      });
}

// ---------------------------------------------------------------------------
// Requests.

TokenEvent Decoder::Failure(uint64_t id, Status st) {
  TokenEvent e;
  e.id = id;
  e.finished = true;
  e.error = std::move(st);
  return e;
}

Result<uint64_t> Decoder::Prepare(DecodeRequest request, DecoderOutput* out) {
  KDN_RETURN_IF_ERROR(ValidateRequest(request));
  // Refused here, before any prefill is spent on it, rather than at Start
  // when the batch turns out full (the router queues it and tries again).
  KDN_RETURN_IF_ERROR(scheduler_.CanPrepare());
  ReleaseHeldBack();  // blocks whose hold ran out are free for this one
  // Pins' keeps first: a pinned entry is held before this reserve could
  // evict it, and what it holds is not counted free below.
  model_.kv_cache().ApplyKeeps(std::chrono::steady_clock::now());
  Prepared p;
  p.request = std::move(request);
  if (!p.request.blended) {
    p.keys =
        kvbus::PrefixKeys({fingerprint_, p.request.ns, options_.chunk_tokens}, p.request.tokens);
    if (options_.events != nullptr) options_.events->Describe(p.request.tokens, p.keys);
  }
  KDN_RETURN_IF_ERROR(ReserveKv(p));
  // Its blocks go back with `p` if the reserve refuses it.
  KDN_RETURN_IF_ERROR(
      scheduler_.LeavesReserve(model_.kv_cache().free_blocks(), model_.kv_cache().num_blocks()));
  resident_hit_tokens_ += static_cast<uint64_t>(p.resident_tokens);
  const uint64_t id = next_id_++;
  p.request.spec.id = id;
  LogInfo(
      "{} prepare: {} prompt tokens{}, max_tokens {}, {} KV blocks reserved ({} free), {} "
      "tokens resident{}",
      ReqId{p.request.request_id}, p.request.PromptTokens(),
      p.request.spec.generated.empty()
          ? std::string()
          : fmt::format(" and {} generated before (resumed)", p.request.spec.generated.size()),
      p.request.spec.max_tokens, p.seq.blocks().size(), model_.kv_cache().free_blocks(),
      p.resident_tokens, p.request.blended ? "; blended: nothing to load" : "");
  // Past a resident prefix that leaves less than a chunk of the prompt, the
  // lower tiers could add only tail pieces of those few tokens, which the
  // prefill worker sends anyway: no load, which would queue behind the
  // store I/O thread's work (storing the conversation just finished). A
  // local prefill computes them itself: it loads only when its lookup
  // reached past the pool.
  const int64_t lacking = static_cast<int64_t>(p.request.tokens.size()) - p.resident_tokens;
  const bool no_load = p.request.local_prefill
                           ? p.resident_tokens >= std::min(p.request.lookup_tokens, HeldLimit(p))
                           : p.resident_tokens > 0 && lacking < options_.chunk_tokens;
  const bool loading = !(p.request.blended || no_load);
  if (!loading) {
    p.held_tokens = p.resident_tokens;
    ExpectSlices(id, p);
    out->prepared.push_back({id, p.held_tokens, p.resident_tokens});
    if (p.request.local_prefill) QueueLocal(p);
  } else {
    PostLoad(id, p);
  }
  scheduler_.Prepared(id,
                      {.local = p.request.local_prefill,
                       .blended = p.request.blended,
                       .tokens = static_cast<int64_t>(p.request.tokens.size()),
                       .have = p.resident_tokens,
                       .loading = loading},
                      Now());
  prepared_.emplace(id, std::move(p));
  return id;
}

Status Decoder::Start(uint64_t id, int32_t first_token, bool first_token_sent, DecoderOutput* out,
                      int64_t kv_tokens, std::string kv_holes) {
  auto it = prepared_.find(id);
  if (it == prepared_.end()) {
    return NotFound("request " + std::to_string(id) + " was not prepared here (or expired)");
  }
  Prepared& p = it->second;
  if (p.start) return InvalidArgument("request " + std::to_string(id) + " was started already");
  if (p.request.local_prefill) {
    return InvalidArgument("request " + std::to_string(id) +
                           " is prefilled on this worker and needs no Start");
  }
  if (kv_tokens != 0) {
    const auto n = static_cast<int64_t>(p.request.tokens.size());
    if (!p.request.blended || kv_tokens < 0 || kv_tokens > n) {
      return InvalidArgument(
          "request " + std::to_string(id) + ": kv_tokens " + std::to_string(kv_tokens) +
          (p.request.blended ? " is outside its prompt of " + std::to_string(n)
                             : std::string(" on a request that is not blended")));
    }
  }
  if (!kv_holes.empty()) {
    const auto n = kv_tokens > 0 ? kv_tokens : static_cast<int64_t>(p.request.tokens.size());
    const engine::KvCache& cache = model_.kv_cache();
    const int64_t bits = int64_t{cache.num_layers()} * cache.num_kv_heads() * n;
    if (!p.request.blended || static_cast<int64_t>(kv_holes.size()) != (bits + 7) / 8) {
      return InvalidArgument("request " + std::to_string(id) + ": " +
                             std::to_string(kv_holes.size()) + " bytes of KV holes for " +
                             std::to_string(n) + " slots" +
                             (p.request.blended ? "" : " on a request that is not blended"));
    }
  }
  p.kv_tokens = kv_tokens;
  p.kv_holes = std::move(kv_holes);
  p.request.spec.first_token_sent = first_token_sent;
  p.start = first_token;
  // Else Advance begins it once its load is in.
  if (scheduler_.StartCame(id)) Begin(id, first_token, out);
  return Status::Ok();
}

void Decoder::Begin(uint64_t id, int32_t first_token, DecoderOutput* out) {
  auto it = prepared_.find(id);
  Prepared p = std::move(it->second);
  prepared_.erase(it);
  const uint64_t request_id = p.request.request_id;
  SliceLanding::Settled settled;
  if (options_.landing != nullptr) settled = options_.landing->Forget(id);
  Status st = PlacePushedSlices(p, settled.landed);
  // Failed partway: the slices it did not take are named for it alone.
  if (!st.ok()) DropOwnSlices(p);
  if (st.ok()) {
    LogInfo(
        "{} start: first token {}, {} prompt tokens held, KV of {} pushed by the prefill worker "
        "(transfer {}){}",
        ReqId{request_id}, first_token, p.held_tokens, p.seq.length() - p.held_tokens,
        HexBytes{p.request.transfer_id},
        p.seq.length() < p.seq.next_position()
            ? fmt::format("; {} prompt tokens, pruned from their documents, have none",
                          p.seq.next_position() - p.seq.length())
            : std::string());
    st = Admit(id, std::move(p), first_token, out);
  }
  if (!st.ok()) {
    LogError("{} cannot start: {}", ReqId{request_id}, st.ToString());
    scheduler_.Forget(id);
    out->events.push_back(Failure(id, std::move(st)));
    if (settled.unsafe) HoldBack(request_id, std::move(p.seq));
    return;
  }
  scheduler_.Started(id);
}

Status Decoder::Admit(uint64_t id, Prepared p, int32_t first_token, DecoderOutput* out) {
  // Before the Batcher's Admit: a request that finishes at its first token
  // is stored from inside it. The conversation stored at its end is this
  // prompt and what the Batcher holds as generated (of a resumed request,
  // the tokens it generated before too).
  p.request.tokens.resize(static_cast<size_t>(p.request.PromptTokens()));
  running_[id] = Running{std::move(p.request.tokens), p.request.ns, p.request.blended,
                         p.held_tokens, p.request.request_id};
  std::vector<TokenEvent> events;
  Status st = batcher_->Admit(p.request.spec, std::move(p.seq), first_token, &events);
  if (!st.ok()) {
    running_.erase(id);
    return st;
  }
  out->events.insert(out->events.end(), events.begin(), events.end());
  return Status::Ok();
}

void Decoder::QueueLocal(Prepared& p) {
  // What the pool and the KDN gave is the sequence's KV; the rest is
  // computed on top of it.
  model_.kv_cache().SetLength(p.seq, p.held_tokens);
}

Decoder::Prepared* Decoder::PieceTarget(const PrefillPiece& piece) {
  auto it = prepared_.find(piece.id);
  // A piece past one that failed (its request is gone), or not where the
  // plan put it (not expected).
  if (it == prepared_.end() || it->second.seq.length() != piece.first) return nullptr;
  return &it->second;
}

void Decoder::RunPiece(const PrefillPiece& piece, DecoderOutput* out) {
  Prepared* target = PieceTarget(piece);
  if (target == nullptr) return;
  Prepared& p = *target;
  std::vector<float> logits;
  double ms = 0;
  if (piece.count > 0) {
    const auto t0 = std::chrono::steady_clock::now();
    Status st = model_.Prefill(
        p.seq, {p.request.tokens.data() + piece.first, static_cast<size_t>(piece.count)}, {},
        &logits);
    ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!st.ok()) {
      LogError("{} local prefill of tokens [{}, {}) failed: {}", ReqId{p.request.request_id},
               piece.first, piece.first + piece.count, st.ToString());
      out->events.push_back(Failure(piece.id, std::move(st)));
      scheduler_.Forget(piece.id);
      prepared_.erase(piece.id);
      return;
    }
  }
  PieceDone(piece, p, logits, ms, out);
}

bool Decoder::StepWithPieces(const std::vector<PrefillPiece>& pieces, DecoderOutput* out) {
  // The pieces with tokens to compute whose request is here, as RunPiece
  // finds it (by plan order; the rest go through RunPiece after the pass).
  std::vector<Prepared*> riding(pieces.size(), nullptr);
  std::vector<engine::Engine::Piece> inputs;
  std::vector<std::vector<float>> logits(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    const PrefillPiece& piece = pieces[i];
    Prepared* p = PieceTarget(piece);
    if (p == nullptr || piece.count <= 0) continue;
    for (const engine::Engine::Piece& in : inputs) {
      if (in.seq == &p->seq) p = nullptr;  // a second piece of one request: after the pass
    }
    if (p == nullptr) continue;
    // Logits for a last piece only, whose first token they give.
    inputs.push_back({&p->seq,
                      {p->request.tokens.data() + piece.first, static_cast<size_t>(piece.count)},
                      piece.last ? &logits[i] : nullptr});
    riding[i] = p;
  }
  if (inputs.empty()) return false;
  std::vector<TokenEvent> events;
  const auto t0 = std::chrono::steady_clock::now();
  if (!batcher_->Step(&events, inputs).ok()) return false;
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  // The pass is the step's and the pieces': a piece's share is what the
  // pass took past a step's recent average (none before there is one).
  int64_t piece_tokens = 0;
  for (const engine::Engine::Piece& in : inputs) piece_tokens += std::ssize(in.tokens);
  const double pieces_ms = step_ms_ == 0 ? 0 : std::max(ms - step_ms_, 0.0);
  step_ms_ = step_ms_ == 0 ? ms : 0.8 * step_ms_ + 0.2 * (ms - pieces_ms);
  out->events.insert(out->events.end(), events.begin(), events.end());
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (riding[i] == nullptr) {
      RunPiece(pieces[i], out);
      continue;
    }
    const double share = pieces_ms * static_cast<double>(pieces[i].count) / piece_tokens;
    PieceDone(pieces[i], *riding[i], logits[i], share, out);
  }
  return true;
}

void Decoder::PieceDone(const PrefillPiece& piece, Prepared& p, const std::vector<float>& logits,
                        double ms, DecoderOutput* out) {
  if (piece.count > 0) {
    if (ms > 0) {
      constexpr double kWeight = 0.2;  // of the newest piece in the average
      const double per_token = ms / static_cast<double>(piece.count);
      prefill_ms_per_token_ = prefill_ms_per_token_ == 0
                                  ? per_token
                                  : (1 - kWeight) * prefill_ms_per_token_ + kWeight * per_token;
    }
    (p.resume ? resume_recomputed_tokens_ : local_prefill_tokens_) +=
        static_cast<uint64_t>(piece.count);
  }
  if (!piece.last) return;  // the next piece after the next step
  if (piece.resume) {
    FinishResume(piece.id, out);
    return;
  }
  const auto n = static_cast<int64_t>(p.request.tokens.size());
  ++local_prefills_;
  engine::Sampler sampler(p.request.spec.sampling);
  p.local_first = sampler.Sample(logits);
  LocalPrefillDone done{piece.id,          p.local_first,     p.held_tokens,
                        p.resident_tokens, n - p.held_tokens, p.kv_bytes_loaded};
  LogInfo("{} local prefill: {} prompt tokens held ({} resident), {} computed, first token {}",
          ReqId{p.request.request_id}, p.held_tokens, p.resident_tokens, n - p.held_tokens,
          p.local_first);
  out->prefilled.push_back(done);
}

void Decoder::AdmitLocal(uint64_t id, DecoderOutput* out) {
  auto it = prepared_.find(id);
  if (it == prepared_.end()) return;
  Prepared& p = it->second;
  // The prompt's own spans, as a prefill worker publishes and stores them:
  // a next turn whose template re-renders the answer differs from the
  // conversation inside its tail, and still finds the prompt whole.
  PublishAndStore(p.request.request_id, p.seq, p.request.tokens, p.held_tokens, p.request.ns);
  Prepared taken = std::move(p);
  prepared_.erase(it);
  // The router sends the first token itself, as from a prefill worker.
  taken.request.spec.first_token_sent = true;
  const uint64_t request_id = taken.request.request_id;
  const int32_t first_token = taken.local_first;
  if (Status a = Admit(id, std::move(taken), first_token, out); !a.ok()) {
    LogError("{} cannot start: {}", ReqId{request_id}, a.ToString());
    scheduler_.Forget(id);
    out->events.push_back(Failure(id, std::move(a)));
  }
}

bool Decoder::Renew(uint64_t id) { return scheduler_.Renew(id, Now()); }

Status Decoder::Cancel(uint64_t id, DecoderOutput* out) {
  const std::optional<RequestPhase> phase = scheduler_.Phase(id);
  if (phase == RequestPhase::kFirstSent) {
    // A local prefill whose first token went out is as good as started: its
    // prompt is published and stored, and it is cancelled as a running one.
    scheduler_.Started(id);
    AdmitLocal(id, out);
  }
  if (auto it = prepared_.find(id); it != prepared_.end()) {
    // Never started (the first token ended it, or its client went away):
    // its reserved blocks go back with the sequence.
    LogInfo("{} cancel: prepared, never started; its {} KV blocks are freed",
            ReqId{it->second.request.request_id}, it->second.seq.blocks().size());
    Prepared p = std::move(it->second);
    prepared_.erase(it);
    scheduler_.Forget(id);
    Drop(id, std::move(p));
    TokenEvent e;
    e.id = id;
    e.finished = true;
    e.finish_reason = "cancelled";
    out->events.push_back(std::move(e));
    return Status::Ok();
  }
  if (auto it = preempted_.find(id); it != preempted_.end()) {
    // It holds no blocks: its KV is the pool's and the KDN's, as a finished
    // conversation's.
    LogInfo("{} cancel: preempted, waiting to resume", ReqId{it->second.request.request_id});
    preempted_.erase(it);
    scheduler_.Forget(id);
    out->events.push_back(TokenEvent{id, -1, {}, true, "cancelled"});
    return Status::Ok();
  }
  if (auto it = running_.find(id); it != running_.end()) {
    LogInfo("{} cancel: running", ReqId{it->second.request_id});
  }
  return batcher_->Cancel(id, &out->events);  // the finish hook forgets it
}

void Decoder::Advance(DecoderOutput* out) {
  std::vector<Mailbox::Load> loads;
  {
    MutexLock lock(mailbox_->mu);
    loads.swap(mailbox_->loads);
  }
  for (Mailbox::Load& load : loads) {
    auto it = prepared_.find(load.id);
    if (it == prepared_.end()) continue;  // cancelled or dropped while loading
    Prepared& p = it->second;
    p.held_tokens = PlaceLoaded(p, load.chunks);
    LogInfo("{} prepared: its KDN gave {} of {} prompt tokens ({} chunks and tail pieces)",
            ReqId{p.request.request_id}, p.held_tokens, p.request.tokens.size(),
            load.chunks.size());
    ExpectSlices(load.id, p);
    // A resume's router had its reply when the request was first prepared.
    if (!p.resume) out->prepared.push_back({load.id, p.held_tokens, p.resident_tokens});
    switch (scheduler_.LoadIn(load.id, p.held_tokens)) {
      case DecodeScheduler::Next::kCompute: QueueLocal(p); break;
      case DecodeScheduler::Next::kBegin: Begin(load.id, *p.start, out); break;
      case DecodeScheduler::Next::kWaitForStart: break;
    }
  }

  ReleaseHeldBack();
  // Pins' keeps and their expiry, before free_blocks() decides what fits.
  model_.kv_cache().ApplyKeeps(std::chrono::steady_clock::now());
  const StepPlan plan = scheduler_.Schedule(Now(), model_.kv_cache().free_blocks());
  for (uint64_t id : plan.expire) {
    auto it = prepared_.find(id);
    if (it == prepared_.end()) continue;
    LogWarn("{} was prepared, and neither started nor renewed by its router for {} ms; dropped",
            ReqId{it->second.request.request_id}, options_.prepare_timeout.count());
    out->events.push_back(
        Failure(id, Status(StatusCode::kDeadlineExceeded,
                           "its reservation was neither started nor renewed by its router for " +
                               std::to_string(options_.prepare_timeout.count()) + " ms")));
    Prepared p = std::move(it->second);
    prepared_.erase(it);
    Drop(id, std::move(p));
  }
  for (uint64_t id : plan.admit) AdmitLocal(id, out);
  for (size_t i = 0; i < plan.resume.size(); ++i) {
    if (StartResume(plan.resume[i])) continue;
    for (size_t j = i; j < plan.resume.size(); ++j) scheduler_.ResumeDeferred(plan.resume[j]);
    break;
  }
  if (plan.step && batcher_->running() > 0 && !plan.prefill.empty()) {
    // The pieces ride in the step's pass: each weight read once for both.
    MakeRoomForStep(plan.preempt);
    if (batcher_->running() > 0 && StepWithPieces(plan.prefill, out)) return;
  }
  for (const PrefillPiece& piece : plan.prefill) RunPiece(piece, out);
  if (!plan.step || batcher_->running() == 0) return;
  MakeRoomForStep(plan.preempt);
  if (batcher_->running() == 0) return;
  std::vector<TokenEvent> events;
  const auto t0 = std::chrono::steady_clock::now();
  Status st = batcher_->Step(&events);
  if (st.ok()) {
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    step_ms_ = step_ms_ == 0 ? ms : 0.8 * step_ms_ + 0.2 * ms;
    out->events.insert(out->events.end(), events.begin(), events.end());
    return;
  }
  // The model refused the whole step (e.g. no free KV block for a new
  // token): fail every running request rather than spin. Their KV is as it
  // was before the step, so their conversations are still stored.
  std::vector<uint64_t> ids;
  std::string reqs;
  for (const auto& [id, r] : running_) {
    ids.push_back(id);
    reqs += fmt::format(" {}", ReqId{r.request_id});
  }
  LogError("decode step failed, failing {} running requests:{}: {}", ids.size(), reqs,
           st.ToString());
  for (uint64_t id : ids) {
    std::vector<TokenEvent> cancelled;
    (void)batcher_->Cancel(id, &cancelled);
    out->events.push_back(Failure(id, st));
  }
}

bool Decoder::Busy() const {
  if (scheduler_.HasWork(model_.kv_cache().free_blocks())) return true;
  MutexLock lock(mailbox_->mu);
  return !mailbox_->loads.empty();
}

void Decoder::StoreConversation(uint64_t id, const engine::KvSequence& seq,
                                const std::vector<int32_t>& generated) {
  scheduler_.Forget(id);
  auto it = running_.find(id);
  if (it == running_.end()) return;
  Running r = std::move(it->second);
  running_.erase(it);
  // Blended KV differs from what a full prefill gives: never under prefix keys.
  if (r.blended) return;
  // All tokens but the last generated one, whose KV was never computed.
  std::vector<int32_t> tokens = std::move(r.prompt);
  tokens.insert(tokens.end(), generated.begin(), generated.end());
  tokens.resize(std::min<size_t>(tokens.size(), static_cast<size_t>(seq.length())));
  // The whole conversation stays resident in the pool, for its next turn.
  PublishAndStore(r.request_id, seq, tokens, r.held_tokens, r.ns);
}

void Decoder::PublishAndStore(uint64_t request_id, const engine::KvSequence& seq,
                              std::span<const int32_t> tokens, int64_t held_tokens,
                              const std::string& ns, int lane) {
  const kvbus::KeyContext ctx{fingerprint_, ns, options_.chunk_tokens};
  const std::vector<kvbus::ChunkKey> keys = kvbus::PrefixKeys(ctx, tokens);
  if (options_.events != nullptr) options_.events->Describe(tokens, keys);
  std::vector<kvbus::KeyedSpan> spans = kvbus::StoredSpans(ctx, tokens, keys);
  if (options_.resident) kvbridge::PublishSpans(model_.kv_cache(), seq, spans);
  // The full chunks the load brought (or the pool held) are in the KDN
  // already; those past them, then the tail pieces past the last full
  // chunk, are stored.
  const auto loaded = std::min<size_t>(
      static_cast<size_t>(std::max<int64_t>(held_tokens, 0) / options_.chunk_tokens), keys.size());
  spans.erase(spans.begin(), spans.begin() + static_cast<std::ptrdiff_t>(loaded));
  if (spans.empty()) return;
  uint64_t bytes = 0;
  for (const kvbus::KeyedSpan& s : spans) bytes += ChunkBytes(s.count);
  if (mailbox_->bytes_pending.load() + bytes > options_.max_pending_store_bytes) {
    chunks_store_dropped_ += spans.size();
    LogWarn("{} its {} chunks not stored: {} bytes already wait for the store", ReqId{request_id},
            spans.size(), mailbox_->bytes_pending.load());
    return;
  }
  auto chunks = CopyOutChunks(request_id, seq, spans);
  if (!chunks.empty()) PostStore(request_id, std::move(chunks), lane);
}

}  // namespace kdn::decode_worker
