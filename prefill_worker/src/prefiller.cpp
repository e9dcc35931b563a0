#include "kdn/prefill_worker/prefiller.h"

#include <algorithm>
#include <future>

#include "kdn/common/log.h"
#include "kdn/kvbridge/prefix_kv.h"
#include "kdn/kvbus/transfer_plan.h"
#include "kdn/kvbus/prefix_io.h"
#include "kdn/kvbus/steering.h"
#include "kdn/worker/worker_setup.h"
#include "kdn/kvbridge/head_pruned.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/kvbridge/resident.h"
#include "kdn/prune/prune_text.h"

namespace kdn::prefill_worker {

Prefiller::Prefiller(engine::Engine& model, kvbus::TieredStore& store,
                     kvbus::ChunkKey model_fingerprint, PrefillerOptions options)
    : model_(model),
      store_(store),
      fingerprint_(model_fingerprint),
      chunk_dtype_(model.kv_dtype()),
      options_(options) {
  if (options_.store_in_background) store_io_ = std::make_unique<JobThread>();
}

// The store thread first: its jobs use the store, which outlives this.
Prefiller::~Prefiller() {
  if (store_io_) (void)store_io_->Stop();
}

void Prefiller::WaitForStores() {
  if (store_io_) store_io_->Drain();
}

uint64_t Prefiller::StoreFailures() const { return store_failures_->load(); }

kvbus::SenderStats Prefiller::TransportStats() const {
  kvbus::SenderStats sum;
  for (const auto& [endpoint, sender] : senders_) sum += sender->Stats();
  return sum;
}

Result<kvbus::Sender*> Prefiller::SenderFor(const std::string& endpoint) {
  auto it = senders_.find(endpoint);
  if (it != senders_.end()) return it->second.get();
  KDN_ASSIGN_OR_RETURN(auto sender, kvbus::Connect(endpoint, options_.sender));
  kvbus::Sender* raw = sender.get();
  senders_.emplace(endpoint, std::move(sender));
  return raw;
}

// The layer-slice push of one job to its decode worker.
struct Prefiller::Push {
  Prefiller& self;
  const PrefillJob& job;
  const engine::KvSequence& seq;
  std::vector<kvbus::KvRegion> regions;
  kvbus::Sender* sender = nullptr;
  std::vector<uint64_t> batches;
  size_t settled = 0;    // batches Finish has seen done
  uint32_t sourced = 0;  // slices submitted as SourcedChunks

  // Sourced slices are read from seq's blocks until their batch is done: a
  // job that ends early (a failed prefill or push) waits for the rest here
  // before the blocks can be reused (a dead or silent decode worker fails
  // them within the sender's timeouts).
  ~Push() {
    if (sender == nullptr) return;
    for (size_t i = settled; i < batches.size(); ++i) {
      (void)sender->Wait(batches[i], self.options_.push_timeout);
    }
  }

  // Layer `layer` of every region read where it lies in the pool, or an
  // error when one of them cannot be (a block the sequence shares, a pool
  // of another dtype than the slices').
  Result<std::vector<kvbus::SourcedChunk>> Sourced(int layer) const {
    std::vector<kvbus::SourcedChunk> out;
    for (const kvbus::KvRegion& r : regions) {
      KDN_ASSIGN_OR_RETURN(
          kvbus::SourcedChunk s,
          kvbridge::SourcedLayerSlice(self.model_.kv_cache(), seq, *self.options_.kv_pool, r.first,
                                      r.count, layer, kvbus::LayerSliceKey(r.parent, layer),
                                      self.fingerprint_, self.chunk_dtype_));
      out.push_back(std::move(s));
    }
    return out;
  }

