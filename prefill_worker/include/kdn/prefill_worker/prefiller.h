#pragma once
// Prefiller: the prefill worker's job, one request at a time
// (docs/design.md, "One request, step by step", steps 3 to 5).
//
//  1. Cut the prompt into chunks and take the longest prefix of them that the
//     KDN holds, then the tail pieces past them (docs/kvbus.md, "Tail
//     keys"): at most all but the prompt's last token, whose logits are
//     needed. The engine's pool is the first tier: what it holds resident is
//     attached by reference (kvbridge/resident.h), and only the rest is
//     loaded from the host tier, the disk tier or kdn-store (by Prefetch,
//     off the compute thread, in a worker).
//  2. Compute the rest with the engine, and as each layer finishes push that
//     layer of the KV the decode worker lacks (every chunk past the ones it
//     said it holds, plus the partial tail) over kvbus as layer slices.
//  3. Wait until the decode worker has every slice, sample the first token.
//  4. After the reply (StoreNewChunks), store the prompt's new full chunks
//     and its tail pieces in the KDN so the next request with this prefix
//     (or extending this prompt) loads them, and publish all of them in the
//     pool's resident index, so that the next one here attaches them.
//
// A blend job (CacheBlend; docs/serving.md, "Documents") instead looks each
// document up under its segment key, fuses the KV of those it finds
// (blend::BlendPrefill) and computes the rest in full. Its KV is not exact,
// so it travels under the request's transfer key only and is never stored
// under prefix keys; documents the KDN lacked are computed on their own and
// stored under their segment keys after the reply. Inject stores a document
// that way ahead of any question, pruned if asked (kdn/prune): a pruned
// document's dropped tokens have no KV in the fused prompt, which then
// fills fewer KV slots than it has tokens (PrefillOutcome::kv_tokens), and
// the decode worker places that many and goes on at the prompt's length.
//
// KDN reads off the compute thread: Prefetch reads what a job needs from
// the KDN's tiers (its cached prefix past what the pool holds, a blend
// job's documents, whether an injected document is held) and touches only
// the store and the pool's resident index, so a worker runs it on an I/O
// thread while the compute thread serves other jobs; Run and Inject then
// take what it read and wait on no tier. Without it they read the tiers
// themselves.
//
// Not thread-safe but for Prefetch: the worker's compute loop owns it, with
// the Engine. The store is shared (thread-safe).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kdn/blend/blend.h"
#include "kdn/common/job_thread.h"
#include "kdn/common/status.h"
#include "kdn/engine/engine.h"
#include "kdn/control/request_spec.h"
#include "kdn/engine/sampler.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/kv_events.h"
#include "kdn/kvbus/prefix_io.h"
#include "kdn/kvbus/tiered_store.h"
#include "kdn/kvbus/transport.h"
#include "kdn/prune/head_budgets.h"

