#pragma once
// The router -> worker edge of a request: its spec (request_spec.h) into the
// proto messages workers take (proto/serving.proto), built here and nowhere
// else. Thread-compatible (functions over values).

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "kdn/kvbus/key.h"
#include "kdn/router/request_spec.h"
#include "serving.pb.h"

namespace kdn::router {

// Lookup: which of `keys` (and of a blend request's `segment_keys`) a worker
// holds.
proto::WorkerMessage LookupMessage(const Job& job, const std::vector<kvbus::ChunkKey>& keys,
                                   const std::vector<kvbus::ChunkKey>& segment_keys);
// Prepare (to the decode worker). `generated_tokens`: of job.tokens, the
// last ones generated before a resume; `local_prefill`: it computes the
// prompt itself (docs/serving.md, "Two paths"), having reached
// `lookup_tokens` of it at the lookup.
proto::WorkerMessage PrepareMessage(const Job& job, const std::string& transfer_id,
                                    int64_t generated_tokens, bool local_prefill,
                                    int64_t lookup_tokens);
// Prefill (to the prefill worker), its KV to `decode_endpoint`, which holds
// the first `decode_held_tokens` already.
proto::WorkerMessage PrefillMessage(const Job& job, const std::string& decode_endpoint,
                                    int64_t decode_held_tokens, const std::string& transfer_id,
                                    int64_t generated_tokens);
// Start: the decode worker goes on after `first_token`, which the client has.
// kv_tokens: the KV slots pushed when fewer than the prompt's tokens (0: as
// many); kv_holes: their holes (PrefillReply.kv_holes), relayed.
proto::WorkerMessage StartMessage(int32_t first_token, int32_t kv_tokens = 0,
                                  const std::string& kv_holes = {});
// Cancel: the worker lets the request go.
proto::WorkerMessage CancelMessage();
// Inject: the prefill worker computes and stores the KV of `job`'s document
// `doc` (pruned, or its erratum on its base, as the job says).
proto::WorkerMessage InjectMessage(const InjectJob& job, size_t doc);
// Keep: the worker keeps `keys`' chunks for `lease` (0: lets them go).
proto::WorkerMessage KeepMessage(const std::vector<kvbus::ChunkKey>& keys,
                                 std::chrono::milliseconds lease);
// Info request: a ping, answered by a report.
proto::WorkerMessage PingMessage();

}  // namespace kdn::router