  // Layer `layer` of every region, once it is final in `seq`.
  Status Layer(int layer) {
    if (sender == nullptr) return Status::Ok();
    if (self.options_.kv_pool != nullptr) {
      if (Result<std::vector<kvbus::SourcedChunk>> sourced = Sourced(layer); sourced.ok()) {
        const auto n = static_cast<uint32_t>(sourced->size());
        KDN_ASSIGN_OR_RETURN(uint64_t batch, sender->SubmitSourced(std::move(sourced).value()));
        batches.push_back(batch);
        this->sourced += n;
        return Status::Ok();
      }
    }
    std::vector<std::shared_ptr<const kvbus::Chunk>> slices;
    slices.reserve(regions.size());
    for (const kvbus::KvRegion& r : regions) {
      KDN_ASSIGN_OR_RETURN(
          auto slice, kvbridge::LayerSliceFromPagedKv(self.model_.kv_cache(), seq, r.first, r.count,
                                                      layer, kvbus::LayerSliceKey(r.parent, layer),
                                                      self.fingerprint_, self.chunk_dtype_));
      slices.push_back(std::move(slice));
    }
    KDN_ASSIGN_OR_RETURN(uint64_t batch, sender->Submit(std::move(slices)));
    batches.push_back(batch);
    return Status::Ok();
  }

  // Waits until the decode worker has every slice.
  Status Finish(PrefillOutcome* out) {
    out->slices_sourced = sourced;
    const auto deadline = std::chrono::steady_clock::now() + self.options_.push_timeout;
    for (uint64_t batch : batches) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      KDN_ASSIGN_OR_RETURN(kvbus::BatchStatus bs,
                           sender->Wait(batch, std::max(left, std::chrono::milliseconds(0))));
      if (bs.done) ++settled;
      Status st = bs.ToStatus();
      if (!st.ok()) {
        return Status(
            st.code() == StatusCode::kDeadlineExceeded ? StatusCode::kUnavailable : st.code(),
            "pushing KV to the decode worker at " + job.decode_endpoint + ": " + st.message());
      }
      // bs.chunks are in submission order: one per region.
      for (size_t j = 0; j < bs.chunks.size() && j < regions.size(); ++j) {
        if (bs.chunks[j].outcome == kvbus::ChunkOutcome::kSkipped) {
          ++out->slices_skipped;
        } else {
          // In the chunks' dtype, the engine's own (bf16 on a GPU).
          out->kv_bytes_sent += static_cast<uint64_t>(regions[j].count) *
                                self.model_.kv_cache().token_stride() * 2 *
                                kdn::DTypeSize(self.chunk_dtype_);
        }
      }
    }
    return Status::Ok();
  }
};

PrefetchedKv Prefiller::Prefetch(const PrefillJob& job, const InjectSpec* inject) const {
  PrefetchedKv kv;
  const auto n = static_cast<int64_t>(job.tokens.size());
  if (inject != nullptr && inject->steering_vector) {  // no document
    PrefetchSteering(job, *inject, &kv);
    return kv;
  }
  if (n == 0 || n > model_.config().max_context) return kv;  // Run refuses it
  const kvbus::KeyContext ctx{fingerprint_, job.ns, options_.chunk_tokens};
  if (inject != nullptr && inject->steer) {
    PrefetchSteering(job, *inject, &kv);
    return kv;
  }
  if (inject != nullptr) {
    kv.inject_held = store_.Contains(kvbus::SegmentKey(ctx, job.tokens));
    if (!kv.inject_held) kv.inject_base = InjectBase(store_, job.tokens, job.ns, *inject);
    return kv;
  }
  if (job.blend) {
    int64_t at = std::max(job.blend->head_tokens, 0);
    for (size_t i = 0; i < job.blend->segment_tokens.size(); ++i) {
      const int len = job.blend->segment_tokens[i];
      if (len <= 0 || at + len > n) return kv;
      const std::span<const int32_t> doc(job.tokens.data() + at, static_cast<size_t>(len));
      at += len;
      if (i < job.blend->steer.size() && job.blend->steer[i]) {
        // The vector's id first, read from every tier: the steered version's
        // key is made of it.
        const std::string& vector = job.blend->steer[i]->vector;
        const kvbus::ChunkKey name = kvbus::SteeringVectorKey(ctx, vector);
        if (kv.vector_ids.count(name) == 0) {
          if (auto id = VectorId(ctx, vector, nullptr)) kv.vector_ids.emplace(name, *id);
        }
      }
      const Result<kvbus::ChunkKey> found = BlendDocumentKey(ctx, doc, *job.blend, i, &kv);
      if (!found.ok()) continue;  // RunBlend refuses it
      const kvbus::ChunkKey key = *found;
      if (kv.segments.count(key) != 0) continue;
      auto chunk = store_.Get(key);
      if (chunk.ok()) kv.segments.emplace(key, *std::move(chunk));
    }
    return kv;
  }
  const std::vector<kvbus::ChunkKey> keys = kvbus::PrefixKeys(ctx, job.tokens);
  if (options_.events != nullptr) options_.events->Describe(job.tokens, keys);
  if (options_.resident) {
    kv.resident = kvbridge::ResidentPrefixTokens(model_.kv_cache(), ctx, job.tokens, keys, n - 1,
                                                 options_.min_tail_tokens);
  }
  kv.prefix = kvbus::FetchPrefix(store_, ctx, job.tokens, keys, n - 1, options_.min_tail_tokens,
                                 kv.resident, chunk_dtype_);
  return kv;
}

