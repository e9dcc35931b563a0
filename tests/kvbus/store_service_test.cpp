// kdn-store's service and client, in one process over loopback.
#include "kdn/kvbus/store_service.h"

#include "kdn/common/half.h"
#include "kdn/kvbus/codec.h"
#include "kdn/kvbus/host_tier.h"

#include "kdn/testing/recording_store.h"
#include "kdn/testing/chunks.h"
#include "kvbus_store.pb.h"

#include <gtest/gtest.h>
#include <zmq.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

namespace kdn::kvbus {
namespace {

using kdn::testing::RecordingStore;

std::shared_ptr<const Chunk> MakeChunk(uint64_t id, uint32_t tokens = 16) {
  return kdn::testing::MakeChunk(ChunkKey{id, ~id}, id, {.tokens = tokens, .dtype = DType::kBF16});
}

TEST(StoreService, PutThenGetReturnsTheSameBytes) {
  RecordingStore store;
  auto server = StoreServer::Start(store, "tcp://127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  auto client = RemoteStore::Connect((*server)->endpoint());
  ASSERT_TRUE(client.ok());
  auto chunk = MakeChunk(5, 300);
  ASSERT_TRUE((*client)->Put(chunk).ok());
  auto got = (*client)->Get(chunk->key());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(std::equal((*got)->bytes().begin(), (*got)->bytes().end(), chunk->bytes().begin(),
                         chunk->bytes().end()));
  EXPECT_EQ((*client)->Get(ChunkKey{99, 99}).status().code(), StatusCode::kNotFound);
  // The client counts its own Gets without asking the server (a worker's
  // status page shows them as the tier's hit rate).
  const TierStats local = (*client)->LocalStats();
  EXPECT_EQ(local.hits, 1u);
  EXPECT_EQ(local.misses, 1u);
  EXPECT_EQ(local.chunks, 0u);  // not asked
}

// A message over the server's limit is never buffered: ZeroMQ drops the
// connection that sends it, and the server goes on serving. The client
// refuses a chunk over the limit before sending anything.
TEST(StoreService, AMessageOverTheFrameLimitIsDroppedAndTheServerServesOn) {
  RecordingStore store;
  constexpr int64_t kLimit = int64_t{1} << 20;
  auto server = StoreServer::Start(store, "tcp://127.0.0.1:0", {}, {.max_frame_bytes = kLimit});
  ASSERT_TRUE(server.ok()) << server.status().ToString();
  {
    zmq::context_t ctx;
    zmq::socket_t raw(ctx, zmq::socket_type::dealer);
    raw.set(zmq::sockopt::linger, 0);
    raw.connect((*server)->endpoint());
    std::string big(2 * kLimit, 'x');
    raw.send(zmq::buffer(big), zmq::send_flags::none);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_EQ(store.Stats().puts, 0u);
  auto client = RemoteStore::Connect((*server)->endpoint(), {.max_frame_bytes = kLimit});
  ASSERT_TRUE(client.ok());
  auto too_big = MakeChunk(7, 40000);  // 2.4 MiB of payload
  ASSERT_GT(static_cast<int64_t>(too_big->size()), kLimit);
  const Status st = (*client)->Put(too_big);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("MiB a store message may hold"), std::string::npos) << st.message();
  auto ok = MakeChunk(8, 300);
  ASSERT_TRUE((*client)->Put(ok).ok());
  ASSERT_TRUE((*client)->Get(ok->key()).ok());
  EXPECT_EQ(store.Stats().puts, 1u);
}

TEST(StoreService, LookupAnswersEveryKeyInOrder) {
  RecordingStore store;
  auto server = StoreServer::Start(store, "tcp://127.0.0.1:0").value();
  auto client = RemoteStore::Connect(server->endpoint()).value();
  ASSERT_TRUE(client->Put(MakeChunk(1)).ok());
  ASSERT_TRUE(client->Put(MakeChunk(3)).ok());
  const std::vector<ChunkKey> keys = {MakeChunk(1)->key(), MakeChunk(2)->key(),
                                      MakeChunk(3)->key()};
  auto present = client->Lookup(keys);
  ASSERT_TRUE(present.ok());
  EXPECT_EQ(*present, (std::vector<bool>{true, false, true}));
  EXPECT_TRUE(client->Contains(keys[0]));
  EXPECT_FALSE(client->Contains(keys[1]));
}

// A worker's keep reaches the store's own host tier: the kept chunk
// outlives eviction pressure there.
TEST(StoreService, AKeepReachesTheServedStoresHostTier) {
  HostTier host(2 * MakeChunk(1)->size());
  auto server = StoreServer::Start(host, "tcp://127.0.0.1:0").value();
  auto client = RemoteStore::Connect(server->endpoint()).value();
  const std::vector<ChunkKey> kept = {MakeChunk(1)->key()};
  auto n = client->Keep(kept, std::chrono::milliseconds(60'000));
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 1u);
  for (uint64_t id = 1; id <= 5; ++id) ASSERT_TRUE(client->Put(MakeChunk(id)).ok());
  EXPECT_TRUE(client->Contains(kept[0]));
  EXPECT_FALSE(client->Contains(MakeChunk(4)->key()));
  ASSERT_TRUE(client->Keep(kept, std::chrono::milliseconds(0)).ok());
  EXPECT_EQ(host.KeptCount(), 0u);
}

TEST(StoreService, StatsReportTheServedStore) {
  RecordingStore store;
  auto server =
      StoreServer::Start(store, "tcp://127.0.0.1:0", [] {
        return std::vector<std::pair<std::string, TierStats>>{{"host", TierStats{.chunks = 7}}};
      }).value();
  auto client = RemoteStore::Connect(server->endpoint()).value();
  ASSERT_TRUE(client->Put(MakeChunk(1)).ok());
  auto stats = client->RemoteStats();
  ASSERT_TRUE(stats.ok());
  ASSERT_EQ(stats->size(), 2u);
  EXPECT_EQ((*stats)[0].first, "store");
  EXPECT_EQ((*stats)[0].second.chunks, 1u);
  EXPECT_EQ((*stats)[1].first, "host");
  EXPECT_EQ((*stats)[1].second.chunks, 7u);
}

TEST(StoreService, ClientFailsFastWhileNoServerAnswersAndRecovers) {
  using std::chrono::milliseconds;
  RecordingStore store;
  auto server = StoreServer::Start(store, "tcp://127.0.0.1:0").value();
  const std::string endpoint = server->endpoint();
  auto client = RemoteStore::Connect(endpoint, {.timeout = milliseconds(1500),
                                                .lookup_timeout = milliseconds(1500),
                                                .backoff = milliseconds(1500)})
                    .value();
  server.reset();
  EXPECT_EQ(client->Put(MakeChunk(1)).code(), StatusCode::kUnavailable);  // one timeout
  EXPECT_EQ(client->unreachable(), 1u);
  // Held to be down: requests fail at once (misses), not after a timeout
  // each, which on a worker's control thread would starve the router's pings.
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(client->Contains(MakeChunk(1)->key()));
  EXPECT_EQ(client->Get(MakeChunk(1)->key()).status().code(), StatusCode::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(1000));
  EXPECT_EQ(client->unreachable(), 3u);
  // A server back on the same endpoint is used by the first request after
  // the backoff.
  auto again = StoreServer::Start(store, endpoint).value();
  std::this_thread::sleep_for(milliseconds(1600));
  EXPECT_TRUE(client->Put(MakeChunk(2)).ok());
  EXPECT_TRUE(client->Contains(MakeChunk(2)->key()));
  EXPECT_EQ(client->unreachable(), 3u);
}

TEST(StoreService, ALookupDoesNotWaitBehindAChunkTransfer) {
  using std::chrono::milliseconds;
  // A server that answers lookups (every key present) and never a Put, so
  // that the Put holds its connection until its timeout.
  zmq::context_t ctx;
  zmq::socket_t fake(ctx, zmq::socket_type::router);
  fake.set(zmq::sockopt::linger, 0);
  fake.bind("tcp://127.0.0.1:0");
  const std::string endpoint = fake.get(zmq::sockopt::last_endpoint);
  std::atomic<bool> stop{false};
  std::atomic<int> puts_seen{0};
  std::thread server([&] {
    while (!stop.load()) {
      zmq::pollitem_t item{fake.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, milliseconds(20));
      if (!(item.revents & ZMQ_POLLIN)) continue;
      std::vector<zmq::message_t> frames;
      for (;;) {
        zmq::message_t m;
        (void)fake.recv(m, zmq::recv_flags::none);
        const bool more = m.more();
        frames.push_back(std::move(m));
        if (!more) break;
      }
      proto::StoreRequest req;
      if (frames.size() < 2 ||
          !req.ParseFromArray(frames[1].data(), static_cast<int>(frames[1].size())))
        continue;
      if (!req.has_lookup()) {
        ++puts_seen;
        continue;
      }
      proto::StoreReply reply;
      reply.set_id(req.id());
      for (int i = 0; i < req.lookup().keys_size(); ++i) reply.add_present(true);
      const std::string out = reply.SerializeAsString();
      fake.send(frames[0], zmq::send_flags::sndmore);
      fake.send(zmq::buffer(out), zmq::send_flags::none);
    }
  });
  auto client = RemoteStore::Connect(
                    endpoint, {.timeout = milliseconds(2000), .lookup_timeout = milliseconds(500)})
                    .value();
  std::thread put([&] { EXPECT_FALSE(client->Put(MakeChunk(1)).ok()); });
  while (puts_seen.load() == 0) std::this_thread::sleep_for(milliseconds(5));
  // The Put is in flight on its connection; the lookup goes on its own.
  EXPECT_TRUE(client->Contains(MakeChunk(2)->key()));
  put.join();
  stop = true;
  server.join();
}

TEST(StoreService, ServesSeveralClientThreadsAtOnce) {
  RecordingStore store;
  auto server = StoreServer::Start(store, "tcp://127.0.0.1:0").value();
  auto client = RemoteStore::Connect(server->endpoint()).value();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 25; ++i) {
        auto c = MakeChunk(t * 100 + i);
        EXPECT_TRUE(client->Put(c).ok());
        EXPECT_TRUE(client->Get(c->key()).ok());
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(store.Stats().chunks, 100u);
}

// A kdn-store process: started with a disk tier, stopped with SIGTERM.
class StoreProcess {
 public:
  explicit StoreProcess(const std::filesystem::path& disk_dir, const char* disk_codec = "raw") {
    int out[2];
    EXPECT_EQ(pipe(out), 0);
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      const std::string dir = disk_dir.string();
      execl(KDN_STORE_BIN, KDN_STORE_BIN, "--listen", "tcp://127.0.0.1:0", "--host-mib", "1",
            "--disk-dir", dir.c_str(), "--disk-codec", disk_codec, static_cast<char*>(nullptr));
      _exit(127);
    }
    close(out[1]);
    FILE* f = fdopen(out[0], "r");
    char line[256] = {};
    if (fgets(line, sizeof(line), f) != nullptr) endpoint_ = std::string(line, strcspn(line, "\n"));
    fclose(f);
  }
  ~StoreProcess() { Stop(); }
  // Exit code after `sig`; -1 if the process was killed by it.
  int Stop(int sig = SIGTERM) {
    if (pid_ <= 0) return -1;
    kill(pid_, sig);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  const std::string& endpoint() const { return endpoint_; }

 private:
  pid_t pid_ = -1;
  std::string endpoint_;
};

TEST(StoreProcess, SurvivesARestartOrACrashWithItsDiskTierIntact) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("kdn_store_restart_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  // ~1.2 MiB of chunks through 1 MiB of host memory: some are evicted from
  // memory, all are written through to disk.
  std::vector<std::shared_ptr<const Chunk>> chunks;
  for (int i = 0; i < 40; ++i) chunks.push_back(MakeChunk(1000 + i, 256));
  // What is checked is durability, not latency: a store process built with a
  // sanitizer, writing through to disk on a busy machine, may take more than
  // the default 2 s to answer a Put.
  const RemoteStoreOptions patient{.timeout = std::chrono::seconds(60),
                                   .lookup_timeout = std::chrono::seconds(60)};
  for (int sig : {SIGTERM, SIGKILL}) {
    SCOPED_TRACE(sig == SIGTERM ? "clean stop" : "crash");
    {
      StoreProcess p(dir);
      ASSERT_FALSE(p.endpoint().empty());
      auto client = RemoteStore::Connect(p.endpoint(), patient).value();
      for (const auto& c : chunks) ASSERT_TRUE(client->Put(c).ok());
      const int code = p.Stop(sig);
      if (sig == SIGTERM) {
        EXPECT_EQ(code, 0);
      }
    }
    StoreProcess again(dir);
    auto client = RemoteStore::Connect(again.endpoint(), patient).value();
    for (const auto& c : chunks) {
      auto got = client->Get(c->key());
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_TRUE(std::equal((*got)->bytes().begin(), (*got)->bytes().end(), c->bytes().begin(),
                             c->bytes().end()));
    }
    EXPECT_EQ(again.Stop(), 0);
  }
  std::filesystem::remove_all(dir);
}

TEST(StoreProcess, DiskCodecWritesChunksCodedAndServesThemCoded) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("kdn_store_codec_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  // bf16 KV-like values: the exponent bytes repeat, so lossless coding pays.
  std::vector<std::shared_ptr<const Chunk>> chunks;
  for (uint64_t id = 2000; id < 2008; ++id) {
    const ChunkInfo info{ChunkKey{id, ~id}, ChunkKey{1, 2}, 2, 2, 8, 256, DType::kBF16, 0};
    chunks.push_back(Chunk::Build(info, [&](uint8_t* out) {
                       for (size_t i = 0; i < info.payload_bytes() / 2; ++i) {
                         const uint16_t h = F32ToBf16(std::sin(0.01f * static_cast<float>(i + id)));
                         out[2 * i] = static_cast<uint8_t>(h);
                         out[2 * i + 1] = static_cast<uint8_t>(h >> 8);
                       }
                     }).value());
  }
  uint64_t raw_bytes = 0;
  for (const auto& c : chunks) raw_bytes += c->size();
  {
    StoreProcess p(dir, "lossless");
    ASSERT_FALSE(p.endpoint().empty());
    auto client = RemoteStore::Connect(p.endpoint()).value();
    for (const auto& c : chunks) ASSERT_TRUE(client->Put(c).ok());
    EXPECT_EQ(p.Stop(), 0);
  }
  uint64_t disk_bytes = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.path().extension() == ".kvc") disk_bytes += e.file_size();
  }
  EXPECT_LT(disk_bytes, raw_bytes * 9 / 10);
  // Restarted: the host tier is empty, every chunk comes from the disk, coded;
  // the client decodes it to the very bytes it put.
  StoreProcess again(dir, "lossless");
  auto client = RemoteStore::Connect(again.endpoint()).value();
  for (const auto& c : chunks) {
    auto got = client->Get(c->key());
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE((*got)->encoded());
    auto raw = DecodeChunk(*got);
    ASSERT_TRUE(raw.ok()) << raw.status().ToString();
    EXPECT_TRUE(std::equal((*raw)->bytes().begin(), (*raw)->bytes().end(), c->bytes().begin(),
                           c->bytes().end()));
  }
  EXPECT_EQ(again.Stop(), 0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kdn::kvbus