namespace kdn::prefill_worker {

// The router's blend spec as it crossed the edge (control/request_spec.h).
using BlendJob = blend::BlendSpec;

struct PrefillJob {
  std::vector<int32_t> tokens;
  std::string ns;  // the tenant's cache namespace
  model::SamplingParams sampling;
  // The decode worker's kvbus endpoint; empty: the KV is not pushed (the
  // prompt is only prefilled and cached, as for a benchmark or a warm-up).
  std::string decode_endpoint;
  // Leading tokens the decode worker already has: never sent.
  int64_t decode_held_tokens = 0;
  // Unique per request; names the slices of the partial tail (of the whole
  // prompt for a blend job).
  std::string transfer_id;
  std::optional<BlendJob> blend;
  // A resumed request (docs/serving.md, "A decode worker lost"): the last
  // generated_tokens of `tokens` it generated before; its first token is the
  // draw of its sampler's stream that follows theirs.
  int64_t generated_tokens = 0;
};

// What Prefetch read for a job. The compute thread may find more of the
// prompt resident than `resident` (it is attached, and the chunks read for
// those tokens are not placed) or less (evicted meanwhile: the tokens past
// what is resident now are computed). A document the read missed that this
// worker stored since (a job before computed it) is found in the host tier.
struct PrefetchedKv {
  int64_t resident = 0;                    // leading prompt tokens the pool held when read
  std::vector<kvbus::FetchedSpan> prefix;  // kvbus::FetchPrefix past them
  // A blend job's documents the KDN held, by segment key.
  std::map<kvbus::ChunkKey, std::shared_ptr<const kvbus::Chunk>> segments;
  bool inject_held = false;  // an injected document's KV is held already
  // An erratum edit's original (InjectSpec::base_tokens), or the document a
  // steer edit steers, when the KDN held it whole.
  std::shared_ptr<const kvbus::Chunk> inject_base;
  // The steering vector a steer edit, or a vector to make, names, when the
  // KDN held one under its name.
  std::shared_ptr<const kvbus::Chunk> steering;
  // A blend job's steering vectors the KDN held: their ids, by name key.
  std::map<kvbus::ChunkKey, kvbus::ChunkKey> vector_ids;
};

// What Inject stores beyond a plain document.
struct InjectSpec {
  std::optional<prune::PruneSpec> prune;  // the KV pruned when stored
  // An erratum edit (docs/serving.md, "Editing a document"): the document's
  // leading base_tokens are a document stored on its own (the original),
  // whose KV is read from the KDN, and only the tokens after them (the
  // erratum) are computed, at their place after it. The KV is the one a
  // prefill of the whole gives (the engine's rows do not depend on the rows
  // beside them). 0: no base.
  int64_t base_tokens = 0;
  // The original must be held (POST /v1/kdn/edit): NOT_FOUND when the KDN
  // lacks it whole, and nothing stored. False: it is computed with the rest.
  bool base_required = false;
  // A steer edit (docs/serving.md, "Steering a document"): the document,
  // which the KDN must hold whole (else NOT_FOUND), is stored again under
  // its steered key (kvbus::SteeredKey) with the named vector, which the KDN
  // must hold (else FAILED_PRECONDITION), added to its last token's values.
  std::optional<blend::SteerSpec> steer;
  // A steering vector to make and store under its name (the document is
  // empty): already held when the name holds the same vector (layers and
  // pairs), FAILED_PRECONDITION when it holds another.
  std::optional<blend::SteeringVectorSpec> steering_vector;
};

struct PrefillOutcome {
  int32_t first_token = -1;
  int cached_tokens = 0;         // taken from the KDN (resident or loaded)
  int resident_tokens = 0;       // of cached_tokens: attached from the pool, no KV moved
  int tail_tokens = 0;           // of cached_tokens: from tail pieces past the last full chunk
  uint64_t kv_bytes_loaded = 0;  // KV copied into the pool from the KDN's lower tiers
  double load_seconds = 0;       // looking up and placing the cached prefix
  int computed_tokens = 0;       // run through the model in full
  int blended_tokens = 0;        // of cached_tokens: fused from documents' KV
  // Of blended_tokens: tokens of pruned documents with no KV (pruned away
  // when stored), so the prompt's KV fills kv_tokens slots, not one per token.
  int pruned_tokens = 0;
  int kv_tokens = 0;
  // Their holes, where a document pruned per head was blended
  // (kvbridge::PackHoles over kv_tokens slots; PrefillReply.kv_holes).
  std::string kv_holes;
  int recomputed_tokens = 0;     // of blended_tokens: recomputed past the check layer
  int question_pass_tokens = 0;  // a query selection's pass (blend::BlendResult)
  double recompute_ratio = 0;    // a blend's: the request's, or its quality target's
  uint64_t kv_bytes_sent = 0;
  // Layer slices not sent because the decode worker held them: the chunks it
  // said it holds, and slices its receiver answered HELD for.
  uint32_t slices_skipped = 0;
  // Of the slices pushed, those read where they lie in the pool
  // (PrefillerOptions::kv_pool) rather than built as chunks first.
  uint32_t slices_sourced = 0;
};

struct PrefillerOptions {
  int chunk_tokens = kvbus::kDefaultChunkTokens;
  kvbus::SenderOptions sender;
  // How long to wait, after the last layer, for the decode worker to have
  // every slice.
  std::chrono::milliseconds push_timeout{30000};
  // The shortest tail match used (kvbus::MatchPrefix).
  int64_t min_tail_tokens = kvbus::kMinTailTokens;
  // Keep prompts' KV resident in the pool and attach it (false: every hit
  // is loaded from the lower tiers, as before the pool was a tier; for
  // benchmarks).
  bool resident = true;
  // StoreNewChunks hands the chunks it copied out to a thread of the
  // Prefiller's own, which asks the store and puts them, so that the next
  // request does not wait for a write-through to kdn-store (the worker);
  // false: it puts them itself before it returns (tests, benchmarks).
  bool store_in_background = false;
  // A blend's quality target's slope (blend::BlendOptions::kl_per_residual).
  double blend_kl_per_residual = blend::kDefaultKlPerResidual;
  // The engine's KV pool as memory of a DeviceOps backend (the worker
  // allocates it so, kdn/kvbus/device_ops.h); borrowed, it must outlive the
  // Prefiller. Set: pushed layer slices are sourced from the request's own
  // blocks (kvbus::SourcedChunk), which a region plane of the pool's
  // backend copies straight into the decode worker's blocks; null, or a
  // slice in a block the sequence shares: each slice is built as a chunk in
  // host memory first.
  const kvbus::DeviceMemory* kv_pool = nullptr;
  // The worker's KV event stream (kdn/kvbus/kv_events.h), borrowed: each
  // prompt's full chunks are described to it, so that the host tier's
  // events carry their tokens. Null: no stream.
  kvbus::HostTierEvents* events = nullptr;
  // The texts kvzip's head budgets are measured on (prune::CalibrationTexts
  // in the model's vocabulary: the worker tokenizes them), once, at the
  // first document pruned by kvzip's profiled scoring. Empty: such a
  // document is refused (FAILED_PRECONDITION).
  std::vector<std::vector<int32_t>> budget_texts;
};

class Prefiller {
 public:
  // Borrows `model` and `store`, which must outlive it.
  Prefiller(engine::Engine& model, kvbus::TieredStore& store, kvbus::ChunkKey model_fingerprint,
            PrefillerOptions options);
  ~Prefiller();