Result<PrefillOutcome> Prefiller::Run(const PrefillJob& job, const PrefetchedKv* kv) {
  seq_.Reset();
  keys_.clear();
  spans_.clear();
  missing_segments_.clear();
  prefetched_ = kv != nullptr;
  first_new_chunk_ = 0;
  const auto n = static_cast<int64_t>(job.tokens.size());
  const model::ModelConfig& cfg = model_.config();
  if (n == 0) return InvalidArgument("prefill: empty prompt");
  if (n > cfg.max_context) {
    return InvalidArgument("prefill: a prompt of " + std::to_string(n) +
                           " tokens exceeds the model's context of " +
                           std::to_string(cfg.max_context));
  }
  KDN_RETURN_IF_ERROR(model::ValidateSamplingParams(job.sampling));
  if (job.generated_tokens < 0 || job.generated_tokens >= n) {
    return InvalidArgument("prefill: generated_tokens " + std::to_string(job.generated_tokens) +
                           " is not within the " + std::to_string(n) + " tokens sent");
  }
  if (job.blend) return RunBlend(job, kv);
  const int C = options_.chunk_tokens;
  const kvbus::KeyContext ctx{fingerprint_, job.ns, C};
  keys_ = kvbus::PrefixKeys(ctx, job.tokens);
  if (options_.events != nullptr) options_.events->Describe(job.tokens, keys_);
  const auto full = static_cast<int64_t>(keys_.size());

  engine::KvCache& cache = model_.kv_cache();
  seq_ = cache.NewSequence();

  // 1. The cached prefix, full chunks then tail pieces; the last token is
  // always computed for its logits. What the pool holds resident is attached
  // (no KV moves); the lower tiers give what lies past it.
  const auto load_start = std::chrono::steady_clock::now();
  int64_t resident = 0;
  if (options_.resident) {
    KDN_ASSIGN_OR_RETURN(resident,
                         kvbridge::AttachResidentPrefix(cache, seq_, ctx, job.tokens, keys_, n - 1,
                                                        options_.min_tail_tokens));
  }
  KDN_RETURN_IF_ERROR(cache.Reserve(seq_, n));
  // The lower tiers past the resident prefix, fetched while matching and
  // placed after it, so that a tail match too short to use costs no copy;
  // read before, off this thread, when prefetched.
  std::vector<kvbus::FetchedSpan> fetched_here;
  if (kv == nullptr) {
    fetched_here = kvbus::FetchPrefix(store_, ctx, job.tokens, keys_, n - 1,
                                      options_.min_tail_tokens, resident, chunk_dtype_);
  }
  const kvbridge::PlacedPrefix placed =
      kvbridge::PlacePrefix(cache, seq_, kv != nullptr ? kv->prefix : fetched_here, resident);
  // A prefetch that read before more of the prompt was resident may reach
  // less far than the pool does now.
  const int64_t hit = kv != nullptr ? std::max(placed.tokens, resident) : placed.tokens;
  if (hit < resident) {
    // The lower tiers' match retraces the resident one; short of it, the
    // compute would write into shared blocks.
    return Internal("prefill: the prefix match reached " + std::to_string(hit) +
                    " tokens, short of the " + std::to_string(resident) + " attached");
  }
  cache.SetLength(seq_, hit);
  first_new_chunk_ = static_cast<int>(hit / C);
  spans_ = kvbus::StoredSpans(ctx, job.tokens, keys_);
  const double load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();

  // 2. What the decode worker lacks, by region, pushed layer by layer.
  Push push{*this, job, seq_,
            kvbus::TransferRegions(full, n, C, job.decode_held_tokens, job.transfer_id)};
  if (!job.decode_endpoint.empty() && !push.regions.empty()) {
    KDN_ASSIGN_OR_RETURN(push.sender, SenderFor(job.decode_endpoint));
  }
  engine::PrefillOptions popts;
  popts.on_layer = [&](int layer) { return push.Layer(layer); };
  std::vector<float> logits;
  const std::span<const int32_t> rest(job.tokens.data() + hit, n - hit);
  KDN_RETURN_IF_ERROR(model_.Prefill(seq_, rest, popts, &logits));

  // 3. Every slice delivered, then the first token.
  PrefillOutcome out;
  KDN_RETURN_IF_ERROR(push.Finish(&out));
  if (!job.decode_endpoint.empty()) {
    // Chunks the decode worker said it holds were never offered: skipped too.
    const int64_t held_chunks = std::clamp<int64_t>(job.decode_held_tokens / C, 0, full);
    out.slices_skipped += static_cast<uint32_t>(held_chunks * cfg.num_layers);
  }
  engine::Sampler sampler(job.sampling);
  sampler.Advance(static_cast<int>(job.generated_tokens));
  out.first_token = sampler.Sample(logits);
  out.cached_tokens = static_cast<int>(hit);
  out.resident_tokens = static_cast<int>(std::min(resident, hit));
  out.kv_bytes_loaded = placed.kv_bytes;
  out.tail_tokens = static_cast<int>(hit - first_new_chunk_ * int64_t{C});
  out.load_seconds = load_seconds;
  out.computed_tokens = static_cast<int>(n - hit);
  out.kv_tokens = static_cast<int>(n);
  return out;
}

