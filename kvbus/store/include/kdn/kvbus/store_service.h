#pragma once
// kdn-store's service: a ChunkStore served over ZeroMQ, and the client that
// makes a remote kdn-store look like one more ChunkStore (a tier).
//
// Wire: proto/kvbus_store.proto. Requests carry ids; the server answers each
// one, in order, from one thread that owns its socket.

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/net/curve.h"

namespace kdn::kvbus {

// The largest message a kdn-store socket takes, either way: a chunk and its
// request. A bigger one is never buffered: ZeroMQ drops the connection that
// sends it. Room for a 256-token chunk of a 70B model's KV in f32 (167 MiB).
inline constexpr int64_t kMaxStoreFrameBytes = int64_t{512} << 20;

struct StoreServerOptions {
  // A client sending a message over this is disconnected before the message
  // is buffered.
  int64_t max_frame_bytes = kMaxStoreFrameBytes;
  // Set: the socket runs CURVE and admits only clients holding this key
  // (kdn/net/curve.h); unset: plaintext, open to anyone who can connect.
  std::optional<net::CurveKeys> curve;
};

// Serves `store` on `endpoint` ("tcp://127.0.0.1:5555"; port 0 picks one) from
// a background thread until destroyed. The store must outlive the server.
// Thread-safe: endpoint() and Stop() may be called from any thread.
class StoreServer {
 public:
  // `stats` (may be empty) supplies per-tier figures for stats requests.
  using TierStatsFn = std::function<std::vector<std::pair<std::string, TierStats>>()>;
  static Result<std::unique_ptr<StoreServer>> Start(ChunkStore& store, const std::string& endpoint,
                                                    TierStatsFn tier_stats = {},
                                                    StoreServerOptions options = {});
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  // The bound endpoint, with the real port.
  const std::string& endpoint() const { return endpoint_; }
  void Stop();

 private:
  struct Impl;
  explicit StoreServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::string endpoint_;
};

struct RemoteStoreOptions {
  // A Get or Put unanswered for this long is UNAVAILABLE (the server is down
  // or stuck); the connection is then rebuilt for the next request.
  std::chrono::milliseconds timeout{2000};
  // The same for presence checks (Contains, Lookup) and Stats, which the
  // server answers from its index: workers ask them on their control
  // threads, which must keep answering the router (docs/kvbus.md, "A store
  // that does not answer"). Also the longest such a call waits for another
  // thread's request to finish.
  std::chrono::milliseconds lookup_timeout{250};
  // After a request fails for want of an answer, requests fail at once
  // (UNAVAILABLE: a cache miss to the caller) for `backoff`, doubled at each
  // further failure up to `max_backoff`; the first request after that tries
  // the server again.
  std::chrono::milliseconds backoff{500};
  std::chrono::milliseconds max_backoff{8000};
  // The largest chunk Put sends (INVALID_ARGUMENT above it, before anything
  // is sent) and the largest reply taken: the server's limit.
  int64_t max_frame_bytes = kMaxStoreFrameBytes;
  // Set: connect with CURVE, as a holder of this key (the server's).
  std::optional<net::CurveKeys> curve;
};

// A remote kdn-store as a ChunkStore. Thread-safe: requests from several
// threads are serialised over one connection. Chunks received are verified
// (Chunk::Parse); a damaged one is a miss, counted in Stats().corrupt. A
// store that stops answering costs one timeout, then fast failures (misses)
// until it answers again (RemoteStoreOptions::backoff); unreachable() counts
// the requests refused that way.
class RemoteStore final : public ChunkStore {
 public:
  static Result<std::unique_ptr<RemoteStore>> Connect(const std::string& endpoint,
                                                      RemoteStoreOptions options = {});
  ~RemoteStore() override;

  std::string name() const override { return "remote " + endpoint_; }
  Result<std::shared_ptr<const Chunk>> Get(const ChunkKey& key) override;
  // False also when the store cannot be reached.
  bool Contains(const ChunkKey& key) override;
  // Lookup; all false when the store cannot be reached.
  std::vector<bool> ContainsMany(std::span<const ChunkKey> keys) override;
  Status Put(std::shared_ptr<const Chunk> chunk) override;
  // The server's store keeps them (its host tier, when it has one).
  Result<size_t> Keep(std::span<const ChunkKey> keys, std::chrono::milliseconds lease) override;
  // The server's whole-store figures, plus this client's corrupt and
  // unreachable counts; zeros but those if it cannot be reached.
  TierStats Stats() override;
  // This client's own counts alone: its Gets that got the chunk (hits) and
  // those that did not (misses: not held, damaged or unanswered), corrupt
  // and unreachable.
  TierStats LocalStats() override;

  // Presence of each key, in one round trip.
  Result<std::vector<bool>> Lookup(std::span<const ChunkKey> keys);
  // Requests that failed for want of an answer: timed out, refused at once
  // while the store was held to be down, or given up waiting for another
  // thread's request to end (also Stats().unreachable).
  uint64_t unreachable() const;
  // The server's figures: the whole store first, then each tier.
  Result<std::vector<std::pair<std::string, TierStats>>> RemoteStats();

 private:
  struct Impl;
  RemoteStore(std::string endpoint, std::unique_ptr<Impl> impl);
  std::string endpoint_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kdn::kvbus
