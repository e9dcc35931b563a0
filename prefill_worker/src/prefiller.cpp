#include "kdn/prefill_worker/prefiller.h"

#include <algorithm>

#include "kdn/control/transfer_plan.h"

namespace kdn::prefill_worker {


Prefiller::Prefiller(engine::Model& model, kvbus::TieredStore& store,
                     kvbus::ChunkKey model_fingerprint, PrefillerOptions options)
    : model_(model), store_(store), fingerprint_(model_fingerprint), options_(options) {}

Prefiller::~Prefiller() = default;

Result<kvbus::Sender*> Prefiller::SenderFor(const std::string& endpoint) {
  auto it = senders_.find(endpoint);
  if (it != senders_.end()) return it->second.get();
  KDN_ASSIGN_OR_RETURN(auto sender, kvbus::ConnectTcp(endpoint, options_.sender));
  kvbus::Sender* raw = sender.get();
  senders_.emplace(endpoint, std::move(sender));
  return raw;
}

Result<PrefillOutcome> Prefiller::Run(const PrefillJob& job) {
  seq_.Reset();
  keys_.clear();
  first_new_chunk_ = 0;
  const auto n = static_cast<int64_t>(job.tokens.size());
  const engine::ModelConfig& cfg = model_.config();
  if (n == 0) return InvalidArgument("prefill: empty prompt");
  if (n > cfg.max_context) {
    return InvalidArgument("prefill: a prompt of " + std::to_string(n) +
                           " tokens exceeds the model's context of " +
                           std::to_string(cfg.max_context));
  }
  KDN_RETURN_IF_ERROR(engine::ValidateSamplingParams(job.sampling));
  const int C = options_.chunk_tokens;
  const kvbus::KeyContext ctx{fingerprint_, job.ns, C};
  keys_ = kvbus::PrefixKeys(ctx, job.tokens);
  const auto full = static_cast<int64_t>(keys_.size());

  engine::PagedKvCache& cache = model_.kv_cache();
  seq_ = cache.NewSequence();
  KDN_RETURN_IF_ERROR(cache.Reserve(seq_, n));

  // 1. The cached prefix; the last token is always computed for its logits.
  const int64_t usable = std::min(full, (n - 1) / C);
  int64_t hit = 0;
  for (; hit < usable; ++hit) {
    auto chunk = store_.Get(keys_[hit]);
    if (!chunk.ok()) break;
    const kvbus::ChunkInfo& info = (*chunk)->info();
    if (info.tokens != static_cast<uint32_t>(C) || info.model_fingerprint != fingerprint_ ||
        info.dtype != kvbus::KvDType::kF32) {
      break;  // another chunking or precision: recompute rather than guess
    }
    if (!kvbus::ChunkToPagedKv(**chunk, cache, seq_, hit * C).ok()) break;
  }
  cache.SetLength(seq_, hit * C);
  first_new_chunk_ = static_cast<int>(hit);

  // 2. What the decode worker lacks, by region.
  const std::vector<control::KvRegion> regions = control::TransferRegions(
      keys_, n, C, job.decode_held_chunks, job.transfer_id);
  kvbus::Sender* sender = nullptr;
  if (!job.decode_endpoint.empty() && !regions.empty()) {
    KDN_ASSIGN_OR_RETURN(sender, SenderFor(job.decode_endpoint));
  }
  std::vector<uint64_t> batches;
  engine::PrefillOptions popts;
  if (sender != nullptr) {
    popts.on_layer = [&](int layer) -> Status {
      std::vector<std::shared_ptr<const kvbus::Chunk>> slices;
      slices.reserve(regions.size());
      for (const control::KvRegion& r : regions) {
        KDN_ASSIGN_OR_RETURN(auto slice, kvbus::LayerSliceFromPagedKv(
                                             cache, seq_, r.first, r.count, layer,
                                             kvbus::LayerSliceKey(r.parent, layer), fingerprint_,
                                             kvbus::KvDType::kF32));
        slices.push_back(std::move(slice));
      }
      KDN_ASSIGN_OR_RETURN(uint64_t batch, sender->Submit(std::move(slices)));
      batches.push_back(batch);
      return Status::Ok();
    };
  }
  std::vector<float> logits;
  const std::span<const int32_t> rest(job.tokens.data() + hit * C, n - hit * C);
  KDN_RETURN_IF_ERROR(model_.Prefill(seq_, rest, popts, &logits));

  // 3. Every slice delivered, then the first token.
  PrefillOutcome out;
  const auto deadline = std::chrono::steady_clock::now() + options_.push_timeout;
  for (uint64_t batch : batches) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    KDN_ASSIGN_OR_RETURN(kvbus::BatchStatus bs,
                         sender->Wait(batch, std::max(left, std::chrono::milliseconds(0))));
    Status st = bs.ToStatus();
    if (!st.ok()) {
      return Status(st.code() == StatusCode::kDeadlineExceeded ? StatusCode::kUnavailable
                                                               : st.code(),
                    "pushing KV to the decode worker at " + job.decode_endpoint + ": " +
                        st.message());
    }
    // bs.chunks are in submission order: one per region.
    for (size_t j = 0; j < bs.chunks.size() && j < regions.size(); ++j) {
      if (bs.chunks[j].outcome == kvbus::ChunkOutcome::kSkipped) {
        ++out.slices_skipped;
      } else {
        out.kv_bytes_sent += static_cast<uint64_t>(regions[j].count) * cache.token_stride() * 2 *
                             sizeof(float);
      }
    }
  }
  if (!job.decode_endpoint.empty()) {
    // Chunks the decode worker said it holds were never offered: skipped too.
    const int64_t held = std::clamp<int64_t>(job.decode_held_chunks, 0, full);
    out.slices_skipped += static_cast<uint32_t>(held * cfg.num_layers);
  }
  engine::Sampler sampler(job.sampling);
  out.first_token = sampler.Sample(logits);
  out.cached_tokens = static_cast<int>(hit * C);
  out.computed_tokens = static_cast<int>(n - hit * C);
  return out;
}

Status Prefiller::StoreNewChunks() {
  Status first_error;
  engine::PagedKvCache& cache = model_.kv_cache();
  const int C = options_.chunk_tokens;
  for (size_t i = static_cast<size_t>(first_new_chunk_); i < keys_.size(); ++i) {
    if (seq_.length() < static_cast<int64_t>(i + 1) * C) break;
    if (store_.Contains(keys_[i])) continue;
    auto chunk = kvbus::ChunkFromPagedKv(cache, seq_, static_cast<int64_t>(i) * C, C, keys_[i],
                                         fingerprint_, kvbus::KvDType::kF32);
    Status st = chunk.ok() ? store_.Put(*std::move(chunk)) : chunk.status();
    if (!st.ok() && first_error.ok()) first_error = st;
  }
  seq_.Reset();
  keys_.clear();
  return first_error;
}

}  // namespace kdn::prefill_worker