Result<PrefillOutcome> Prefiller::RunBlend(const PrefillJob& job, const PrefetchedKv* kv) {
  const BlendJob& b = *job.blend;
  const auto n = static_cast<int64_t>(job.tokens.size());
  int64_t at = b.head_tokens;
  if (b.head_tokens < 0) return InvalidArgument("blend: negative head_tokens");
  for (int len : b.segment_tokens) {
    if (len <= 0) return InvalidArgument("blend: a document has no tokens");
    at += len;
  }
  if (at >= n) {
    return InvalidArgument("blend: the documents take the whole prompt; a question must follow");
  }
  const kvbus::KeyContext ctx{fingerprint_, job.ns, options_.chunk_tokens};
  std::vector<blend::Segment> segments;
  int64_t dropped = 0;  // tokens of pruned documents with no KV
  const int32_t* p = job.tokens.data();
  if (b.head_tokens > 0) {
    segments.push_back({{p, p + b.head_tokens}, nullptr});
    p += b.head_tokens;
  }
  if (!b.steer.empty() && b.steer.size() != b.segment_tokens.size()) {
    return InvalidArgument("blend: " + std::to_string(b.steer.size()) +
                           " steered versions named for " +
                           std::to_string(b.segment_tokens.size()) + " documents");
  }
  for (size_t i = 0; i < b.segment_tokens.size(); ++i) {
    const int len = b.segment_tokens[i];
    blend::Segment s{{p, p + len}, nullptr};
    p += len;
    KDN_ASSIGN_OR_RETURN(const kvbus::ChunkKey key, BlendDocumentKey(ctx, s.tokens, b, i, kv));
    Result<std::shared_ptr<const kvbus::Chunk>> chunk = NotFound("not prefetched");
    if (kv == nullptr) {
      chunk = store_.Get(key);
    } else if (auto it = kv->segments.find(key); it != kv->segments.end()) {
      chunk = it->second;
    } else if (store_.host() != nullptr) {
      // Stored here since the read (a job before this one computed it):
      // host memory, no round trip.
      chunk = store_.host()->Get(key);
    }
    if (chunk.ok() && kvbus::SegmentChunkFits(**chunk, fingerprint_, len, chunk_dtype_)) {
      s.kv = *std::move(chunk);
      dropped += len - blend::SegmentSlots(s.kv->info());
      // The steered token keeps its steered KV (Steer: the document's last).
      if (i < b.steer.size() && b.steer[i]) s.pinned = {len - 1};
    } else if (i < b.steer.size() && b.steer[i]) {
      // A steered version is made by an edit, never computed here: the
      // document's own KV under its key would be the unsteered one.
      return InvalidArgument("document " + std::to_string(i) + "'s version steered by '" +
                             b.steer[i]->vector + "' at strength " +
                             std::to_string(b.steer[i]->strength) +
                             " is not in the KDN; POST /v1/kdn/edit with steer stores it");
    } else if (std::none_of(missing_segments_.begin(), missing_segments_.end(),
                            [&](const auto& m) { return m.first == key; })) {
      missing_segments_.emplace_back(key, s.tokens);
    }
    segments.push_back(std::move(s));
  }
  const std::span<const int32_t> suffix(p, job.tokens.data() + n);

  // The fused KV is this request's alone: one region under the transfer key,
  // a slot per token but the pruned documents' dropped ones.
  const int64_t kv_slots = n - dropped;
  engine::KvCache& cache = model_.kv_cache();
  seq_ = cache.NewSequence();
  if (b.emphasis) {
    // Its spans are prompt positions, which are KV slots unless a pruned
    // document dropped some.
    if (dropped > 0) {
      return InvalidArgument(
          "emphasis: a document of this prompt is stored pruned, and emphasis does not go "
          "with pruned KV");
    }
    KDN_RETURN_IF_ERROR(
        seq_.SetAttentionBias({b.emphasis->spans, b.emphasis->heads, b.emphasis->bias}));
  }
  Push push{*this, job, seq_,
            kvbus::TransferRegions(0, kv_slots, options_.chunk_tokens, 0, job.transfer_id)};
  if (!job.decode_endpoint.empty()) {
    KDN_ASSIGN_OR_RETURN(push.sender, SenderFor(job.decode_endpoint));
  }
  blend::BlendOptions bo;
  bo.spec = b;
  bo.kl_per_residual = options_.blend_kl_per_residual;
  bo.on_layer = [&](int layer) { return push.Layer(layer); };
  KDN_ASSIGN_OR_RETURN(blend::BlendResult r,
                       blend::BlendPrefill(model_, seq_, segments, suffix, bo));
  if (seq_.length() != kv_slots) {
    return Internal("blend: the fused KV fills " + std::to_string(seq_.length()) +
                    " slots, not the " + std::to_string(kv_slots) + " planned");
  }
  PrefillOutcome out;
  KDN_RETURN_IF_ERROR(push.Finish(&out));
  engine::Sampler sampler(job.sampling);
  sampler.Advance(static_cast<int>(job.generated_tokens));
  out.first_token = sampler.Sample(r.logits);
  // A pruned document's dropped tokens count as its others do: the KDN
  // gave the document (they are pruned_tokens too).
  out.cached_tokens = r.cached_tokens + r.dropped_tokens;
  out.blended_tokens = out.cached_tokens;
  out.recomputed_tokens = r.recomputed_tokens;
  out.question_pass_tokens = r.question_pass_tokens;
  out.recompute_ratio = r.recompute_ratio;
  out.computed_tokens = r.computed_tokens;
  out.pruned_tokens = r.dropped_tokens;
  out.kv_tokens = static_cast<int>(kv_slots);
  out.kv_holes = kvbridge::PackHoles(cache, seq_, kv_slots);
  return out;
}

