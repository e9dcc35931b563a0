// kdn-bench's kvbus workloads: store and pd-transfer (see kdn_bench.cpp).
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <filesystem>
#include <map>
#include <optional>
#include <random>

#include "bench_util.h"
#include "kdn/kvbus/buffer_pool.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/net/curve.h"
#include "kdn/kvbus/disk_tier.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/transport.h"
#include "kdn/bench/transport_bench.h"
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
  const DType dtype = ParseDType(dtype_name);
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
              tokens, c.preset.c_str(), DTypeName(dtype),
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
           {"dtype", DTypeName(dtype)},
           {"bytes", chunk_bytes},
           {"machine", Machine(c)},
           {"results", rows}});
  return 0;
}

namespace {

// The receiving process's landing site for pd-transfer --landing in-place:
// a pool of 16-token blocks in a shared segment, as a decode worker's KV
// pool; each chunk's payload lands scattered over blocks taken from a
// shuffled free list (as a request's blocks lie), given back once it has
// landed. A chunk that finds too few free blocks goes to the sink.
class BenchLandingSite final : public LandingSite {
 public:
  BenchLandingSite(std::unique_ptr<DeviceMemory> pool, uint64_t block_bytes)
      : pool_(std::move(pool)), block_bytes_(block_bytes) {
    for (uint64_t b = 0; b < pool_->bytes() / block_bytes_; ++b) free_.push_back(b);
    std::shuffle(free_.begin(), free_.end(), std::mt19937_64(7));
  }
  const DeviceMemory& pool() const { return *pool_; }

  std::optional<Landing> Claim(const ChunkKey&, uint64_t payload_bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (payload_bytes == 0 || payload_bytes % block_bytes_ != 0) return std::nullopt;
    const uint64_t need = payload_bytes / block_bytes_;
    if (free_.size() < need) return std::nullopt;
    Landing l{next_++, {}};
    std::vector<uint64_t>& blocks = claims_[l.ticket];
    for (uint64_t i = 0; i < need; ++i) {
      blocks.push_back(free_.front());
      free_.pop_front();
      l.extents.push_back({blocks.back() * block_bytes_, block_bytes_});
    }
    return l;
  }
  Status Landed(uint64_t ticket, const Result<ChunkInfo>&) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = claims_.find(ticket);
    if (it == claims_.end()) return Internal("unknown claim");
    free_.insert(free_.end(), it->second.begin(), it->second.end());
    claims_.erase(it);
    return Status::Ok();
  }

 private:
  std::unique_ptr<DeviceMemory> pool_;
  const uint64_t block_bytes_;
  std::mutex mu_;
  std::deque<uint64_t> free_;
  std::map<uint64_t, std::vector<uint64_t>> claims_;
  uint64_t next_ = 1;
};

// The NIXL peer's best GB/s for `bytes` (bench/nixl_peer.py), or a
// negative value, having said why on stderr.
double RunNixlPeer(const PdTransferOptions& o, uint64_t bytes, int reps) {
  const std::string cmd = o.nixl_python + " " + o.nixl_script + " --bytes " +
                          std::to_string(bytes) + " --reps " + std::to_string(reps);
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) {
    std::perror("kdn-bench: popen");
    return -1;
  }
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int rc = ::pclose(p);
  try {
    if (rc != 0) throw std::runtime_error("exit status " + std::to_string(rc));
    // Its stdout is one line of JSON (progress goes to stderr).
    const json j = json::parse(out);
    return j.at("gbytes_per_s").get<double>();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kdn-bench: the NIXL peer (%s) gave no figure: %s\n", cmd.c_str(),
                 e.what());
    return -1;
  }
}

}  // namespace

