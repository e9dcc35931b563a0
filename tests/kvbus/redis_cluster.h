#pragma once
// A real Redis for the Redis tier's tests: Debian's redis-server processes
// on loopback in a test's folder, either a cluster (primaries, each with
// replicas, made by `redis-cli --cluster create`) or one standalone node.
// Every wait polls for what it names, with a deadline; nothing sleeps for a
// guessed time.

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kdn::kvbus::testing {

// Whether `fn` became true before `timeout` passed (polled every 20 ms).
inline bool WaitUntil(const std::function<bool()>& fn, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (fn()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return fn();
}

// Output of a shell command (stderr kept apart), "" when it cannot run.
inline std::string Shell(const std::string& cmd) {
  std::string out;
  FILE* f = popen((cmd + " 2>/dev/null").c_str(), "r");
  if (f == nullptr) return out;
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  pclose(f);
  return out;
}

inline bool PortFree(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

class RedisCluster {
 public:
  struct Options {
    int primaries = 3;
    int replicas = 1;     // per primary
    bool cluster = true;  // false: one standalone node (primaries, replicas ignored)
    std::string password = "kdn-test-secret";
    int maxmemory_mib = 0;  // 0: unbounded
    // How long a node may go unanswered before the others hold it to have
    // failed and its replica takes over. Long (Redis's default) unless a
    // test kills a node: on a loaded machine a node stalls for a second
    // now and then, and a failover nobody asked for loses the writes its
    // replica had not yet taken.
    int node_timeout_ms = 15000;
  };

  // Starts the nodes under `dir` and waits until the cluster says
  // cluster_state:ok on every node and every replica is in sync. Fails the
  // test (and returns null) when it cannot.
  //
  // The nodes' files (cluster config, logs) go to a folder of their own in
  // /dev/shm where there is one, else under `dir`: a node fsyncs its
  // cluster config at every slot change, and on a busy disk one fsync can
  // stall it past the node timeout.
  static std::unique_ptr<RedisCluster> Start(const std::filesystem::path& dir, Options o) {
    if (Shell("command -v redis-server").empty()) {
      ADD_FAILURE() << "redis-server is missing: run scripts/install-deps.sh";
      return nullptr;
    }
    auto c = std::unique_ptr<RedisCluster>(new RedisCluster(dir, o));
    const int n = o.cluster ? o.primaries * (1 + o.replicas) : 1;
    if (!c->PickPorts(n)) {
      ADD_FAILURE() << "no free loopback ports for " << n << " redis nodes";
      return nullptr;
    }
    for (int i = 0; i < n; ++i) c->Launch(i);
    for (int i = 0; i < n; ++i) {
      if (!WaitUntil([&] { return c->Cli(i, "ping").find("PONG") == 0; },
                     std::chrono::seconds(10))) {
        ADD_FAILURE() << "redis node on port " << c->ports_[i] << " did not start; see "
                      << (c->dir_ / ("node-" + std::to_string(c->ports_[i]) + ".log"));
        return nullptr;
      }
    }
    if (!o.cluster) return c;
    std::string create = "redis-cli --no-auth-warning -a " + o.password + " --cluster create";
    for (int p : c->ports_) create += " 127.0.0.1:" + std::to_string(p);
    create += " --cluster-replicas " + std::to_string(o.replicas) + " --cluster-yes";
    const std::string made = Shell(create);
    if (!c->WaitHealthy(std::chrono::seconds(30))) {
      ADD_FAILURE() << "the cluster did not come up: " << made;
      return nullptr;
    }
    return c;
  }

  ~RedisCluster() {
    for (pid_t p : pids_) {
      if (p > 0) kill(p, SIGKILL);
    }
    for (pid_t p : pids_) {
      if (p > 0) waitpid(p, nullptr, 0);
    }
    if (own_dir_) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }
  RedisCluster(const RedisCluster&) = delete;
  RedisCluster& operator=(const RedisCluster&) = delete;

  // redis://:password@127.0.0.1:p1,... with every node as a seed.
  std::string url() const {
    std::string u = "redis://:" + o_.password + "@";
    for (size_t i = 0; i < ports_.size(); ++i) {
      u += (i > 0 ? ",127.0.0.1:" : "127.0.0.1:") + std::to_string(ports_[i]);
    }
    return u;
  }
  size_t size() const { return ports_.size(); }
  int port(size_t i) const { return ports_[i]; }
  std::string addr(size_t i) const { return "127.0.0.1:" + std::to_string(ports_[i]); }
  size_t IndexOf(const std::string& address) const {
    for (size_t i = 0; i < ports_.size(); ++i) {
      if (addr(i) == address) return i;
    }
    return ports_.size();
  }

  // redis-cli against node i (its stdout).
  std::string Cli(size_t i, const std::string& args) const {
    return Shell("redis-cli --no-auth-warning -a " + o_.password + " -p " +
                 std::to_string(ports_[i]) + " " + args);
  }
  // The node's id in the cluster.
  std::string Id(size_t i) const {
    std::string s = Cli(i, "cluster myid");
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    return s;
  }
  bool IsPrimary(size_t i) const { return Cli(i, "role").find("master") == 0; }

  void Kill(size_t i) {
    if (pids_[i] > 0) {
      kill(pids_[i], SIGKILL);
      waitpid(pids_[i], nullptr, 0);
      pids_[i] = -1;
    }
  }
  bool alive(size_t i) const { return pids_[i] > 0; }

  // cluster_state:ok on every live node, each live primary's replicas
  // caught up with it.
  bool WaitHealthy(std::chrono::milliseconds timeout) const {
    return WaitUntil(
        [&] {
          for (size_t i = 0; i < ports_.size(); ++i) {
            if (!alive(i)) continue;
            if (Cli(i, "cluster info").find("cluster_state:ok") == std::string::npos) return false;
            const std::string rep = Cli(i, "info replication");
            if (rep.find("role:slave") != std::string::npos &&
                rep.find("master_link_status:up") == std::string::npos) {
              return false;
            }
          }
          return true;
        },
        timeout);
  }

  // Waits until every live node agrees on which primary serves each slot and
  // no slot is half-way between two (redis-cli --cluster check, through
  // node `via`): what a resharding leaves to gossip once redis-cli returns.
  bool WaitSlotsAgree(size_t via, std::chrono::milliseconds timeout) const {
    return WaitUntil(
        [&] {
          const std::string out = Shell("redis-cli --no-auth-warning -a " + o_.password +
                                        " --cluster check " + addr(via) + " 2>&1");
          return out.find("[OK] All nodes agree about slots configuration.") != std::string::npos &&
                 out.find("[WARNING]") == std::string::npos &&
                 out.find("[ERR]") == std::string::npos;
        },
        timeout);
  }

  // Waits until every replica of a live primary has every write it took.
  bool WaitReplicated(std::chrono::milliseconds timeout) const {
    return WaitUntil(
        [&] {
          for (size_t i = 0; i < ports_.size(); ++i) {
            if (!alive(i) || !IsPrimary(i)) continue;
            const std::string rep = Cli(i, "info replication");
            const std::string off = Field(rep, "master_repl_offset:");
            size_t at = 0;
            while ((at = rep.find("slave", at)) != std::string::npos) {
              const size_t line_end = rep.find('\n', at);
              const std::string line = rep.substr(at, line_end - at);
              at = line_end;
              const size_t o = line.find("offset=");
              if (o == std::string::npos) continue;
              const std::string got = line.substr(o + 7, line.find(',', o) - o - 7);
              if (got != off) return false;
            }
          }
          return true;
        },
        timeout);
  }

  // What the nodes' logs say about failures and failovers (lines naming
  // FAIL, failover or an epoch), for a failing test's message.
  std::string Events() const {
    std::string out;
    for (int p : ports_) {
      const auto log = dir_ / ("node-" + std::to_string(p) + ".log");
      out += Shell("grep -iE 'FAIL|failover|epoch|slot' " + log.string() + " | sed 's/^/" +
                   std::to_string(p) + " /'");
    }
    return out;
  }

  static std::string Field(const std::string& info, const std::string& name) {
    const size_t at = info.find(name);
    if (at == std::string::npos) return "";
    const size_t end = info.find_first_of("\r\n", at);
    return info.substr(at + name.size(), end - at - name.size());
  }

 private:
  RedisCluster(std::filesystem::path dir, Options o) : dir_(std::move(dir)), o_(std::move(o)) {
    std::string shm = "/dev/shm/kdn-redis-XXXXXX";
    if (mkdtemp(shm.data()) != nullptr) {
      dir_ = shm;
      own_dir_ = true;
    }
  }

  bool PickPorts(int n) {
    std::mt19937 rng(std::random_device{}());
    for (int attempt = 0; attempt < 50; ++attempt) {
      // Ports and cluster-bus ports (+10000) below Linux's ephemeral range
      // (32768 on), which the kernel hands to outgoing connections.
      const int base = 10000 + static_cast<int>(rng() % 12000);
      bool ok = true;
      for (int i = 0; i < n && ok; ++i) ok = PortFree(base + i) && PortFree(base + i + 10000);
      if (!ok) continue;
      ports_.clear();
      for (int i = 0; i < n; ++i) ports_.push_back(base + i);
      return true;
    }
    return false;
  }

  void Launch(int i) {
    const std::string port = std::to_string(ports_[i]);
    std::vector<std::string> args = {"redis-server",
                                     "--port",
                                     port,
                                     "--bind",
                                     "127.0.0.1",
                                     "--dir",
                                     dir_.string(),
                                     "--logfile",
                                     (dir_ / ("node-" + port + ".log")).string(),
                                     "--save",
                                     "",
                                     "--appendonly",
                                     "no",
                                     "--requirepass",
                                     o_.password,
                                     "--masterauth",
                                     o_.password};
    if (o_.cluster) {
      args.insert(args.end(),
                  {"--cluster-enabled", "yes", "--cluster-config-file", "nodes-" + port + ".conf",
                   "--cluster-node-timeout", std::to_string(o_.node_timeout_ms),
                   "--cluster-require-full-coverage", "no"});
    }
    if (o_.maxmemory_mib > 0) {
      args.insert(args.end(), {"--maxmemory", std::to_string(o_.maxmemory_mib) + "mb",
                               "--maxmemory-policy", "allkeys-lru",
                               // Redis's most: more than the keys a test holds, so that
                               // every eviction samples them all and evicts the least
                               // recently used, exactly (with 10 samples a hot key was
                               // sometimes evicted when few older keys were left).
                               "--maxmemory-samples", "64"});
    }
    const pid_t pid = fork();
    if (pid == 0) {
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execvp("redis-server", argv.data());
      _exit(127);
    }
    pids_.push_back(pid);
  }

  std::filesystem::path dir_;
  bool own_dir_ = false;  // dir_ is in /dev/shm, removed with the nodes
  Options o_;
  std::vector<int> ports_;
  std::vector<pid_t> pids_;
};

}  // namespace kdn::kvbus::testing
