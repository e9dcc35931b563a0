// The prefill worker's steering (docs/serving.md, "Steering a document"):
// making a steering vector from prompt pairs and storing it under its name,
// and a steer edit, a stored document copied under its steered key with a
// vector added (kdn/kvbridge/steer.h). Both are Inject jobs.
#include "kdn/common/log.h"
#include "kdn/kvbridge/steer.h"
#include "kdn/prefill_worker/prefiller.h"

namespace kdn::prefill_worker {

namespace {

// A chunk under `key` in `from`; null when absent or unreadable.
std::shared_ptr<const kvbus::Chunk> Read(kvbus::ChunkStore& from, const kvbus::ChunkKey& key) {
  Result<std::shared_ptr<const kvbus::Chunk>> chunk = from.Get(key);
  return chunk.ok() ? *std::move(chunk) : nullptr;
}

}  // namespace

std::optional<kvbus::ChunkKey> Prefiller::VectorId(const kvbus::KeyContext& ctx,
                                                   const std::string& name,
                                                   const PrefetchedKv* kv) const {
  const kvbus::ChunkKey key = kvbus::SteeringVectorKey(ctx, name);
  if (kv != nullptr) {
    if (auto it = kv->vector_ids.find(key); it != kv->vector_ids.end()) return it->second;
  }
  // Read here when nothing was read ahead; else stored here since (host
  // memory): the compute thread waits on no remote tier.
  kvbus::ChunkStore* from =
      kv == nullptr ? static_cast<kvbus::ChunkStore*>(&store_) : store_.host();
  std::shared_ptr<const kvbus::Chunk> chunk = from != nullptr ? Read(*from, key) : nullptr;
  if (chunk == nullptr || !chunk->info().is_steering()) return std::nullopt;
  return kvbus::SteeringVectorId(*chunk);
}

Result<kvbus::ChunkKey> Prefiller::BlendDocumentKey(const kvbus::KeyContext& ctx,
                                                    std::span<const int32_t> doc,
                                                    const BlendJob& blend, size_t i,
                                                    const PrefetchedKv* kv) const {
  const kvbus::ChunkKey key = kvbus::SegmentKey(ctx, doc);
  if (i >= blend.steer.size() || !blend.steer[i]) return key;
  const blend::SteerSpec& s = *blend.steer[i];
  const std::optional<kvbus::ChunkKey> id = VectorId(ctx, s.vector, kv);
  if (!id) {
    return InvalidArgument("document " + std::to_string(i) + " names a version steered by '" +
                           s.vector + "', and the KDN holds no steering vector of that name; " +
                           "POST /v1/kdn/steering makes one");
  }
  return kvbus::SteeredKey(key, *id, s.strength);
}

void Prefiller::PrefetchSteering(const PrefillJob& job, const InjectSpec& spec,
                                 PrefetchedKv* kv) const {
  const kvbus::KeyContext ctx{fingerprint_, job.ns, options_.chunk_tokens};
  if (spec.steering_vector) {
    kv->steering = Read(store_, kvbus::SteeringVectorKey(ctx, spec.steering_vector->name));
    return;
  }
  const kvbus::ChunkKey doc = kvbus::SegmentKey(ctx, job.tokens);
  kv->steering = Read(store_, kvbus::SteeringVectorKey(ctx, spec.steer->vector));
  if (kv->steering != nullptr && kv->steering->info().is_steering()) {
    kv->inject_held = store_.Contains(
        kvbus::SteeredKey(doc, kvbus::SteeringVectorId(*kv->steering), spec.steer->strength));
    if (kv->inject_held) return;
  }
  kv->inject_base = Read(store_, doc);
}

void Prefiller::Steer(std::span<const int32_t> tokens, const std::string& ns,
                      const blend::SteerSpec& steer, const PrefetchedKv* kv, InjectDone done) {
  if (Status st = blend::CheckSteerStrength(steer.strength); !st.ok()) return done(st);
  if (Status st = blend::CheckSteeringName(steer.vector); !st.ok()) return done(st);
  const auto n = static_cast<int64_t>(tokens.size());
  const kvbus::KeyContext ctx{fingerprint_, ns, options_.chunk_tokens};
  const kvbus::ChunkKey doc_key = kvbus::SegmentKey(ctx, tokens);
  // What Prefetch read before, off this thread, or what was stored here
  // since (host memory): the compute thread waits on no remote tier.
  if (kv != nullptr && kv->inject_held) return done(InjectOutcome{true, 0});
  kvbus::ChunkStore* here =
      kv == nullptr ? static_cast<kvbus::ChunkStore*>(&store_) : store_.host();
  std::shared_ptr<const kvbus::Chunk> vector_chunk = kv != nullptr ? kv->steering : nullptr;
  if (vector_chunk == nullptr && here != nullptr) {
    vector_chunk = Read(*here, kvbus::SteeringVectorKey(ctx, steer.vector));
  }
  if (vector_chunk == nullptr) {
    return done(FailedPrecondition("steer: no steering vector named '" + steer.vector +
                                   "' in the KDN under this cache_salt; POST /v1/kdn/steering "
                                   "makes one"));
  }
  Result<kvbridge::SteeringVector> vector = kvbus::SteeringFromChunk(*vector_chunk);
  if (!vector.ok()) return done(vector.status());
  const kvbus::ChunkKey key =
      kvbus::SteeredKey(doc_key, kvbus::SteeringVectorId(*vector_chunk), steer.strength);
  if (here != nullptr && here->Contains(key)) return done(InjectOutcome{true, 0});
  std::shared_ptr<const kvbus::Chunk> doc = kv != nullptr ? kv->inject_base : nullptr;
  if (doc == nullptr && here != nullptr) doc = Read(*here, doc_key);
  if (doc == nullptr || !kvbus::ChunkFits(*doc, fingerprint_, n, chunk_dtype_)) {
    return done(NotFound("steer: the document to steer (" + std::to_string(n) +
                         " tokens) is not in the KDN whole; inject it first"));
  }
  // The document's last token, as KV cache steering adds its vector to the
  // last token of the prompt's cache (docs/kvbus.md, "Editing stored KV").
  Result<std::shared_ptr<const kvbus::Chunk>> steered =
      kvbridge::SteerChunkValues(*doc, *vector, steer.strength, n - 1, 1, key);
  if (!steered.ok()) return done(steered.status());
  PutChunk(*std::move(steered), [done = std::move(done), n](Status st) {
    if (st.ok()) {
      done(InjectOutcome{false, n});
    } else {
      done(st);
    }
  });
}

void Prefiller::MakeSteeringVector(const std::string& ns, const blend::SteeringVectorSpec& spec,
                                   const PrefetchedKv* kv, InjectDone done) {
  const model::ModelConfig& cfg = model_.config();
  if (Status st = blend::CheckSteeringVectorSpec(spec, cfg.num_layers, cfg.max_context); !st.ok()) {
    return done(st);
  }
  const kvbus::KeyContext ctx{fingerprint_, ns, options_.chunk_tokens};
  const kvbus::ChunkKey key = kvbus::SteeringVectorKey(ctx, spec.name);
  kvbus::ChunkStore* here =
      kv == nullptr ? static_cast<kvbus::ChunkStore*>(&store_) : store_.host();
  std::shared_ptr<const kvbus::Chunk> held = kv != nullptr ? kv->steering : nullptr;
  if (held == nullptr && here != nullptr) held = Read(*here, key);
  if (held != nullptr) {
    // One vector per name: the same one again is held, another is refused.
    Result<kvbridge::SteeringVector> old = kvbus::SteeringFromChunk(*held);
    if (old.ok() && old->layers == spec.layers && old->pairs == spec.pairs) {
      return done(InjectOutcome{true, 0});
    }
    return done(FailedPrecondition("the steering vector '" + spec.name +
                                   "' exists, made from other pairs or layers; choose another "
                                   "name"));
  }
  Result<kvbridge::SteeringVector> vector =
      kvbridge::ValueSteeringVector(model_, spec.name, spec.pairs, spec.layers);
  if (!vector.ok()) return done(vector.status());
  Result<std::shared_ptr<const kvbus::Chunk>> chunk =
      kvbus::SteeringChunk(*vector, cfg.num_layers, key, fingerprint_);
  if (!chunk.ok()) return done(chunk.status());
  PutChunk(*std::move(chunk), [done = std::move(done)](Status st) {
    if (st.ok()) {
      done(InjectOutcome{false, 0});
    } else {
      done(st);
    }
  });
}

}  // namespace kdn::prefill_worker