  // Runs one job (steps 1-3). INVALID_ARGUMENT for an empty prompt, ids
  // outside the vocabulary or a prompt beyond the context;
  // RESOURCE_EXHAUSTED without free KV blocks; UNAVAILABLE when the decode
  // worker does not take the KV. The job's KV stays held until
  // StoreNewChunks or the next Run.
  // `kv`: what Prefetch read for this job; null: Run reads the tiers.
  Result<PrefillOutcome> Run(const PrefillJob& job, const PrefetchedKv* kv = nullptr);

  // Reads from the KDN's tiers what Run (or, with `inject`, Inject of
  // job.tokens) of `job` needs. Thread-safe, on any thread while the compute
  // thread works: it uses only the store and KvCache's thread-safe resident
  // lookups. A job Run would refuse gets an empty result.
  PrefetchedKv Prefetch(const PrefillJob& job, const InjectSpec* inject = nullptr) const;

  // Stores the last job's computed full chunks that the store lacks (for a
  // blend job: the documents the KDN lacked, each computed on its own), then
  // frees its KV. A store failure is returned but loses nothing but reuse.
  // With store_in_background, the chunks' KV is copied out here and put on
  // the store thread; its failures are logged and counted (StoreFailures).
  Status StoreNewChunks();
  // Waits until the store thread has put what it was handed.
  void WaitForStores();
  uint64_t StoreFailures() const;

  // Knowledge injection: computes `tokens` (one document) on its own and
  // stores its KV under its segment key; with `prune`, only the tokens its
  // method keeps (a pruned chunk; docs/kvbus.md, "Pruned KV"), which blend
  // jobs reuse as they reuse whole documents; with a base, on top of the
  // original's stored KV (InjectSpec). Nothing is computed when the store
  // already holds KV under the key, pruned or not. INVALID_ARGUMENT for an
  // empty document, ids outside the vocabulary, one beyond the context, a
  // bad prune spec, a base with pruning or not shorter than the document;
  // NOT_FOUND for a required base the KDN lacks.
  struct InjectOutcome {
    bool already_held = false;
    int64_t stored_tokens = 0;  // tokens whose KV was stored (0 when already held)
  };
  using InjectDone = std::function<void(Result<InjectOutcome>)>;
  // `kv`: what Prefetch read for it; null: Inject asks the store itself.
  // `done` is called once the KV is stored (or nothing was to be): with
  // store_in_background on the store thread, after the compute thread has
  // gone on; else before Inject returns.
  void Inject(std::span<const int32_t> tokens, const std::string& ns, const InjectSpec& spec,
              const PrefetchedKv* kv, InjectDone done);
  // The same, returning once the KV is stored.
  Result<InjectOutcome> Inject(std::span<const int32_t> tokens, const std::string& ns,
                               const InjectSpec& spec, const PrefetchedKv* kv = nullptr);
  Result<InjectOutcome> Inject(std::span<const int32_t> tokens, const std::string& ns,
                               const prune::PruneSpec* prune = nullptr,
                               const PrefetchedKv* kv = nullptr);

