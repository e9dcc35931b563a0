#pragma once
// A Redis Cluster client (private to kdn_kvbus_store): the slot map, a pool
// of connections per node, redirections (MOVED, ASK), and commands
// pipelined per node. It knows nothing of chunks; the Redis tier
// (redis_store.cpp) is a store on it. A node not in cluster mode is served
// as the one shard. Thread-safe: calls from several threads share the pool.

#include <hiredis/hiredis.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kdn/common/log.h"
#include "kdn/common/mutex.h"
#include "kdn/common/status.h"
#include "kdn/kvbus/redis_store.h"

namespace kdn::kvbus {

struct RedisReplyFree {
  void operator()(redisReply* r) const {
    if (r != nullptr) freeReplyObject(r);
  }
};
using RedisReply = std::unique_ptr<redisReply, RedisReplyFree>;

// One command in RESP, ready for writev: the arguments before the large
// one and its length prefix (`head`), the large argument where it lies
// (`big`: a chunk's bytes, never copied), and what follows it (`tail`).
struct RedisCommand {
  std::string key;  // routes the command
  std::string head;
  std::span<const uint8_t> big;
  std::string tail;
  bool asking = false;  // send ASKING first (an ASK redirection)
};
// A command of small arguments, routed by `key`.
RedisCommand RedisSimple(std::initializer_list<std::string_view> args, std::string key);
// SET key <value> NX [PX ms], the value sent from `value` as it lies.
RedisCommand RedisSetNx(const std::string& key, std::span<const uint8_t> value,
                        std::chrono::milliseconds ttl);

struct RedisClusterOptions {
  // A new connection's socket timeout (Run sets each call's own).
  std::chrono::milliseconds timeout{2000};
  // Each try of a slot-map reread, which runs on a caller's thread.
  std::chrono::milliseconds refresh_timeout{250};
  std::chrono::milliseconds connect_timeout{1000};
  // After a node fails (refused, timed out), commands for its slots fail at
  // once for this long; the slot map is reread meanwhile.
  std::chrono::milliseconds backoff{250};
};

class RedisClusterClient {
 public:
  // Connects to the first seed that answers, authenticates, and reads the
  // slot map. INVALID_ARGUMENT for credentials Redis refuses (or a password
  // it asks for and the URL lacks), UNAVAILABLE when no seed answers.
  static Result<std::unique_ptr<RedisClusterClient>> Connect(const RedisUrl& url,
                                                             RedisClusterOptions options);

  // One command's outcome: its reply, or why it has none.
  using Outcome = Result<RedisReply>;
  // Runs `cmds`, each on the node its key's slot maps to: every node's
  // commands are written before any reply is read. Follows MOVED (and
  // rereads the map) and ASK. A command whose node cannot be reached, that
  // times out, or that meets a cluster in transition is UNAVAILABLE; one
  // Redis refuses for good (OOM, NOPERM, ...) is INTERNAL, said in the log.
  std::vector<Outcome> Run(std::vector<RedisCommand>& cmds, std::chrono::milliseconds timeout);

  // Whether the nodes run Redis Cluster (false: one standalone node).
  bool clustered() const { return cluster_; }
  // "host:port" of the primary that serves `key` now, by the slot map.
  std::string NodeOf(std::string_view key);
  // Distinct primaries in the slot map.
  size_t primaries();

 private:
  struct ContextFree {
    void operator()(redisContext* c) const {
      if (c != nullptr) redisFree(c);
    }
  };
  using ContextPtr = std::unique_ptr<redisContext, ContextFree>;
  using Clock = std::chrono::steady_clock;
  struct Node {
    std::string host;
    int port = 0;
    std::vector<ContextPtr> idle;
    Clock::time_point down_until{};
  };

  RedisClusterClient(RedisUrl url, RedisClusterOptions options)
      : url_(std::move(url)), options_(options) {}
  uint16_t NodeFor(const std::string& host, int port) KDN_REQUIRES(mu_);
  // A new connection to host:port (given `connect` to connect),
  // authenticated when the URL has a password.
  Result<ContextPtr> Dial(const std::string& host, int port, std::chrono::milliseconds connect);
  // A connection to node `n` for one call: an idle one, or a new one (which
  // may take `timeout` to connect). A node held to be down is UNAVAILABLE at
  // once.
  Result<ContextPtr> Take(uint16_t n, std::chrono::milliseconds timeout) KDN_EXCLUDES(mu_);
  void Give(uint16_t n, ContextPtr c) KDN_EXCLUDES(mu_);
  void MarkDown(uint16_t n) KDN_EXCLUDES(mu_);
  // Reads CLUSTER SLOTS through `c` (from host). True with the map replaced;
  // false, with `standalone` set when the node is not in cluster mode.
  Result<bool> LoadSlots(redisContext* c, const std::string& host, bool* standalone)
      KDN_EXCLUDES(mu_);
  // Rereads the slot map from the first node that answers (rate-limited;
  // one thread at a time), after a MOVED or a failing node.
  void Refresh() KDN_EXCLUDES(mu_);

  static constexpr size_t kSlots = 16384;
  static constexpr uint16_t kNoNode = 0xFFFF;

  const RedisUrl url_;
  const RedisClusterOptions options_;
  bool cluster_ = true;
  LogLimiter limiter_;

  Mutex mu_;
  std::vector<std::unique_ptr<Node>> nodes_ KDN_GUARDED_BY(mu_);  // never shrinks
  std::unordered_map<std::string, uint16_t> node_index_ KDN_GUARDED_BY(mu_);
  std::vector<uint16_t> slots_ KDN_GUARDED_BY(mu_) = std::vector<uint16_t>(kSlots, kNoNode);
  Clock::time_point last_refresh_ KDN_GUARDED_BY(mu_){};
  bool refreshing_ KDN_GUARDED_BY(mu_) = false;
};

}  // namespace kdn::kvbus
