#include "kdn/kvbus/redis_store.h"

#include <string>

#include "redis_cluster_client.h"

namespace kdn::kvbus {

namespace {

// Counts one call that met an unreachable node (once per call).
void CountUnreachable(const std::vector<RedisClusterClient::Outcome>& outs,
                      std::atomic<uint64_t>& unreachable, LogLimiter& limiter) {
  for (const auto& o : outs) {
    if (!o.ok() && o.status().code() == StatusCode::kUnavailable) {
      ++unreachable;
      limiter.Warn("redis: {} (a miss; the KDN serves on)", o.status().message());
      return;
    }
  }
}

}  // namespace

std::string RedisKey(const ChunkKey& model, const ChunkKey& key) {
  return "kdn:" + model.ToHex() + ":" + key.ToHex();
}

RedisStore::RedisStore(std::unique_ptr<RedisClusterClient> client, std::string name,
                       RedisStoreOptions options)
    : client_(std::move(client)), name_(std::move(name)), options_(options) {}
RedisStore::~RedisStore() = default;

Result<std::unique_ptr<RedisStore>> RedisStore::Connect(std::string_view url,
                                                        RedisStoreOptions options) {
  KDN_ASSIGN_OR_RETURN(RedisUrl u, ParseRedisUrl(url));
  RedisClusterOptions co;
  co.timeout = options.timeout;
  co.refresh_timeout = options.lookup_timeout;
  co.connect_timeout = options.connect_timeout;
  co.backoff = options.backoff;
  KDN_ASSIGN_OR_RETURN(auto client, RedisClusterClient::Connect(u, co));
  return std::unique_ptr<RedisStore>(
      new RedisStore(std::move(client), "redis " + u.Redacted(), options));
}

std::string RedisStore::name() const { return name_; }

bool RedisStore::clustered() const { return client_->clustered(); }

std::string RedisStore::NodeOf(const ChunkKey& key) {
  return client_->NodeOf(RedisKey(options_.model, key));
}

size_t RedisStore::primaries() { return client_->primaries(); }

Result<std::shared_ptr<const Chunk>> RedisStore::Get(const ChunkKey& key) {
  const std::string rkey = RedisKey(options_.model, key);
  std::vector<RedisCommand> cmds{RedisSimple({"GET", rkey}, rkey)};
  auto outs = client_->Run(cmds, options_.timeout);
  CountUnreachable(outs, unreachable_, limiter_);
  if (!outs[0].ok()) {
    ++misses_;
    return outs[0].status();
  }
  RedisReply reply = std::move(outs[0]).value();
  if (reply->type != REDIS_REPLY_STRING) {
    ++misses_;
    return NotFound("redis: no chunk " + key.ToHex());
  }
  // The chunk shares the reply's buffer: no copy past hiredis' own.
  const size_t size = reply->len;
  const auto* data = reinterpret_cast<const uint8_t*>(reply->str);
  std::shared_ptr<const uint8_t> bytes(
      data, [r = reply.release()](const uint8_t*) { freeReplyObject(r); });
  auto chunk = Chunk::Parse(std::move(bytes), size);
  std::string why;
  if (!chunk.ok()) {
    // Another kdn version's chunk, sharing the cluster: a miss, kept.
    const std::string& m = chunk.status().message();
    if (chunk.status().code() == StatusCode::kUnimplemented) {
      ++misses_;
      return NotFound("redis: chunk " + key.ToHex() + " is of another kdn version (" + m + ")");
    }
    why = m;
  } else if ((*chunk)->key() != key) {
    why = "it holds chunk " + (*chunk)->key().ToHex();
  } else if ((*chunk)->info().model_fingerprint != options_.model) {
    why = "it holds another model's KV";
  }
  if (!why.empty()) {
    ++corrupt_;
    ++misses_;
    std::vector<RedisCommand> del{RedisSimple({"DEL", rkey}, rkey)};
    (void)client_->Run(del, options_.lookup_timeout);
    limiter_.Warn("redis: {} was damaged ({}): deleted, a miss", rkey, why);
    return NotFound("redis: chunk " + key.ToHex() + " was damaged (" + why + ")");
  }
  ++hits_;
  return chunk;
}

std::vector<bool> RedisStore::ContainsMany(std::span<const ChunkKey> keys) {
  std::vector<RedisCommand> cmds;
  cmds.reserve(keys.size());
  for (const ChunkKey& k : keys) {
    std::string rkey = RedisKey(options_.model, k);
    cmds.push_back(RedisSimple({"EXISTS", rkey}, rkey));
  }
  auto outs = client_->Run(cmds, options_.lookup_timeout);
  CountUnreachable(outs, unreachable_, limiter_);
  std::vector<bool> held(keys.size(), false);
  for (size_t i = 0; i < outs.size(); ++i) {
    held[i] = outs[i].ok() && (*outs[i])->type == REDIS_REPLY_INTEGER && (*outs[i])->integer > 0;
  }
  return held;
}

bool RedisStore::Contains(const ChunkKey& key) {
  return ContainsMany(std::span<const ChunkKey>(&key, 1))[0];
}

Status RedisStore::Put(std::shared_ptr<const Chunk> chunk) {
  if (chunk == nullptr) return InvalidArgument("redis: Put of a null chunk");
  if (chunk->info().model_fingerprint != options_.model) {
    return InvalidArgument("redis: chunk " + chunk->key().ToHex() +
                           " is another model's KV than this store's");
  }
  const std::string rkey = RedisKey(options_.model, chunk->key());
  std::vector<RedisCommand> cmds{RedisSetNx(rkey, chunk->bytes(), options_.ttl)};
  auto outs = client_->Run(cmds, options_.timeout);
  CountUnreachable(outs, unreachable_, limiter_);
  if (!outs[0].ok()) return outs[0].status();
  // "+OK": stored; nil: already held (content-addressed: the same bytes).
  if ((*outs[0])->type == REDIS_REPLY_STATUS) ++puts_;
  return Status::Ok();
}

TierStats RedisStore::Stats() {
  TierStats s;
  s.hits = hits_.load();
  s.misses = misses_.load();
  s.puts = puts_.load();
  s.corrupt = corrupt_.load();
  s.unreachable = unreachable_.load();
  return s;
}

}  // namespace kdn::kvbus