int RunPdTransfer(const Common& c, const PdTransferOptions& o) {
  auto preset = engine::FindPreset(c.preset);
  if (!preset.ok()) {
    std::fprintf(stderr, "kdn-bench: %s\n", preset.status().ToString().c_str());
    return 2;
  }
  const model::ModelConfig& cfg = preset->config;
  ChunkInfo shape{.layers = static_cast<uint32_t>(cfg.num_layers),
                  .kv_heads = static_cast<uint32_t>(cfg.num_kv_heads),
                  .head_dim = static_cast<uint32_t>(cfg.head_dim),
                  .tokens = static_cast<uint32_t>(o.chunk_tokens),
                  .dtype = ParseDType(o.dtype)};
  const int n = o.tokens / o.chunk_tokens;
  const size_t chunk_bytes = Chunk::kHeaderBytes + shape.payload_bytes();
  const uint64_t block_bytes =
      uint64_t{engine::kKvBlockTokens} * shape.kv_heads * shape.head_dim * DTypeSize(shape.dtype);
  if (n < 1 || o.chunk_tokens % engine::kKvBlockTokens != 0) {
    std::fprintf(stderr, "kdn-bench: --tokens must be at least --chunk-tokens, a multiple of %d\n",
                 engine::kKvBlockTokens);
    return 2;
  }

  // With --curve, each row is measured plaintext and with CURVE, the
  // receiver holding the key the child inherits.
  std::optional<net::CurveKeys> keys;
  if (o.curve) {
    auto k = net::GenerateCurveKeys();
    if (!k.ok()) {
      std::fprintf(stderr, "kdn-bench: %s\n", k.status().ToString().c_str());
      return 1;
    }
    keys = *k;
  }
  const std::vector<bool> securities =
      keys ? std::vector<bool>{false, true} : std::vector<bool>{false};

  // The decode side: another process, with one receiver per landing mode
  // (and security): in-place lands payloads scattered over a pool's blocks;
  // staging receives into a store that keeps nothing (this measures the
  // transport, not a tier). Every receiver has a landing segment for shm
  // senders; a tcp sender does not ask for it. For the device planes
  // (cuda_ipc, nccl), in-place has a receiver of its own whose pool is a
  // device region: the host backend's memory standing in for a device and
  // its loopback link for NCCL (kdn/kvbus/device_ops.h), so that the rows
  // measure what the device planes' code adds to the same copy.
  struct Target {
    std::string landing;
    bool secure = false;
    bool device = false;
  };
  std::vector<Target> targets;
  const auto device_plane = [](const std::string& name) {
    return name == "cuda_ipc" || name == "nccl";
  };
  const bool want_device = std::any_of(o.transports.begin(), o.transports.end(), device_plane);
  for (const std::string& landing : o.landings) {
    for (const bool secure : securities) {
      targets.push_back({landing, secure, false});
      if (landing == "in-place" && want_device) targets.push_back({landing, secure, true});
    }
  }
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
    std::vector<std::unique_ptr<BenchLandingSite>> sites;
    std::vector<std::unique_ptr<Receiver>> receivers;
    std::string eps;
    for (const Target& t : targets) {
      {
        const std::string& landing = t.landing;
        const bool secure = t.secure;
        ReceiverOptions ro;
        ro.socket_buffer_bytes = o.socket_buffer_kib * 1024;
        // Room for the batches in flight (RunSenderBench: 4 of n/4 chunks).
        ro.shm_landing_bytes = (static_cast<uint64_t>(n) + 4) * BufferPool::ClassBytes(chunk_bytes);
        if (secure) ro.curve = keys;
        if (landing == "in-place") {
          auto pool =
              HostDeviceOps().Allocate((static_cast<uint64_t>(n) + 4) * shape.payload_bytes());
          if (!pool.ok()) {
            std::fprintf(stderr, "kdn-bench: %s\n", pool.status().ToString().c_str());
            ::_exit(1);
          }
          std::memset((*pool)->data(), 0, (*pool)->bytes());  // resident, as a worker's pool is
          sites.push_back(std::make_unique<BenchLandingSite>(std::move(pool).value(), block_bytes));
          ro.landing = sites.back().get();
          ro.landing_region = &sites.back()->pool();
          ro.landing_kind = t.device ? RegionKind::kDevice : RegionKind::kShm;
        }
        auto r = Listen("tcp://127.0.0.1:0", sink, ro);
        if (!r.ok()) {
          std::fprintf(stderr, "kdn-bench: %s\n", r.status().ToString().c_str());
          ::_exit(1);
        }
        eps += (*r)->endpoint() + "\n";
        receivers.push_back(std::move(r).value());
      }
    }
    (void)!::write(ep_pipe[1], eps.data(), eps.size());
    ::close(ep_pipe[1]);
    char b;
    while (::read(hold_pipe[0], &b, 1) > 0) {  // until the parent closes it
    }
    receivers.clear();
    ::_exit(0);
  }
  ::close(ep_pipe[1]);
  ::close(hold_pipe[0]);
  std::string endpoints;
  char buf[512];
  for (ssize_t got; (got = ::read(ep_pipe[0], buf, sizeof(buf))) > 0;) endpoints.append(buf, got);
  ::close(ep_pipe[0]);
  auto finish = [&](int code) {
    ::close(hold_pipe[1]);
    ::waitpid(child, nullptr, 0);
    return code;
  };
  std::vector<std::string> eps;
  for (size_t at = 0, nl; (nl = endpoints.find('\n', at)) != std::string::npos; at = nl + 1) {
    eps.push_back(endpoints.substr(at, nl - at));
  }
  if (eps.size() != targets.size()) {
    std::fprintf(stderr, "kdn-bench: the receiving process did not start\n");
    return finish(1);
  }
  const int reps = std::max(c.reps, 1);
  const uint64_t request_bytes = chunk_bytes * static_cast<uint64_t>(n);
  // The limit: one thread copying the request's bytes (not one chunk's,
  // which would stay in cache and overstate what memory can do).
  const double mem = MemcpyOneThreadGBps(request_bytes, std::max(c.reps, 4));
  const double mem_cached = MeasureMemcpyGBps(chunk_bytes, std::max(c.reps, 5));
  std::printf(
      "pd-transfer (two processes, control over loopback tcp, socket buffers %s): %d "
      "tokens of %s KV (%s), %d chunks, %.1f MiB per request; best of %d\n",
      o.socket_buffer_kib > 0 ? (std::to_string(o.socket_buffer_kib) + " KiB").c_str() : "OS",
      o.tokens, c.preset.c_str(), DTypeName(shape.dtype), n,
      static_cast<double>(request_bytes) / 1048576.0, reps);
  std::printf(
      "(memcpy: one thread copying the request's bytes; one %.1f MiB chunk copied again "
      "and again, in cache: %.2f GB/s)\n",
      static_cast<double>(chunk_bytes) / 1048576.0, mem_cached);
  double nixl = -1;
  if (!o.nixl_python.empty()) {
    nixl = RunNixlPeer(o, request_bytes, reps);
    if (nixl < 0) return finish(1);
  }
  std::printf("%-24s %8s %12s %9s%s\n", "transport", "GB/s", "memcpy GB/s", "of memcpy",
              nixl > 0 ? "   of NIXL" : "");
  json rows = json::array();
  if (nixl > 0) {
    std::printf("%-24s %8.2f %12.2f %8.1f%%   (bench/nixl_peer.py, UCX)\n", "nixl (peer)", nixl,
                mem, 100.0 * nixl / mem);
    rows.push_back({{"transport", "nixl"},
                    {"gbytes_per_s", nixl},
                    {"memcpy_gbytes_per_s", mem},
                    {"ratio", nixl / mem}});
  }
  uint64_t seed = 1000;
  std::map<std::string, double> plain_gbps;  // by row, for the CURVE rows' cost
  std::map<std::string, double> row_gbps;    // by label, for cuda_ipc's ratio to shm
  for (size_t ep = 0; ep < targets.size(); ++ep) {
    {
      const std::string& landing = targets[ep].landing;
      const bool secure = targets[ep].secure;
      const std::string endpoint = eps[ep];
      for (const std::string& name : o.transports) {
        // The device planes only into the device pool; the others only elsewhere.
        const bool device = device_plane(name);
        if (device != targets[ep].device) continue;
        SenderOptions so;
        so.socket_buffer_bytes = o.socket_buffer_kib * 1024;
        so.transport = ParseTransportKind(name).value();
        if (targets[ep].device) so.device_ops = &HostDeviceOps();
        if (secure) so.curve = keys;
        auto sender = Connect(endpoint, so);
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
        const SenderStats stats = (*sender)->Stats();
        // The region plane's figures: shm's, or the device plane's (whose
        // chunks are reported in the same columns).
        const PlaneStats shm = stats.plane(device ? name : "shm"), tcp = stats.plane("tcp");
        const std::string base = name + " " + landing;
        const std::string label = secure ? base + " +curve" : base;
        std::printf("%-24s %8.2f %12.2f %8.1f%%", label.c_str(), best, mem, 100.0 * best / mem);
        if (nixl > 0) std::printf(" %8.2fx", best / nixl);
        std::printf("  (%llu chunks by %s, %llu by tcp",
                    static_cast<unsigned long long>(shm.chunks),
                    name == "cuda_ipc" ? "cuda_ipc (host backend)"
                    : name == "nccl"   ? "nccl (host backend's link)"
                                       : "shm",
                    static_cast<unsigned long long>(tcp.chunks));
        // The sender's own copies into shared memory, apart from the rest.
        const double copy_gbps =
            shm.copy_seconds > 0 ? static_cast<double>(shm.bytes) / shm.copy_seconds / 1e9 : 0;
        if (copy_gbps > 0) std::printf("; its region copies at %.2f GB/s", copy_gbps);
        std::printf(")");
        json row = {{"transport", name},
                    {"landing", landing},
                    {"curve", secure},
                    {"gbytes_per_s", best},
                    {"memcpy_gbytes_per_s", mem},
                    {"ratio", best / mem},
                    {device ? name + "_chunks" : "shm_chunks", shm.chunks},
                    {"tcp_chunks", tcp.chunks}};
        // A device plane over the host backend moves the same bytes into
        // the same pool as shm: its ratio to shm's row shows what its own
        // code costs (cuda_ipc: the same copy; nccl: a loopback socket).
        const std::string shm_row = std::string("shm in-place") + (secure ? " +curve" : "");
        if (device && row_gbps.count(shm_row) != 0) {
          std::printf(" %.2fx of shm", best / row_gbps[shm_row]);
          row["vs_shm"] = best / row_gbps[shm_row];
        }
        row_gbps[label] = best;
        if (nixl > 0) row["vs_nixl"] = best / nixl;
        if (secure && plain_gbps[base] > 0) {
          std::printf(" %.2fx of plaintext", best / plain_gbps[base]);
          row["vs_plaintext"] = best / plain_gbps[base];
        }
        std::printf("\n");
        if (!secure) plain_gbps[base] = best;
        rows.push_back(row);
      }
    }
  }
  Emit(c, {{"workload", "pd-transfer"},
           {"preset", c.preset},
           {"tokens", o.tokens},
           {"chunk_tokens", o.chunk_tokens},
           {"dtype", DTypeName(shape.dtype)},
           {"socket_buffer_kib", o.socket_buffer_kib},
           {"bytes_per_request", static_cast<double>(request_bytes)},
           {"memcpy_one_chunk_cached_gbytes_per_s", mem_cached},
           {"nixl_gbytes_per_s", nixl > 0 ? json(nixl) : json(nullptr)},
           {"machine", Machine(c)},
           {"results", rows}});
  return finish(0);
}

}  // namespace kdn::bench
