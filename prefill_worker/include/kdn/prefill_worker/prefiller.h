#pragma once
// Prefiller: the prefill worker's job, one request at a time
// (docs/design.md, "One request, step by step", steps 3 to 5).
//
//  1. Cut the prompt into chunks and load the longest prefix of them that the
//     KDN tiers hold (at most all but the prompt's last token, whose logits
//     are needed).
//  2. Compute the rest with the engine, and as each layer finishes push that
//     layer of the KV the decode worker lacks (every chunk past the ones it
//     said it holds, plus the partial tail) over kvbus as layer slices.
//  3. Wait until the decode worker has every slice, sample the first token.
//  4. After the reply (StoreNewChunks), store the prompt's new full chunks in
//     the KDN so the next request with this prefix loads them.
//
// Not thread-safe: the worker's compute loop owns it, with the Model. The
// store is shared (thread-safe).

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/engine/model.h"
#include "kdn/engine/sampler.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/tiered_store.h"
#include "kdn/kvbus/transport.h"

namespace kdn::prefill_worker {

struct PrefillJob {
  std::vector<int32_t> tokens;
  std::string ns;  // the tenant's cache namespace
  engine::SamplingParams sampling;
  // The decode worker's kvbus endpoint; empty: the KV is not pushed (the
  // prompt is only prefilled and cached, as for a benchmark or a warm-up).
  std::string decode_endpoint;
  // Leading full chunks the decode worker already has: never sent.
  int decode_held_chunks = 0;
  // Unique per request; names the slices of the partial tail.
  std::string transfer_id;
};

struct PrefillOutcome {
  int32_t first_token = -1;
  int cached_tokens = 0;    // loaded from the KDN
  int computed_tokens = 0;  // run through the model
  uint64_t kv_bytes_sent = 0;
  // Layer slices not sent because the decode worker held them: the chunks it
  // said it holds, and slices its receiver answered HELD for.
  uint32_t slices_skipped = 0;
};

struct PrefillerOptions {
  int chunk_tokens = kvbus::kDefaultChunkTokens;
  kvbus::SenderOptions sender;
  // How long to wait, after the last layer, for the decode worker to have
  // every slice.
  std::chrono::milliseconds push_timeout{30000};
};

class Prefiller {
 public:
  // Borrows `model` and `store`, which must outlive it.
  Prefiller(engine::Model& model, kvbus::TieredStore& store, kvbus::ChunkKey model_fingerprint,
            PrefillerOptions options);
  ~Prefiller();

  // Runs one job (steps 1-3). INVALID_ARGUMENT for an empty prompt, ids
  // outside the vocabulary or a prompt beyond the context;
  // RESOURCE_EXHAUSTED without free KV blocks; UNAVAILABLE when the decode
  // worker does not take the KV. The job's KV stays held until
  // StoreNewChunks or the next Run.
  Result<PrefillOutcome> Run(const PrefillJob& job);

  // Stores the last job's computed full chunks that the store lacks, then
  // frees its KV. A store failure is returned but loses nothing but reuse.
  Status StoreNewChunks();

 private:
  Result<kvbus::Sender*> SenderFor(const std::string& endpoint);

  engine::Model& model_;
  kvbus::TieredStore& store_;
  const kvbus::ChunkKey fingerprint_;
  const PrefillerOptions options_;
  std::map<std::string, std::unique_ptr<kvbus::Sender>> senders_;  // by endpoint

  // The last job, until StoreNewChunks.
  engine::KvSequence seq_;
  std::vector<kvbus::ChunkKey> keys_;
  int first_new_chunk_ = 0;
};

}  // namespace kdn::prefill_worker