  // What its kvbus senders moved, summed over every decode worker.
  kvbus::SenderStats TransportStats() const;

 private:
  Result<kvbus::Sender*> SenderFor(const std::string& endpoint);
  Result<PrefillOutcome> RunBlend(const PrefillJob& job, const PrefetchedKv* kv);
  // The layer-slice push of one job: Push(layer) submits that layer of every
  // region, Finish waits for them all and fills the outcome's figures.
  struct Push;
  // Computes a document alone into a chunk (seq_ must be free), pruned
  // with `prune`, or on top of `base`: the whole KV of its leading
  // base->info().tokens tokens.
  Result<std::shared_ptr<const kvbus::Chunk>> ComputeSegment(
      const kvbus::ChunkKey& key, std::span<const int32_t> tokens,
      const prune::PruneSpec* prune = nullptr, const kvbus::Chunk* base = nullptr);
  // The id (kvbus::SteeringVectorId) of the steering vector `name`: what
  // `kv` read ahead, else read here (the store without `kv`, else host
  // memory); nullopt when it is not held.
  std::optional<kvbus::ChunkKey> VectorId(const kvbus::KeyContext& ctx, const std::string& name,
                                          const PrefetchedKv* kv) const;
  // The key a blend job's document `i` is read under: its segment key, or
  // that of the steered version it names (INVALID_ARGUMENT when its vector
  // is not held).
  Result<kvbus::ChunkKey> BlendDocumentKey(const kvbus::KeyContext& ctx,
                                           std::span<const int32_t> doc, const BlendJob& blend,
                                           size_t i, const PrefetchedKv* kv) const;
  // Inject's steering: a steer edit of `tokens`, or a vector to make
  // (prefill_worker/src/steering.cpp).
  void Steer(std::span<const int32_t> tokens, const std::string& ns, const blend::SteerSpec& steer,
             const PrefetchedKv* kv, InjectDone done);
  void MakeSteeringVector(const std::string& ns, const blend::SteeringVectorSpec& spec,
                          const PrefetchedKv* kv, InjectDone done);
  // Prefetch's reads for them.
  void PrefetchSteering(const PrefillJob& job, const InjectSpec& spec, PrefetchedKv* kv) const;
  // An erratum edit's original, read from `from` (the store, or its host
  // tier; null when it is not held there whole).
  std::shared_ptr<const kvbus::Chunk> InjectBase(kvbus::ChunkStore& from,
                                                 std::span<const int32_t> tokens,
                                                 const std::string& ns,
                                                 const InjectSpec& spec) const;
  // Puts `chunk` in the store, then calls `then` with how it went: on the
  // store thread with store_in_background (after a put into host memory
  // here, so that the next job finds it), else here.
  void PutChunk(std::shared_ptr<const kvbus::Chunk> chunk, std::function<void(Status)> then);
  // The model's head budgets for kvzip's profiled scoring: measured on
  // options_.budget_texts with `spec`'s repeat prompts the first time.
  Result<const prune::HeadBudgets*> HeadBudgets(const prune::PruneSpec& spec);

  engine::Engine& model_;
  kvbus::TieredStore& store_;
  const kvbus::ChunkKey fingerprint_;
  const kdn::DType chunk_dtype_;  // the engine's KV element type
  const PrefillerOptions options_;
  std::map<std::string, std::unique_ptr<kvbus::Sender>> senders_;  // by endpoint
  std::optional<prune::HeadBudgets> head_budgets_;                 // measured at first use

  // With store_in_background: the thread that puts chunks, and the puts
  // that failed there.
  std::unique_ptr<JobThread> store_io_;
  std::shared_ptr<std::atomic<uint64_t>> store_failures_ =
      std::make_shared<std::atomic<uint64_t>>(0);

  // The last job, until StoreNewChunks.
  engine::KvSequence seq_;
  bool prefetched_ = false;  // the last job's KDN reads were done by Prefetch
  std::vector<kvbus::ChunkKey> keys_;
  // The prompt's full chunks then its tail pieces (kvbus::StoredSpans); those
  // from first_new_chunk_ on are stored by StoreNewChunks.
  std::vector<kvbus::KeyedSpan> spans_;
  int first_new_chunk_ = 0;
  // A blend job's documents that the KDN lacked: key and tokens.
  std::vector<std::pair<kvbus::ChunkKey, std::vector<int32_t>>> missing_segments_;
};

}  // namespace kdn::prefill_worker
