#include "kdn/kvbus/shared_tier.h"

#include <string>

#include "kdn/kvbus/redis_store.h"
#include "kdn/kvbus/store_service.h"

namespace kdn::kvbus {

Result<std::unique_ptr<ChunkStore>> OpenSharedTier(std::string_view uri,
                                                   const SharedTierOptions& options) {
  constexpr std::string_view kKdnStore = "kdn-store://", kTcp = "tcp://", kRedis = "redis://";
  if (uri.starts_with(kRedis)) {
    KDN_ASSIGN_OR_RETURN(auto redis,
                         RedisStore::Connect(uri, {.model = options.model, .ttl = options.ttl}));
    return std::unique_ptr<ChunkStore>(std::move(redis));
  }
  if (uri.starts_with(kKdnStore) || uri.starts_with(kTcp)) {
    const std::string endpoint = uri.starts_with(kTcp)
                                     ? std::string(uri)
                                     : "tcp://" + std::string(uri.substr(kKdnStore.size()));
    KDN_ASSIGN_OR_RETURN(auto remote, RemoteStore::Connect(endpoint, {.curve = options.curve}));
    return std::unique_ptr<ChunkStore>(std::move(remote));
  }
  return InvalidArgument("KDN tier '" + std::string(uri.substr(0, uri.find(':'))) +
                         ":...' is of no known kind: kdn-store://host:port, tcp://host:port or "
                         "redis://[user:password@]host:port[,host:port...]");
}

}  // namespace kdn::kvbus
