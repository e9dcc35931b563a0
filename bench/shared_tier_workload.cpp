// kdn-bench store --backends kdn-store,redis: the KDN tiers workers share,
// measured as workers use them (4 client threads, MB-sized chunks, 128-key
// lookups), against redis-benchmark on the same cluster in the same run.
//
// Given no URLs it starts what it measures and stops it afterwards: a
// kdn-store (the program beside kdn-bench) and a 3-primary, 3-replica Redis
// Cluster on loopback (the launcher's launch/kdn_launch/redis_cluster.py,
// with the settings a deployment gets).

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <thread>

#include "bench_util.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/redis_store.h"
#include "kdn/kvbus/shared_tier.h"

namespace kdn::bench {

namespace {

namespace fs = std::filesystem;
using kvbus::Chunk;
using kvbus::ChunkKey;

constexpr ChunkKey kBenchModel{0x6b646e62656e6368ull, 2};

fs::path SelfDir() { return fs::read_symlink("/proc/self/exe").parent_path(); }

std::string RunCapture(const std::string& cmd) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  if (f == nullptr) return out;
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  pclose(f);
  return out;
}

// A chunk of `payload_bytes` of f32 KV (64 tokens of 8 heads x 64 dims per
// layer, layers to fit), its bytes varying with `id`.
std::shared_ptr<const Chunk> BenchChunk(uint64_t id, uint64_t payload_bytes) {
  kvbus::ChunkInfo info;
  info.key = ChunkKey{id * 0x9e3779b97f4a7c15ull + 1, id};
  info.model_fingerprint = kBenchModel;
  info.kv_heads = 8;
  info.head_dim = 64;
  info.tokens = 64;
  info.dtype = kdn::DType::kF32;
  const uint64_t per_layer = 2ull * 64 * 8 * 64 * 4;
  info.layers = static_cast<uint32_t>(std::max<uint64_t>(1, payload_bytes / per_layer));
  std::vector<uint8_t> payload(info.payload_bytes());
  for (size_t i = 0; i < payload.size(); i += 64) payload[i] = static_cast<uint8_t>(id + i);
  return Chunk::Make(info, std::move(payload)).value();
}

// A kdn-store process started for the run (the program beside kdn-bench).
class StoreProcess {
 public:
  static std::unique_ptr<StoreProcess> Start() {
    const fs::path bin = SelfDir() / "kdn-store";
    int out[2];
    if (pipe(out) != 0) return nullptr;
    auto p = std::unique_ptr<StoreProcess>(new StoreProcess);
    p->pid_ = fork();
    if (p->pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      close(out[0]);
      execl(bin.c_str(), bin.c_str(), "--listen", "tcp://127.0.0.1:0", "--host-mib", "4096",
            "--log-level", "warn", static_cast<char*>(nullptr));
      _exit(127);
    }
    close(out[1]);
    FILE* f = fdopen(out[0], "r");
    char line[256] = {};
    if (fgets(line, sizeof(line), f) != nullptr) {
      p->endpoint_ = std::string(line, strcspn(line, "\n"));
    }
    fclose(f);
    if (p->endpoint_.empty()) {
      std::fprintf(stderr, "kdn-bench: %s did not start\n", bin.c_str());
      return nullptr;
    }
    return p;
  }
  ~StoreProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
  }
  const std::string& endpoint() const { return endpoint_; }

 private:
  StoreProcess() = default;
  pid_t pid_ = -1;
  std::string endpoint_;
};

