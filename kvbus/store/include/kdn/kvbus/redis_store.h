#pragma once
// RedisStore: a Redis Cluster (or one standalone Redis or Valkey node) as a
// KDN tier, for a KDN that outgrows one machine: the cluster shards,
// replicates and fails over by itself. Spec: docs/kvbus.md, "Redis tier".
//
// - One Redis key per chunk, "kdn:<model fingerprint>:<chunk key>" in hex
//   (never a `{`, so no hash tag pins keys to one slot); its value is the
//   chunk as kvbus serializes it (header with checksum, then payload), so a
//   chunk is either wholly there or not at all.
// - The client routes each key by its slot (CRC16 of the key mod 16384)
//   from a map read with CLUSTER SLOTS; it follows MOVED (and rereads the
//   map) and ASK. Batched presence checks send EXISTS to every node at
//   once, pipelined, before reading any reply.
// - A put is `SET key value NX [PX ttl]`, written with writev straight from
//   the chunk's buffer; a repeat of a key already held is free.
// - A get is verified where it lands (size, checksum, key, model); a bad
//   value is deleted and is a miss.
// - Any transport error, timeout, CLUSTERDOWN, TRYAGAIN or LOADING is a miss
//   for a read and a dropped chunk for a put, counted in
//   Stats().unreachable, never an error to the request. A node that failed
//   is not asked again for a backoff; the slot map is reread meanwhile, so
//   a replica that took over is found.
//
// Thread-safe: each node has a pool of connections; a thread takes one per
// node for the length of a call, so calls from several threads run at once.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kdn/common/log.h"
#include "kdn/common/status.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/key.h"

namespace kdn::kvbus {

class RedisClusterClient;  // the cluster client it runs on (private to kdn_kvbus_store)

// redis://[user:password@]host[:port][,host[:port]...] (port 6379 when
// left out; `:password@` alone is the default user's password).
struct RedisUrl {
  std::string user;
  std::string password;
  std::vector<std::pair<std::string, int>> seeds;  // host, port

  // The URL without its password ("redis://user:***@host:port,...").
  std::string Redacted() const;
};
// INVALID_ARGUMENT saying what is wrong with `url`.
Result<RedisUrl> ParseRedisUrl(std::string_view url);
// `url` with `password` put in (for a password kept out of command lines,
// in a file); INVALID_ARGUMENT if `url` does not parse or has one already.
Result<std::string> RedisUrlWithPassword(std::string_view url, std::string_view password);
// The first line of `path`, a password kept out of command lines (trailing
// CR and spaces dropped); INVALID_ARGUMENT naming the file, never its
// contents, when it cannot be read or the line is empty.
Result<std::string> ReadPasswordFile(const std::string& path);
// `url` with the password ReadPasswordFile reads from `path` put in.
Result<std::string> RedisUrlWithPasswordFile(std::string_view url, const std::string& path);

// The Redis key of chunk `key` of model `model`.
std::string RedisKey(const ChunkKey& model, const ChunkKey& key);
// The cluster slot of a Redis key: CRC16/XMODEM of the key (or of its
// `{hash tag}`, as Redis Cluster defines it) mod 16384.
uint16_t RedisSlot(std::string_view key);

struct RedisStoreOptions {
  // The model whose chunks this store reads and writes: part of every key,
  // and checked in every chunk read (a chunk of another model is a miss).
  ChunkKey model;
  // A get or put unanswered for this long is a miss (a dropped put).
  std::chrono::milliseconds timeout{2000};
  // The same for presence checks, asked on workers' control threads.
  std::chrono::milliseconds lookup_timeout{250};
  std::chrono::milliseconds connect_timeout{1000};
  // After a node fails (refused, timed out), requests for its slots are
  // misses at once for this long; the slot map is reread meanwhile.
  std::chrono::milliseconds backoff{250};
  // Set (> 0): every chunk put expires this long after it is stored.
  std::chrono::milliseconds ttl{0};
};

class RedisStore final : public ChunkStore {
 public:
  // Connects to the first seed that answers, authenticates, and reads the
  // slot map. INVALID_ARGUMENT for a URL that does not parse or
  // credentials Redis refuses (or a password it asks for and the URL lacks),
  // UNAVAILABLE when no seed answers. A node not in cluster mode is used as the one
  // shard (said in the log).
  static Result<std::unique_ptr<RedisStore>> Connect(std::string_view url,
                                                     RedisStoreOptions options);
  ~RedisStore() override;
  RedisStore(const RedisStore&) = delete;
  RedisStore& operator=(const RedisStore&) = delete;

  std::string name() const override;  // "redis redis://host:port,..." (no password)
  Result<std::shared_ptr<const Chunk>> Get(const ChunkKey& key) override;
  bool Contains(const ChunkKey& key) override;
  std::vector<bool> ContainsMany(std::span<const ChunkKey> keys) override;
  // INVALID_ARGUMENT for a chunk of another model than options.model;
  // UNAVAILABLE when the cluster cannot take it now (counted, dropped).
  Status Put(std::shared_ptr<const Chunk> chunk) override;
  // This client's counters (hits, misses, puts, corrupt, unreachable); the
  // cluster's size is Redis's own INFO, not asked for here.
  TierStats Stats() override;

  // Whether the nodes run Redis Cluster (false: one standalone node).
  bool clustered() const;
  // "host:port" of the primary that serves `key` now, by the slot map.
  std::string NodeOf(const ChunkKey& key);
  // Distinct primaries in the slot map.
  size_t primaries();

 private:
  RedisStore(std::unique_ptr<RedisClusterClient> client, std::string name,
             RedisStoreOptions options);
  const std::unique_ptr<RedisClusterClient> client_;
  const std::string name_;
  const RedisStoreOptions options_;
  std::atomic<uint64_t> hits_{0}, misses_{0}, puts_{0}, corrupt_{0}, unreachable_{0};
  LogLimiter limiter_;
};

}  // namespace kdn::kvbus
