#pragma once
// A real Redis for the Redis tier's tests: Debian's redis-server processes
// on loopback in a test's folder, either a cluster (primaries, each with
// replicas, made by `redis-cli --cluster create`) or one standalone node,
// started as kdn-launch starts them (`python3 -m kdn_launch.redis_cluster`,
// launch/kdn_launch/redis_cluster.py: the same redis.conf), which this
// harness then drives (kills a node, reads its state). Every wait polls for
// what it names, with a deadline; nothing sleeps for a guessed time.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
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

class RedisCluster {
 public:
  struct Options {
    int primaries = 3;
    int replicas = 1;       // per primary
    bool cluster = true;    // false: one standalone node (primaries, replicas ignored)
    int maxmemory_mib = 0;  // 0: unbounded
    // How long a node may go unanswered before the others hold it to have
    // failed and its replica takes over. Long (Redis's default) unless a
    // test kills a node: on a loaded machine a node stalls for a second
    // now and then, and a failover nobody asked for loses the writes its
    // replica had not yet taken.
    int node_timeout_ms = 15000;
  };

  // Starts the nodes under `dir` (python3 -m kdn_launch.redis_cluster) and
  // waits until the cluster says cluster_state:ok on every node and every
  // replica is in sync. Fails the test (and returns null) when it cannot.
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
    std::vector<std::string> args = {"python3",
                                     "-m",
                                     "kdn_launch.redis_cluster",
                                     c->dir_.string(),
                                     "--maxmemory-mib",
                                     std::to_string(o.maxmemory_mib),
                                     "--node-timeout-ms",
                                     std::to_string(o.node_timeout_ms)};
    if (o.cluster) {
      args.insert(args.end(), {"--primaries", std::to_string(o.primaries), "--replicas",
                               std::to_string(o.replicas)});
    } else {
      args.push_back("--standalone");
    }
    if (!c->Launch(args)) return nullptr;
    const size_t n = o.cluster ? static_cast<size_t>(o.primaries * (1 + o.replicas)) : 1;
    // Its URL, then "host:port pid" per node.
    const std::string url = c->ReadLine();
    const size_t at = url.find('@');
    if (url.rfind("redis://:", 0) != 0 || at == std::string::npos) {
      ADD_FAILURE() << "kdn_launch.redis_cluster did not start Redis (its stderr is above): "
                    << url;
      return nullptr;
    }
    c->password_ = url.substr(9, at - 9);
    for (size_t i = 0; i < n; ++i) {
      std::istringstream line(c->ReadLine());
      std::string address;
      pid_t pid = -1;
      line >> address >> pid;
      const size_t colon = address.rfind(':');
      if (colon == std::string::npos || pid <= 0) {
        ADD_FAILURE() << "kdn_launch.redis_cluster: no line for node " << i;
        return nullptr;
      }
      c->ports_.push_back(std::atoi(address.c_str() + colon + 1));
      c->pids_.push_back(pid);
    }
    if (o.cluster && !c->WaitHealthy(std::chrono::seconds(30))) {
      ADD_FAILURE() << "the cluster did not come up:\n" << c->Events();
      return nullptr;
    }
    return c;
  }

  // Closing its stdin stops kdn_launch.redis_cluster, which stops the nodes.
  ~RedisCluster() {
    if (launcher_out_ != nullptr) fclose(launcher_out_);
    if (launcher_in_ >= 0) close(launcher_in_);
    if (launcher_ > 0) waitpid(launcher_, nullptr, 0);
    if (own_dir_) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }
  RedisCluster(const RedisCluster&) = delete;
  RedisCluster& operator=(const RedisCluster&) = delete;

  // redis://:password@127.0.0.1:p1,... with every node as a seed.
  std::string url() const {
    std::string u = "redis://:" + password_ + "@";
    for (size_t i = 0; i < ports_.size(); ++i) {
      u += (i > 0 ? ",127.0.0.1:" : "127.0.0.1:") + std::to_string(ports_[i]);
    }
    return u;
  }
  // The password kdn_launch.redis_cluster made (in url() too).
  const std::string& password() const { return password_; }
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
    return Shell("redis-cli --no-auth-warning -a " + password_ + " -p " +
                 std::to_string(ports_[i]) + " " + args);
  }
  // The node's id in the cluster.
  std::string Id(size_t i) const {
    std::string s = Cli(i, "cluster myid");
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    return s;
  }
  bool IsPrimary(size_t i) const { return Cli(i, "role").find("master") == 0; }

  // SET `key` to `bytes` on node i, any bytes (redis-cli -x); its answer.
  std::string SetBytes(size_t i, const std::string& key, const std::vector<uint8_t>& bytes) const {
    std::string format;
    char octal[8];
    for (uint8_t b : bytes) {
      std::snprintf(octal, sizeof(octal), "\\%03o", b);
      format += octal;
    }
    return Shell("printf '" + format + "' | redis-cli --no-auth-warning -a " + password_ + " -p " +
                 std::to_string(ports_[i]) + " -x set " + key);
  }

  // Kills node i (SIGKILL) and waits until it is gone: a zombie of the
  // launcher, which reaps it when it stops.
  void Kill(size_t i) {
    if (pids_[i] <= 0) return;
    kill(pids_[i], SIGKILL);
    const std::string stat = "/proc/" + std::to_string(pids_[i]) + "/stat";
    const bool gone = WaitUntil(
        [&] {
          std::ifstream in(stat);
          std::string pid, comm, state;
          return !(in >> pid >> comm >> state) || state == "Z" || state == "X";
        },
        std::chrono::seconds(10));
    EXPECT_TRUE(gone) << "redis node " << pids_[i] << " still runs after SIGKILL";
    pids_[i] = -1;
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
          const std::string out = Shell("redis-cli --no-auth-warning -a " + password_ +
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
    for (size_t i = 0; i < ports_.size(); ++i) {
      const auto log = dir_ / "redis" / ("redis-" + std::to_string(i)) / "redis.log";
      out += Shell("grep -iE 'FAIL|failover|epoch|slot' " + log.string() + " | sed 's/^/" +
                   std::to_string(ports_[i]) + " /'");
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

  // Starts `args` (kdn_launch.redis_cluster) with pipes to its stdin and
  // stdout; its stderr is the test's.
  bool Launch(const std::vector<std::string>& args) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) {
      ADD_FAILURE() << "pipe: " << std::strerror(errno);
      return false;
    }
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      setenv("PYTHONPATH", KDN_LAUNCH_DIR, 1);
      std::vector<char*> argv;
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    if (pid < 0) {
      close(in[1]);
      close(out[0]);
      ADD_FAILURE() << "fork: " << std::strerror(errno);
      return false;
    }
    launcher_ = pid;
    launcher_in_ = in[1];
    launcher_out_ = fdopen(out[0], "r");
    return launcher_out_ != nullptr;
  }

  // The launcher's next stdout line, "" once it has exited.
  std::string ReadLine() {
    char buf[4096];
    if (launcher_out_ == nullptr || fgets(buf, sizeof(buf), launcher_out_) == nullptr) return "";
    std::string line(buf);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    return line;
  }

  std::filesystem::path dir_;
  bool own_dir_ = false;  // dir_ is in /dev/shm, removed with the nodes
  Options o_;
  std::string password_;  // the launcher's, from its URL
  std::vector<int> ports_;
  std::vector<pid_t> pids_;
  pid_t launcher_ = -1;
  int launcher_in_ = -1;
  FILE* launcher_out_ = nullptr;
};

}  // namespace kdn::kvbus::testing