Result<std::shared_ptr<const kvbus::Chunk>> Prefiller::ComputeSegment(
    const kvbus::ChunkKey& key, std::span<const int32_t> tokens, const prune::PruneSpec* prune,
    const kvbus::Chunk* base) {
  engine::KvCache& cache = model_.kv_cache();
  engine::KvSequence seq = cache.NewSequence();
  if (prune != nullptr) {
    prune::PruneSpec spec = *prune;
    // A method's default per head is KV this engine could not attend (kvzip
    // scored profiled or combined, asked for, chooses globally all the same).
    if (!spec.granularity && !model_.attends_holes() &&
        (!spec.scoring || *spec.scoring == prune::KvzipScoring::kFull)) {
      spec.granularity = prune::Granularity::kToken;
    }
    const prune::HeadBudgets* budgets = nullptr;
    KDN_RETURN_IF_ERROR(prune::CheckPruneText(model_.config(), std::ssize(tokens), spec));
    if (prune::ScoringOf(spec) == prune::KvzipScoring::kProfiled) {
      KDN_ASSIGN_OR_RETURN(budgets, HeadBudgets(spec));
    }
    KDN_ASSIGN_OR_RETURN(prune::KeptTokens kept,
                         prune::PruneText(model_, tokens, spec, &seq, budgets));
    return prune::PrunedChunkOf(cache, seq, kept, key, fingerprint_, chunk_dtype_);
  }
  KDN_RETURN_IF_ERROR(cache.Reserve(seq, static_cast<int64_t>(tokens.size())));
  size_t from = 0;
  if (base != nullptr) {
    // The original's KV at its place; the erratum is computed after it.
    KDN_RETURN_IF_ERROR(kvbridge::ChunkToPagedKv(*base, cache, seq, 0));
    from = base->info().tokens;
    cache.SetLength(seq, static_cast<int64_t>(from));
  }
  std::vector<float> logits;
  KDN_RETURN_IF_ERROR(model_.Prefill(seq, tokens.subspan(from), {}, &logits));
  return kvbridge::ChunkFromPagedKv(cache, seq, 0, seq.length(), key, fingerprint_, chunk_dtype_);
}

