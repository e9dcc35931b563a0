// kdn-bench's kvbus workloads: store and pd-transfer (see kdn_bench.cpp).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <random>

#include "bench_util.h"
#include "kdn/kvbus/buffer_pool.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/curve.h"
#include "kdn/kvbus/disk_tier.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/transport.h"
#include "kdn/kvbus/transport_bench.h"
#include "kdn/engine/presets.h"
#include "kdn/kvbridge/paged_chunks.h"

namespace kdn::bench {

using namespace kdn::kvbus;

namespace {

// One request's KV in a paged cache of the model's shape, filled with values
// (the store does not care which), without running the model.
struct RequestKv {
  engine::CpuKvCache cache;
  engine::KvSequence seq;
  std::vector<ChunkKey> keys;

  RequestKv(const model::ModelConfig& c, int64_t tokens, int chunk_tokens, uint64_t salt)
      : cache(c.num_layers, c.num_kv_heads, c.head_dim,
              static_cast<int>(2 * (tokens + engine::kKvBlockTokens) / engine::kKvBlockTokens)) {
    seq = cache.NewSequence();
    (void)cache.Reserve(seq, tokens);
    cache.SetLength(seq, tokens);
    std::mt19937 rng(static_cast<uint32_t>(salt));
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    for (int l = 0; l < c.num_layers; ++l) {
      for (int32_t b : seq.blocks()) {
        for (int64_t i = 0; i < cache.block_stride(); ++i) {
          cache.Key(l, b)[i] = u(rng);
          cache.Value(l, b)[i] = u(rng);
        }
      }
    }
    std::vector<int32_t> ids(tokens);
    for (int64_t i = 0; i < tokens; ++i) ids[i] = static_cast<int32_t>((i * 31 + salt) % 256);
    KeyContext ctx{ChunkKey{salt, salt}, "bench", chunk_tokens};
    keys = PrefixKeys(ctx, ids);
  }
};

// Write `bytes` sequentially to a file and fsync, then read it back after
// dropping it from the page cache: the disk's own sequential bandwidth, best
// of `reps` like the tier figures it is compared with.
std::pair<double, double> DiskSequentialGBps(const std::filesystem::path& path, size_t bytes,
                                             int reps) {
  std::vector<char> buf(size_t{4} << 20, 7);
  double best_w = 0.0, best_r = 0.0;
  for (int rep = 0; rep < reps; ++rep) {
    int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
    auto t0 = Clock::now();
    for (size_t done = 0; done < bytes; done += buf.size()) {
      if (::write(fd, buf.data(), buf.size()) < 0) break;
    }
    ::fsync(fd);
    best_w = std::max(best_w, bytes / Seconds(t0, Clock::now()) / 1e9);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
    fd = ::open(path.c_str(), O_RDONLY);
    t0 = Clock::now();
    while (::read(fd, buf.data(), buf.size()) > 0) {
    }
    best_r = std::max(best_r, bytes / Seconds(t0, Clock::now()) / 1e9);
    ::close(fd);
    std::filesystem::remove(path);
  }
  return {best_w, best_r};
}

}  // namespace

int RunStore(const Common& c, int tokens, int chunk_tokens, const std::string& dtype_name,
             const std::string& disk_dir) {
  auto preset = engine::FindPreset(c.preset);
  if (!preset.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", preset.status().ToString().c_str());
    return 2;
  }
  const model::ModelConfig& cfg = preset->config;
  const KvDType dtype = ParseDType(dtype_name);
  const ChunkKey fingerprint{1, 1};
  json rows = json::array();
  double host_put = 0, host_get = 0, disk_put = 0, disk_get = 0;
  double chunk_bytes = 0;
  const int reps = std::max(c.reps, 1);
  for (int r = 0; r < reps; ++r) {
    RequestKv kv(cfg, tokens, chunk_tokens, 100 + r);
    RequestKv back(cfg, tokens, chunk_tokens, 100 + r);
    HostTier host(0);
    // put: paged KV -> chunk (copy, convert, checksum) -> host tier
    auto t0 = Clock::now();
    for (size_t i = 0; i < kv.keys.size(); ++i) {
      auto chunk = kvbridge::ChunkFromPagedKv(kv.cache, kv.seq, i * chunk_tokens, chunk_tokens,
                                              kv.keys[i], fingerprint, dtype);
      if (!chunk.ok() || !host.Put(*chunk).ok()) {
        std::fprintf(stderr, "kdn-bench: store put failed\n");
        return 1;
      }
      chunk_bytes = static_cast<double>((*chunk)->size()) * kv.keys.size();
    }
    host_put = std::max(host_put, chunk_bytes / Seconds(t0, Clock::now()) / 1e9);
    // get: host tier -> paged KV of another sequence
    t0 = Clock::now();
    for (size_t i = 0; i < kv.keys.size(); ++i) {
      auto chunk = host.Get(kv.keys[i]);
      if (!chunk.ok() ||
          !kvbridge::ChunkToPagedKv(**chunk, back.cache, back.seq, i * chunk_tokens).ok()) {
        std::fprintf(stderr, "kdn-bench: store get failed\n");
        return 1;
      }
    }
    host_get = std::max(host_get, chunk_bytes / Seconds(t0, Clock::now()) / 1e9);

    // disk: put (write, fsync, rename) and get (read from the device, verify)
    const std::filesystem::path dir =
        std::filesystem::path(disk_dir) / ("kdn-bench-store-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    {
      auto disk = DiskTier::Open(dir, 0);
      if (!disk.ok()) {
        std::fprintf(stderr, "kdn-bench: %s\n", disk.status().ToString().c_str());
        return 1;
      }
      std::vector<std::shared_ptr<const Chunk>> chunks;
      for (const ChunkKey& k : kv.keys) chunks.push_back(host.Get(k).value());
      t0 = Clock::now();
      for (const auto& ch : chunks) {
        if (!(*disk)->Put(ch).ok()) {
          std::fprintf(stderr, "kdn-bench: disk put failed\n");
          return 1;
        }
      }
      disk_put = std::max(disk_put, chunk_bytes / Seconds(t0, Clock::now()) / 1e9);
      DropFromPageCache(dir);
      t0 = Clock::now();
      for (const ChunkKey& k : kv.keys) {
        if (!(*disk)->Get(k).ok()) {
          std::fprintf(stderr, "kdn-bench: disk get failed\n");
          return 1;
        }
      }
      disk_get = std::max(disk_get, chunk_bytes / Seconds(t0, Clock::now()) / 1e9);
    }
    std::filesystem::remove_all(dir);
  }
  const double mem = MemcpyOneThreadGBps(static_cast<size_t>(chunk_bytes), std::max(c.reps, 4));
  const auto [seq_w, seq_r] = DiskSequentialGBps(
      std::filesystem::path(disk_dir) / ("kdn-bench-seq-" + std::to_string(::getpid())),
      static_cast<size_t>(chunk_bytes), reps);
  std::printf("store: %d tokens of %s KV (%s), %zu chunks of %d tokens, %.1f MiB; best of %d\n",
              tokens, c.preset.c_str(), KvDTypeName(dtype),
              static_cast<size_t>(tokens / chunk_tokens), chunk_tokens, chunk_bytes / 1048576.0,
              reps);
  std::printf("%-10s %10s %12s %8s\n", "operation", "GB/s", "limit GB/s", "ratio");
  auto row = [&](const char* op, double v, double limit, const char* limit_name) {
    std::printf("%-10s %10.2f %12.2f %7.1f%%  (%s)\n", op, v, limit, 100.0 * v / limit, limit_name);
    rows.push_back({{"operation", op},
                    {"gbytes_per_s", v},
                    {"limit_gbytes_per_s", limit},
                    {"limit", limit_name},
                    {"ratio", v / limit}});
  };
  row("host put", host_put, mem, "memcpy, 1 thread");
  row("host get", host_get, mem, "memcpy, 1 thread");
  row("disk put", disk_put, seq_w, "sequential write + fsync");
  row("disk get", disk_get, seq_r, "sequential read, cold");
  Emit(c, {{"workload", "store"},
           {"preset", c.preset},
           {"tokens", tokens},
           {"chunk_tokens", chunk_tokens},
           {"dtype", KvDTypeName(dtype)},
           {"bytes", chunk_bytes},
           {"machine", Machine(c)},
           {"results", rows}});
  return 0;
}

int RunPdTransfer(const Common& c, int tokens, int chunk_tokens, const std::string& dtype_name,
                  int socket_buffer_kib, const std::vector<std::string>& transports, bool curve) {
  auto preset = engine::FindPreset(c.preset);
  if (!preset.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", preset.status().ToString().c_str());
    return 2;
  }
  const model::ModelConfig& cfg = preset->config;
  ChunkInfo shape{.layers = static_cast<uint32_t>(cfg.num_layers),
                  .kv_heads = static_cast<uint32_t>(cfg.num_kv_heads),
                  .head_dim = static_cast<uint32_t>(cfg.head_dim),
                  .tokens = static_cast<uint32_t>(chunk_tokens),
                  .dtype = ParseDType(dtype_name)};
  const int n = tokens / chunk_tokens;
  const size_t chunk_bytes = Chunk::kHeaderBytes + shape.payload_bytes();
  if (n < 1) {
    std::fprintf(stderr, "kdn-bench: --tokens must be at least --chunk-tokens\n");
    return 2;
  }

  // With --curve, each transport is measured plaintext and with CURVE, the
  // receiver holding the key the child inherits.
  std::optional<CurveKeys> keys;
  if (curve) {
    auto k = GenerateCurveKeys();
    if (!k.ok()) {
      std::fprintf(stderr, "kdn-bench: %s\n", k.status().ToString().c_str());
      return 1;
    }
    keys = *k;
  }

  // The decode side: another process, receiving into a store that keeps
  // nothing (this measures the transport, not a tier). One receiver serves
  // every transport: it has a landing segment for shm senders, and a tcp
  // sender does not ask for it. With --curve a second one runs CURVE.
  int ep_pipe[2], hold_pipe[2];
  if (::pipe(ep_pipe) != 0 || ::pipe(hold_pipe) != 0) {
    std::perror("kdn-bench: pipe");
    return 1;
  }
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(ep_pipe[0]);
    ::close(hold_pipe[1]);
    DiscardStore sink;
    ReceiverOptions ro;
    ro.socket_buffer_bytes = socket_buffer_kib * 1024;
    // Room for the batches in flight (RunSenderBench: 4 of n/4 chunks).
    ro.shm_landing_bytes = (static_cast<uint64_t>(n) + 4) * BufferPool::ClassBytes(chunk_bytes);
    auto receiver = Listen("tcp://127.0.0.1:0", sink, ro);
    if (!receiver.ok())
      std::fprintf(stderr, "kdn-bench: %s\n", receiver.status().ToString().c_str());
    std::string ep = receiver.ok() ? (*receiver)->endpoint() : std::string();
    Result<std::unique_ptr<Receiver>> secure = std::unique_ptr<Receiver>();
    if (keys && receiver.ok()) {
      ro.curve = keys;
      secure = Listen("tcp://127.0.0.1:0", sink, ro);
      if (!secure.ok()) std::fprintf(stderr, "kdn-bench: %s\n", secure.status().ToString().c_str());
      ep = secure.ok() ? ep + "\n" + (*secure)->endpoint() : std::string();
    }
    (void)!::write(ep_pipe[1], ep.data(), ep.size());
    ::close(ep_pipe[1]);
    char b;
    while (::read(hold_pipe[0], &b, 1) > 0) {  // until the parent closes it
    }
    ::_exit(!ep.empty() ? 0 : 1);
  }
  ::close(ep_pipe[1]);
  ::close(hold_pipe[0]);
  char buf[512];
  const ssize_t got = ::read(ep_pipe[0], buf, sizeof(buf));
  ::close(ep_pipe[0]);
  auto finish = [&](int code) {
    ::close(hold_pipe[1]);
    ::waitpid(child, nullptr, 0);
    return code;
  };
  if (got <= 0) {
    std::fprintf(stderr, "kdn-bench: the receiving process did not start\n");
    return finish(1);
  }
  const std::string endpoints(buf, static_cast<size_t>(got));
  const std::string endpoint = endpoints.substr(0, endpoints.find('\n'));
  const std::string curve_endpoint =
      keys ? endpoints.substr(endpoints.find('\n') + 1) : std::string();
  const int reps = std::max(c.reps, 1);
  // The limit: one thread copying the request's bytes (not one chunk's,
  // which would stay in cache and overstate what memory can do).
  const double mem = MemcpyOneThreadGBps(chunk_bytes * static_cast<size_t>(n), std::max(c.reps, 4));
  const double mem_cached = MeasureMemcpyGBps(chunk_bytes, std::max(c.reps, 5));
  std::printf(
      "pd-transfer (two processes, control over loopback tcp, socket buffers %s): %d "
      "tokens of %s KV (%s), %d chunks, %.1f MiB per request; best of %d\n",
      socket_buffer_kib > 0 ? (std::to_string(socket_buffer_kib) + " KiB").c_str() : "OS", tokens,
      c.preset.c_str(), KvDTypeName(shape.dtype), n,
      static_cast<double>(chunk_bytes) * n / 1048576.0, reps);
  std::printf("%-12s %10s %14s %8s\n", "transport", "GB/s", "memcpy GB/s", "ratio");
  json rows = json::array();
  std::printf(
      "(memcpy: one thread copying the request's bytes; one %.1f MiB chunk copied again "
      "and again, in cache: %.2f GB/s)\n",
      static_cast<double>(chunk_bytes) / 1048576.0, mem_cached);
  uint64_t seed = 1000;
  std::map<std::string, double> plain_gbps;  // by transport, for the CURVE rows' cost
  for (const bool secure : keys ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
    for (const std::string& name : transports) {
      SenderOptions so;
      so.socket_buffer_bytes = socket_buffer_kib * 1024;
      so.transport = ParseTransportKind(name).value();
      if (secure) so.curve = keys;
      auto sender = Connect(secure ? curve_endpoint : endpoint, so);
      if (!sender.ok()) {
        std::fprintf(stderr, "kdn-bench: %s\n", sender.status().ToString().c_str());
        return finish(1);
      }
      double best = 0.0;
      for (int r = 0; r < reps + 1; ++r) {
        auto chunks = MakeBenchChunks(shape, n, seed++);  // new keys: nothing is skipped
        if (!chunks.ok()) {
          std::fprintf(stderr, "kdn-bench: %s\n", chunks.status().ToString().c_str());
          return finish(1);
        }
        auto res =
            RunSenderBench(**sender, *chunks, std::max(1, n / 4), 4, std::chrono::seconds(120));
        if (!res.ok()) {
          std::fprintf(stderr, "kdn-bench: %s: %s\n", name.c_str(),
                       res.status().ToString().c_str());
          return finish(1);
        }
        if (r > 0) best = std::max(best, res->GBps());  // the first run warms the connection
      }
      const SenderStats st = (*sender)->Stats();
      const std::string label = secure ? name + "+curve" : name;
      std::printf("%-12s %10.2f %14.2f %7.1f%%  (%llu chunks by shm, %llu by tcp)", label.c_str(),
                  best, mem, 100.0 * best / mem, static_cast<unsigned long long>(st.shm_chunks),
                  static_cast<unsigned long long>(st.tcp_chunks));
      json row = {{"transport", name},          {"curve", secure},
                  {"gbytes_per_s", best},       {"memcpy_gbytes_per_s", mem},
                  {"ratio", best / mem},        {"shm_chunks", st.shm_chunks},
                  {"tcp_chunks", st.tcp_chunks}};
      if (secure && plain_gbps[name] > 0) {
        std::printf(" %.2fx of plaintext", best / plain_gbps[name]);
        row["vs_plaintext"] = best / plain_gbps[name];
      }
      std::printf("\n");
      if (!secure) plain_gbps[name] = best;
      rows.push_back(row);
    }
  }
  Emit(c, {{"workload", "pd-transfer"},
           {"preset", c.preset},
           {"tokens", tokens},
           {"chunk_tokens", chunk_tokens},
           {"dtype", KvDTypeName(shape.dtype)},
           {"socket_buffer_kib", socket_buffer_kib},
           {"bytes_per_request", static_cast<double>(chunk_bytes) * n},
           {"memcpy_one_chunk_cached_gbytes_per_s", mem_cached},
           {"machine", Machine(c)},
           {"results", rows}});
  return finish(0);
}

}  // namespace kdn::bench