// A Redis Cluster started for the run by the launcher's module (python3 -m
// kdn_launch.redis_cluster), which prints the URL and serves until its
// stdin closes; then it stops the cluster.
class ClusterProcess {
 public:
  static std::unique_ptr<ClusterProcess> Start(int primaries) {
    fs::path launch;
    for (const fs::path& p : {SelfDir() / ".." / ".." / "launch", SelfDir() / ".." / "launch"}) {
      if (fs::exists(p / "kdn_launch" / "redis_cluster.py")) launch = fs::canonical(p);
    }
    if (launch.empty()) {
      std::fprintf(stderr, "kdn-bench: launch/kdn_launch not found beside %s\n", SelfDir().c_str());
      return nullptr;
    }
    auto c = std::unique_ptr<ClusterProcess>(new ClusterProcess);
    c->dir_ = fs::temp_directory_path() / ("kdn-bench-redis-" + std::to_string(getpid()));
    fs::create_directories(c->dir_);
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return nullptr;
    c->pid_ = fork();
    if (c->pid_ == 0) {
      dup2(in[0], STDIN_FILENO);
      dup2(out[1], STDOUT_FILENO);
      close(in[1]);
      close(out[0]);
      if (chdir(launch.c_str()) != 0) _exit(127);
      const std::string primaries_arg = std::to_string(primaries);
      execlp("python3", "python3", "-m", "kdn_launch.redis_cluster", c->dir_.c_str(), "--primaries",
             primaries_arg.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    c->stdin_ = in[1];
    // Its stdout stays open while the cluster serves: it prints a line per
    // node after the URL, which a closed pipe would make it fail on.
    c->stdout_ = fdopen(out[0], "r");
    char line[4096] = {};
    if (c->stdout_ != nullptr && fgets(line, sizeof(line), c->stdout_) != nullptr) {
      c->url_ = std::string(line, strcspn(line, "\n"));
    }
    if (c->url_.rfind("redis://", 0) != 0) {
      std::fprintf(stderr, "kdn-bench: the Redis Cluster did not start (see above)\n");
      return nullptr;
    }
    return c;
  }
  ~ClusterProcess() {
    if (stdin_ >= 0) close(stdin_);  // the module stops the cluster and exits
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
    if (stdout_ != nullptr) fclose(stdout_);
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  const std::string& url() const { return url_; }

 private:
  ClusterProcess() = default;
  pid_t pid_ = -1;
  int stdin_ = -1;
  FILE* stdout_ = nullptr;
  fs::path dir_;
  std::string url_;
};

struct TierFigures {
  double put_gbps = 0, get_gbps = 0, lookup_128_ms = 0;
  bool ok = true;
};

// `clients` threads each put then get `per_client` chunks; then 128-key
// lookups (half held) from one thread, the median of 20.
TierFigures Measure(const std::function<std::unique_ptr<kvbus::ChunkStore>()>& connect, int clients,
                    int per_client, uint64_t chunk_bytes, uint64_t run) {
  TierFigures f;
  std::vector<std::unique_ptr<kvbus::ChunkStore>> stores;
  for (int i = 0; i < clients; ++i) {
    stores.push_back(connect());
    if (stores.back() == nullptr) return {.ok = false};
  }
  std::vector<std::vector<std::shared_ptr<const Chunk>>> chunks(clients);
  uint64_t bytes = 0;
  for (int i = 0; i < clients; ++i) {
    for (int k = 0; k < per_client; ++k) {
      chunks[i].push_back(
          BenchChunk(run * 100000 + static_cast<uint64_t>(i * per_client + k), chunk_bytes));
      bytes += chunks[i].back()->size();
    }
  }
  std::atomic<int> failures{0};
  auto phase = [&](bool put) {
    std::vector<std::thread> threads;
    const auto t0 = Clock::now();
    for (int i = 0; i < clients; ++i) {
      threads.emplace_back([&, i] {
        for (const auto& ch : chunks[i]) {
          const bool good = put ? stores[i]->Put(ch).ok() : stores[i]->Get(ch->key()).ok();
          if (!good) ++failures;
        }
      });
    }
    for (auto& t : threads) t.join();
    return static_cast<double>(bytes) / Seconds(t0, Clock::now()) / 1e9;
  };
  f.put_gbps = phase(true);
  f.get_gbps = phase(false);
  std::vector<ChunkKey> keys;
  for (int k = 0; k < 128; ++k) {
    const auto& all = chunks[static_cast<size_t>(k) % chunks.size()];
    keys.push_back(k % 2 == 0 && k / 2 < static_cast<int>(all.size()) * clients
                       ? all[static_cast<size_t>(k / 2) % all.size()]->key()
                       : ChunkKey{0xdead0000ull + static_cast<uint64_t>(k), run});
  }
  std::vector<double> ms;
  for (int r = 0; r < 20; ++r) {
    const auto t0 = Clock::now();
    (void)stores[0]->ContainsMany(keys);
    ms.push_back(Seconds(t0, Clock::now()) * 1e3);
  }
  std::sort(ms.begin(), ms.end());
  f.lookup_128_ms = ms[ms.size() / 2];
  if (failures > 0) {
    std::fprintf(stderr, "kdn-bench: %d puts or gets failed\n", failures.load());
    f.ok = false;
  }
  return f;
}

// redis-benchmark's SET and GET requests per second for values of
// `value_bytes`, `clients` connections, on the cluster at `url`. SET writes
// new keys (random among 10^9), as kdn's puts of new chunks do; GET reads 8
// keys a SET run wrote first (256 requests: all 8 are written), spread over
// the primaries, so that it reads values, not misses, at least 256 times
// (fewer would time its start-up too).
std::pair<double, double> RedisBenchmark(const std::string& url, int clients, int requests,
                                         uint64_t value_bytes) {
  auto parsed = kvbus::ParseRedisUrl(url);
  if (!parsed.ok()) return {0, 0};
  const auto& [host, port] = parsed->seeds.front();
  auto run = [&](const char* test, int n, int keys) {
    std::string cmd = "redis-benchmark --cluster -h " + host + " -p " + std::to_string(port) +
                      " -c " + std::to_string(clients) + " -n " + std::to_string(n) + " -d " +
                      std::to_string(value_bytes) + " -r " + std::to_string(keys) + " -t " + test +
                      " --csv";
    if (!parsed->password.empty()) cmd += " -a '" + parsed->password + "'";
    if (!parsed->user.empty()) cmd += " --user '" + parsed->user + "'";
    const std::string out = RunCapture(cmd + " 2>/dev/null");
    std::smatch m;
    const std::regex line(std::string("\"") + (test[0] == 's' ? "SET" : "GET") +
                          "\",\"([0-9.]+)\"");
    return std::regex_search(out, m, line) ? std::stod(m[1]) : 0.0;
  };
  const double set = run("set", requests, 1000000000);
  (void)run("set", 256, 8);
  const double get = run("get", std::max(requests, 256), 8);
  return {set, get};
}

}  // namespace

int RunSharedTiers(const Common& c, const std::vector<std::string>& backends,
                   const std::string& store_url, const std::string& redis_url, int chunk_mib,
                   int clients, int per_client) {
  const uint64_t chunk_bytes = static_cast<uint64_t>(chunk_mib) << 20;
  json rows = json::array();
  std::printf("shared tiers: %d clients, %d chunks of %d MiB each, best of %d\n", clients,
              per_client, chunk_mib, std::max(c.reps, 1));
  std::printf("%-10s %9s %9s %14s %14s %14s\n", "backend", "put GB/s", "get GB/s", "lookup 128 ms",
              "put/redis-bm", "get/redis-bm");
  int rc = 0;
  for (const std::string& backend : backends) {
    std::unique_ptr<StoreProcess> store;
    std::unique_ptr<ClusterProcess> cluster;
    std::string uri;
    if (backend == "kdn-store") {
      uri = store_url;
      if (uri.empty()) {
        store = StoreProcess::Start();
        if (store == nullptr) return 1;
        uri = store->endpoint();
      }
    } else {
      uri = redis_url;
      if (uri.empty()) {
        cluster = ClusterProcess::Start(3);
        if (cluster == nullptr) return 1;
        uri = cluster->url();
      }
    }
    auto connect = [&]() -> std::unique_ptr<kvbus::ChunkStore> {
      auto s = kvbus::OpenSharedTier(uri, {.model = kBenchModel});
      if (!s.ok()) {
        std::fprintf(stderr, "kdn-bench: %s\n", s.status().ToString().c_str());
        return nullptr;
      }
      return std::move(s).value();
    };
    // Each repetition measures kdn's client, then (redis) redis-benchmark
    // on the same cluster, so that both see the same conditions; the best
    // of each is kept.
    TierFigures best;
    double set_gbps = 0, get_gbps = 0;
    for (int r = 0; r < std::max(c.reps, 1); ++r) {
      const TierFigures f =
          Measure(connect, clients, per_client, chunk_bytes,
                  static_cast<uint64_t>(getpid()) * 16 + static_cast<uint64_t>(r));
      if (!f.ok) return 1;
      best.put_gbps = std::max(best.put_gbps, f.put_gbps);
      best.get_gbps = std::max(best.get_gbps, f.get_gbps);
      best.lookup_128_ms = r == 0 ? f.lookup_128_ms : std::min(best.lookup_128_ms, f.lookup_128_ms);
      if (backend == "redis") {
        const auto [set_rps, get_rps] =
            RedisBenchmark(uri, clients, clients * per_client, chunk_bytes);
        set_gbps = std::max(set_gbps, set_rps * static_cast<double>(chunk_bytes) / 1e9);
        get_gbps = std::max(get_gbps, get_rps * static_cast<double>(chunk_bytes) / 1e9);
      }
    }
    json row = {{"backend", backend},
                {"put_gbps", best.put_gbps},
                {"get_gbps", best.get_gbps},
                {"lookup_128_ms", best.lookup_128_ms}};
    if (backend == "redis") {
      if (set_gbps <= 0 || get_gbps <= 0) {
        std::fprintf(stderr, "kdn-bench: redis-benchmark gave no rates\n");
        rc = 1;
      } else {
        row["redis_benchmark_set_gbps"] = set_gbps;
        row["redis_benchmark_get_gbps"] = get_gbps;
        row["ratio_to_redis_benchmark_put"] = best.put_gbps / set_gbps;
        row["ratio_to_redis_benchmark_get"] = best.get_gbps / get_gbps;
      }
    }
    auto ratio = [&](const char* k) {
      return row.contains(k) ? std::to_string(row[k].get<double>()).substr(0, 5) : std::string("-");
    };
    std::printf("%-10s %9.2f %9.2f %14.3f %14s %14s\n", backend.c_str(), best.put_gbps,
                best.get_gbps, best.lookup_128_ms, ratio("ratio_to_redis_benchmark_put").c_str(),
                ratio("ratio_to_redis_benchmark_get").c_str());
    rows.push_back(row);
  }
  Emit(c, {{"workload", "store-shared"},
           {"clients", clients},
           {"chunks_per_client", per_client},
           {"chunk_mib", chunk_mib},
           {"machine", Machine(c)},
           {"results", rows}});
  return rc;
}

}  // namespace kdn::bench