Result<const prune::HeadBudgets*> Prefiller::HeadBudgets(const prune::PruneSpec& spec) {
  if (head_budgets_) return &*head_budgets_;
  if (options_.budget_texts.empty()) {
    return FailedPrecondition(
        "prune: kvzip's profiled scoring needs texts to measure the model's head budgets on");
  }
  const auto t0 = std::chrono::steady_clock::now();
  KDN_ASSIGN_OR_RETURN(head_budgets_, prune::MeasureHeadBudgets(
                                          model_, options_.budget_texts,
                                          {spec.kvzip_first, spec.kvzip_next, spec.kvzip_suffix}));
  LogInfo("kvzip head budgets measured on {} texts in {:.1f} s (once per worker)",
          options_.budget_texts.size(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return &*head_budgets_;
}

std::shared_ptr<const kvbus::Chunk> Prefiller::InjectBase(kvbus::ChunkStore& from,
                                                          std::span<const int32_t> tokens,
                                                          const std::string& ns,
                                                          const InjectSpec& spec) const {
  const auto n = static_cast<int64_t>(tokens.size());
  if (spec.base_tokens <= 0 || spec.base_tokens >= n || spec.prune) return nullptr;
  const std::span<const int32_t> original = tokens.first(static_cast<size_t>(spec.base_tokens));
  Result<std::shared_ptr<const kvbus::Chunk>> chunk =
      from.Get(kvbus::SegmentKey({fingerprint_, ns, options_.chunk_tokens}, original));
  // Whole (not pruned), of this model and KV type.
  if (!chunk.ok() || !kvbus::ChunkFits(**chunk, fingerprint_, spec.base_tokens, chunk_dtype_)) {
    return nullptr;
  }
  return *std::move(chunk);
}

void Prefiller::PutChunk(std::shared_ptr<const kvbus::Chunk> chunk,
                         std::function<void(Status)> then) {
  if (!store_io_) {
    then(store_.Put(std::move(chunk)));
    return;
  }
  // Host memory at once, so that the jobs after this one find the chunk
  // whether or not the store thread has got to it; every tier there.
  if (store_.host() != nullptr) (void)store_.host()->Put(chunk);
  store_io_->Post(0, [&store = store_, chunk = std::move(chunk), then = std::move(then)]() mutable {
    then(store.Put(std::move(chunk)));
  });
}

void Prefiller::Inject(std::span<const int32_t> tokens, const std::string& ns,
                       const InjectSpec& spec, const PrefetchedKv* kv, InjectDone done) {
  if (spec.steering_vector)
    return MakeSteeringVector(ns, *spec.steering_vector, kv, std::move(done));
  if (tokens.empty()) return done(InvalidArgument("inject: an empty document"));
  const prune::PruneSpec* prune = spec.prune ? &*spec.prune : nullptr;
  if (prune != nullptr) {
    if (Status st = prune::ValidatePruneSpec(*prune); !st.ok()) return done(st);
  }
  const auto n = static_cast<int64_t>(tokens.size());
  if (n > model_.config().max_context) {
    return done(InvalidArgument("inject: a document of " + std::to_string(n) +
                                " tokens exceeds the model's context of " +
                                std::to_string(model_.config().max_context)));
  }
  if (spec.steer) {
    if (prune != nullptr || spec.base_tokens != 0) {
      return done(InvalidArgument("inject: a steer edit neither prunes nor adds an erratum"));
    }
    return Steer(tokens, ns, *spec.steer, kv, std::move(done));
  }
  if (spec.base_tokens < 0 || spec.base_tokens >= n ||
      (spec.base_required && spec.base_tokens == 0)) {
    return done(InvalidArgument("inject: an erratum's original of " +
                                std::to_string(spec.base_tokens) + " tokens in a document of " +
                                std::to_string(n) + " (the erratum must not be empty)"));
  }
  if (spec.base_tokens > 0 && prune != nullptr) {
    return done(InvalidArgument("inject: a document with an erratum is stored whole, not pruned"));
  }
  const kvbus::ChunkKey key = kvbus::SegmentKey({fingerprint_, ns, options_.chunk_tokens}, tokens);
  // Read before, off this thread; or stored here since (host memory).
  const bool held =
      kv == nullptr ? store_.Contains(key)
                    : kv->inject_held || (store_.host() != nullptr && store_.host()->Contains(key));
  if (held) return done(InjectOutcome{true, 0});
  std::shared_ptr<const kvbus::Chunk> base;
  if (spec.base_tokens > 0) {
    // Read before, off this thread; or stored here since (host memory), as
    // for `held` above: the compute thread does not wait on a remote tier.
    if (kv == nullptr) {
      base = InjectBase(store_, tokens, ns, spec);
    } else if (kv->inject_base != nullptr) {
      base = kv->inject_base;
    } else if (store_.host() != nullptr) {
      base = InjectBase(*store_.host(), tokens, ns, spec);
    }
    if (base == nullptr && spec.base_required) {
      return done(NotFound("inject: the document to edit (its first " +
                           std::to_string(spec.base_tokens) +
                           " tokens) is not in the KDN whole; inject it first"));
    }
  }
  Result<std::shared_ptr<const kvbus::Chunk>> chunk =
      ComputeSegment(key, tokens, prune, base.get());
  if (!chunk.ok()) return done(chunk.status());
  const int64_t stored = (*chunk)->info().stored_tokens();
  PutChunk(*std::move(chunk), [done = std::move(done), stored](Status st) {
    if (st.ok()) {
      done(InjectOutcome{false, stored});
    } else {
      done(st);
    }
  });
}

Result<Prefiller::InjectOutcome> Prefiller::Inject(std::span<const int32_t> tokens,
                                                   const std::string& ns, const InjectSpec& spec,
                                                   const PrefetchedKv* kv) {
  std::promise<Result<InjectOutcome>> outcome;
  std::future<Result<InjectOutcome>> ready = outcome.get_future();
  Inject(tokens, ns, spec, kv,
         [&outcome](Result<InjectOutcome> r) { outcome.set_value(std::move(r)); });
  return ready.get();
}

Result<Prefiller::InjectOutcome> Prefiller::Inject(std::span<const int32_t> tokens,
                                                   const std::string& ns,
                                                   const prune::PruneSpec* prune,
                                                   const PrefetchedKv* kv) {
  InjectSpec spec;
  if (prune != nullptr) spec.prune = *prune;
  return Inject(tokens, ns, spec, kv);
}

Status Prefiller::StoreNewChunks() {
  Status first_error;
  engine::KvCache& cache = model_.kv_cache();
  // Every span of the prompt stays in the pool, resident, until the pool
  // needs the blocks (the lower tiers hold, or are about to hold, the same
  // KV).
  if (options_.resident) kvbridge::PublishSpans(cache, seq_, spans_);
  // The new full chunks, then the tail pieces, so that a prompt extending
  // this one (the next turn of a chat) computes only its new tokens.
  std::vector<std::shared_ptr<const kvbus::Chunk>> chunks;
  for (size_t i = static_cast<size_t>(first_new_chunk_); i < spans_.size(); ++i) {
    const kvbus::KeyedSpan& s = spans_[i];
    if (seq_.length() < s.first + s.count) break;
    if (!store_io_ && store_.Contains(s.key)) continue;
    auto chunk = kvbridge::ChunkFromPagedKv(cache, seq_, s.first, s.count, s.key, fingerprint_,
                                            chunk_dtype_);
    if (!chunk.ok()) {
      if (first_error.ok()) first_error = chunk.status();
      break;  // prefix keys: the chunks past a missing one are never reached
    }
    if (store_io_) {
      chunks.push_back(*std::move(chunk));
    } else if (Status st = store_.Put(*std::move(chunk)); !st.ok() && first_error.ok()) {
      first_error = st;
    }
  }
  if (store_io_ && !chunks.empty()) {
    store_io_->Post(0, [&store = store_, failures = store_failures_, chunks = std::move(chunks)] {
      const kvbus::PutOutcome put = kvbus::PutMissing(store, chunks);
      if (!put.error.ok()) {
        const uint64_t n = ++*failures;
        LogError(
            "storing a prompt's chunks failed, {} of them not stored ({} failures so far): "
            "{}",
            put.not_stored, n, put.error.ToString());
      }
    });
  }
  seq_.Reset();
  keys_.clear();
  spans_.clear();
  // A blend's missing documents: computed here, put like the chunks above.
  // What Prefetch found missing is asked again of host memory only (stored
  // here since), so this thread waits on no lower tier.
  for (const auto& [key, tokens] : missing_segments_) {
    if (prefetched_ ? store_.host() != nullptr && store_.host()->Contains(key)
                    : store_.Contains(key)) {
      continue;
    }
    Result<std::shared_ptr<const kvbus::Chunk>> chunk = ComputeSegment(key, tokens);
    if (!chunk.ok()) {
      if (first_error.ok()) first_error = chunk.status();
      continue;
    }
    if (!store_io_) {
      if (Status st = store_.Put(*std::move(chunk)); !st.ok() && first_error.ok()) first_error = st;
      continue;
    }
    PutChunk(*std::move(chunk), [failures = store_failures_](Status st) {
      if (st.ok()) return;
      const uint64_t n = ++*failures;
      LogError("storing a blended document failed ({} failures so far): {}", n, st.ToString());
    });
  }
  missing_segments_.clear();
  return first_error;
}

}  // namespace kdn::prefill_worker
