#pragma once
// The KDN tier workers share, named by a URI:
//   kdn-store://host:port (or tcp://host:port)   a kdn-store process
//   redis://[user:password@]host:port[,...]      a Redis Cluster, or one
//                                                standalone Redis or Valkey
// Thread-safe (a function over values).

#include <chrono>
#include <memory>
#include <optional>
#include <string_view>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/net/curve.h"
#include "kdn/kvbus/key.h"

namespace kdn::kvbus {

struct SharedTierOptions {
  // kdn-store: connect with CURVE as a holder of these keys.
  std::optional<net::CurveKeys> curve;
  // Redis: the model whose chunks the tier holds (part of every key), and
  // an expiry for what is put (0: none).
  ChunkKey model;
  std::chrono::milliseconds ttl{0};
};

// INVALID_ARGUMENT for a URI of no known scheme (naming the schemes) or one
// its tier refuses; whatever the tier's Connect says otherwise.
Result<std::unique_ptr<ChunkStore>> OpenSharedTier(std::string_view uri,
                                                   const SharedTierOptions& options);

}  // namespace kdn::kvbus
