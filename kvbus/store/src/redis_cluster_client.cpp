// The Redis Cluster client (redis_cluster_client.h), and the Redis URL and
// slot functions of kdn/kvbus/redis_store.h.
#include "redis_cluster_client.h"

#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <cstring>
#include <fstream>
#include <map>
#include <tuple>

namespace kdn::kvbus {

namespace {

// Hash slots of Redis Cluster.
constexpr size_t kSlotCount = 16384;
// Redirections (MOVED, ASK) one command follows before it is a miss.
constexpr int kMaxRedirects = 4;
// Idle connections kept per node: about one per thread that calls at once.
constexpr size_t kMaxIdlePerNode = 8;
// The slot map is reread at most this often while nodes fail, and a reread
// gives up after this many nodes fail to answer it.
constexpr auto kMinRefreshInterval = std::chrono::milliseconds(100);
constexpr int kMaxRefreshFailures = 2;

timeval TimeVal(std::chrono::milliseconds ms) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

std::string Addr(const std::string& host, int port) { return host + ":" + std::to_string(port); }

void AppendBulk(std::string& out, std::string_view arg) {
  out += '$';
  out += std::to_string(arg.size());
  out += "\r\n";
  out += arg;
  out += "\r\n";
}

}  // namespace

RedisCommand RedisSimple(std::initializer_list<std::string_view> args, std::string key) {
  RedisCommand c;
  c.key = std::move(key);
  c.head = "*" + std::to_string(args.size()) + "\r\n";
  for (std::string_view a : args) AppendBulk(c.head, a);
  return c;
}

RedisCommand RedisSetNx(const std::string& key, std::span<const uint8_t> value,
                        std::chrono::milliseconds ttl) {
  RedisCommand c;
  c.key = key;
  c.head = ttl.count() > 0 ? "*6\r\n" : "*4\r\n";
  AppendBulk(c.head, "SET");
  AppendBulk(c.head, key);
  c.head += "$" + std::to_string(value.size()) + "\r\n";
  c.big = value;
  c.tail = "\r\n";
  AppendBulk(c.tail, "NX");
  if (ttl.count() > 0) {
    AppendBulk(c.tail, "PX");
    AppendBulk(c.tail, std::to_string(ttl.count()));
  }
  return c;
}

namespace {

constexpr std::string_view kAsking = "*1\r\n$6\r\nASKING\r\n";

// Writes every command to the connection's socket, in order, gathered
// (SO_SNDTIMEO, set with the context's timeout, bounds each wait). A failed
// write marks the context failed, so that it is never pooled again.
Status WriteAll(redisContext* c, const std::vector<const RedisCommand*>& cmds) {
  std::vector<iovec> iov;
  for (const RedisCommand* cmd : cmds) {
    if (cmd->asking) iov.push_back({const_cast<char*>(kAsking.data()), kAsking.size()});
    iov.push_back({const_cast<char*>(cmd->head.data()), cmd->head.size()});
    if (!cmd->big.empty()) {
      iov.push_back({const_cast<uint8_t*>(cmd->big.data()), cmd->big.size()});
    }
    if (!cmd->tail.empty()) iov.push_back({const_cast<char*>(cmd->tail.data()), cmd->tail.size()});
  }
  size_t at = 0;
  while (at < iov.size()) {
    const int n = static_cast<int>(std::min<size_t>(iov.size() - at, IOV_MAX));
    // sendmsg, not writev: MSG_NOSIGNAL, so that a connection the node has
    // closed is an EPIPE here (a miss), not a SIGPIPE that ends the process.
    msghdr msg{};
    msg.msg_iov = iov.data() + at;
    msg.msg_iovlen = static_cast<size_t>(n);
    const ssize_t w = ::sendmsg(c->fd, &msg, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      c->err = REDIS_ERR_IO;
      return Unavailable(errno == EAGAIN || errno == EWOULDBLOCK ? "write timed out"
                                                                 : std::strerror(errno));
    }
    size_t left = static_cast<size_t>(w);
    while (at < iov.size() && left >= iov[at].iov_len) left -= iov[at++].iov_len;
    if (left > 0) {
      iov[at].iov_base = static_cast<char*>(iov[at].iov_base) + left;
      iov[at].iov_len -= left;
    }
  }
  return Status::Ok();
}

Result<RedisReply> ReadReply(redisContext* c) {
  void* r = nullptr;
  if (redisGetReply(c, &r) != REDIS_OK || r == nullptr) {
    return Unavailable(c->err != 0 ? std::string(c->errstr) : "no reply");
  }
  return RedisReply(static_cast<redisReply*>(r));
}

std::string_view ErrorText(const redisReply& r) { return {r.str, r.len}; }

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// A whole decimal number in [1, 65535].
bool ParsePort(std::string_view p, int* port) {
  const auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), *port);
  return ec == std::errc{} && end == p.data() + p.size() && *port > 0 && *port <= 65535;
}

// "MOVED 3999 127.0.0.1:6381" / "ASK ...": the node named, as host, port
// (an empty host, ":6381", is the one the command went to: `asked`).
bool ParseRedirect(std::string_view err, const std::string& asked, std::string* host, int* port) {
  const size_t sp = err.rfind(' ');
  const size_t colon = err.rfind(':');
  if (sp == std::string_view::npos || colon == std::string_view::npos || colon < sp) return false;
  *host = std::string(err.substr(sp + 1, colon - sp - 1));
  if (host->empty() || *host == "?") *host = asked;
  return ParsePort(err.substr(colon + 1), port);
}

// Errors that mean "not now" (a failover, a resharding, a node loading its
// data): the command is a miss and the slot map is reread.
bool TransientError(std::string_view err) {
  return StartsWith(err, "TRYAGAIN") || StartsWith(err, "CLUSTERDOWN") ||
         StartsWith(err, "LOADING") || StartsWith(err, "MASTERDOWN") || StartsWith(err, "READONLY");
}

bool IsAuthError(std::string_view err) {
  return StartsWith(err, "WRONGPASS") || StartsWith(err, "NOAUTH") ||
         StartsWith(err, "ERR invalid password") || StartsWith(err, "NOPERM") ||
         err.find("AUTH") != std::string_view::npos;
}

}  // namespace

std::string RedisUrl::Redacted() const {
  std::string out = "redis://";
  if (!user.empty() || !password.empty()) out += user + (password.empty() ? "@" : ":***@");
  for (size_t i = 0; i < seeds.size(); ++i) {
    if (i > 0) out += ',';
    out += Addr(seeds[i].first, seeds[i].second);
  }
  return out;
}

Result<RedisUrl> ParseRedisUrl(std::string_view url) {
  auto bad = [&](const std::string& why) {
    // The URL as given, but never its credentials.
    std::string shown(url);
    const size_t scheme = shown.find("://"), at = shown.rfind('@');
    if (at != std::string::npos) {
      const size_t from = scheme == std::string::npos ? 0 : scheme + 3;
      if (at >= from) shown.replace(from, at - from, "***");
    }
    return InvalidArgument("redis URL '" + shown + "' " + why +
                           " (expected redis://[user:password@]host:port[,host:port...])");
  };
  constexpr std::string_view kScheme = "redis://";
  if (!StartsWith(url, kScheme)) return bad("does not start with redis://");
  std::string_view rest = url.substr(kScheme.size());
  RedisUrl out;
  if (const size_t at = rest.rfind('@'); at != std::string_view::npos) {
    const std::string_view cred = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const size_t colon = cred.find(':');
    if (colon == std::string_view::npos) {
      out.user = std::string(cred);
    } else {
      out.user = std::string(cred.substr(0, colon));
      out.password = std::string(cred.substr(colon + 1));
    }
  }
  if (const size_t slash = rest.find('/'); slash != std::string_view::npos) {
    if (rest.substr(slash) != "/" && rest.substr(slash) != "/0") {
      return bad("names a database; Redis Cluster has only database 0");
    }
    rest = rest.substr(0, slash);
  }
  if (rest.empty()) return bad("names no host");
  size_t start = 0;
  while (start <= rest.size()) {
    const size_t comma = std::min(rest.find(',', start), rest.size());
    const std::string_view node = rest.substr(start, comma - start);
    if (node.empty()) return bad("has an empty host in its list");
    std::string host(node);
    int port = 6379;
    if (const size_t colon = node.rfind(':'); colon != std::string_view::npos) {
      host = std::string(node.substr(0, colon));
      if (!ParsePort(node.substr(colon + 1), &port)) {
        return bad("has a port that is not a number from 1 to 65535");
      }
    }
    if (host.empty() || host.find_first_of("{}@ ") != std::string::npos) {
      return bad("has a host that is not a name or address");
    }
    out.seeds.emplace_back(std::move(host), port);
    start = comma + 1;
  }
  return out;
}

Result<std::string> RedisUrlWithPassword(std::string_view url, std::string_view password) {
  KDN_ASSIGN_OR_RETURN(RedisUrl u, ParseRedisUrl(url));
  if (!u.password.empty()) {
    return InvalidArgument("redis URL " + u.Redacted() +
                           " has a password already: give it in the URL or in the file, not both");
  }
  if (password.empty()) return InvalidArgument("redis: the password given is empty");
  std::string out = "redis://" + u.user + ":" + std::string(password) + "@";
  for (size_t i = 0; i < u.seeds.size(); ++i) {
    out += (i > 0 ? "," : "") + Addr(u.seeds[i].first, u.seeds[i].second);
  }
  return out;
}

Result<std::string> ReadPasswordFile(const std::string& path) {
  std::ifstream in(path);
  std::string password;
  if (!in || !std::getline(in, password)) {
    return InvalidArgument("redis password file " + path + ": cannot read a line from it");
  }
  while (!password.empty() && (password.back() == '\r' || password.back() == ' ')) {
    password.pop_back();
  }
  if (password.empty())
    return InvalidArgument("redis password file " + path + ": its line is empty");
  return password;
}

Result<std::string> RedisUrlWithPasswordFile(std::string_view url, const std::string& path) {
  KDN_ASSIGN_OR_RETURN(std::string password, ReadPasswordFile(path));
  return RedisUrlWithPassword(url, password);
}

uint16_t RedisSlot(std::string_view key) {
  // A {hash tag}: only what is between the first { and the next } counts,
  // if that is not empty.
  if (const size_t open = key.find('{'); open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) {
      key = key.substr(open + 1, close - open - 1);
    }
  }
  uint16_t crc = 0;  // CRC16/XMODEM: polynomial 0x1021, initial 0
  for (unsigned char ch : key) {
    crc ^= static_cast<uint16_t>(ch) << 8;
    for (int b = 0; b < 8; ++b) {
      crc = (crc & 0x8000) != 0 ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                                : static_cast<uint16_t>(crc << 1);
    }
  }
  return static_cast<uint16_t>(crc % kSlotCount);
}

uint16_t RedisClusterClient::NodeFor(const std::string& host, int port) {
  const std::string addr = Addr(host, port);
  auto it = node_index_.find(addr);
  if (it != node_index_.end()) return it->second;
  auto n = std::make_unique<Node>();
  n->host = host;
  n->port = port;
  nodes_.push_back(std::move(n));
  const auto idx = static_cast<uint16_t>(nodes_.size() - 1);
  node_index_.emplace(addr, idx);
  return idx;
}

// A new connection to host:port (given `connect` to connect),
// authenticated when the URL has a password.
Result<RedisClusterClient::ContextPtr> RedisClusterClient::Dial(const std::string& host, int port,
                                                                std::chrono::milliseconds connect) {
  ContextPtr c(redisConnectWithTimeout(host.c_str(), port, TimeVal(connect)));
  if (c == nullptr) return ResourceExhausted("redis: out of memory connecting");
  if (c->err != 0) return Unavailable("redis " + Addr(host, port) + ": " + c->errstr);
  if (redisSetTimeout(c.get(), TimeVal(options_.timeout)) != REDIS_OK) {
    return Unavailable("redis " + Addr(host, port) + ": cannot set a timeout");
  }
  if (!url_.password.empty()) {
    RedisCommand auth = url_.user.empty() ? RedisSimple({"AUTH", url_.password}, "")
                                          : RedisSimple({"AUTH", url_.user, url_.password}, "");
    KDN_RETURN_IF_ERROR(WriteAll(c.get(), {&auth}));
    KDN_ASSIGN_OR_RETURN(RedisReply r, ReadReply(c.get()));
    if (r->type == REDIS_REPLY_ERROR) {
      return InvalidArgument("redis " + Addr(host, port) +
                             " refuses the URL's credentials: " + std::string(ErrorText(*r)));
    }
  }
  return c;
}

// A connection to node `n` for one call: an idle one, or a new one (which
// may take `timeout` to connect). A node held to be down is UNAVAILABLE at
// once.
Result<RedisClusterClient::ContextPtr> RedisClusterClient::Take(uint16_t n,
                                                                std::chrono::milliseconds timeout) {
  std::string host;
  int port = 0;
  {
    MutexLock lock(mu_);
    Node& node = *nodes_[n];
    if (Clock::now() < node.down_until) {
      return Unavailable("redis " + Addr(node.host, node.port) + " is held to be down");
    }
    if (!node.idle.empty()) {
      ContextPtr c = std::move(node.idle.back());
      node.idle.pop_back();
      return c;
    }
    host = node.host;
    port = node.port;
  }
  auto c = Dial(host, port, std::min(options_.connect_timeout, timeout));
  if (!c.ok()) MarkDown(n);
  return c;
}

void RedisClusterClient::Give(uint16_t n, ContextPtr c) {
  if (c == nullptr || c->err != 0) return;
  MutexLock lock(mu_);
  Node& node = *nodes_[n];
  if (node.idle.size() < kMaxIdlePerNode) node.idle.push_back(std::move(c));
}

void RedisClusterClient::MarkDown(uint16_t n) {
  MutexLock lock(mu_);
  Node& node = *nodes_[n];
  node.down_until = Clock::now() + options_.backoff;
  node.idle.clear();  // they went to the same dead process
}

// Reads CLUSTER SLOTS through `c` (from host). True with the map replaced;
// false, with `standalone` set when the node is not in cluster mode.
Result<bool> RedisClusterClient::LoadSlots(redisContext* c, const std::string& host,
                                           bool* standalone) {
  RedisCommand cmd = RedisSimple({"CLUSTER", "SLOTS"}, "");
  KDN_RETURN_IF_ERROR(WriteAll(c, {&cmd}));
  KDN_ASSIGN_OR_RETURN(RedisReply r, ReadReply(c));
  if (r->type == REDIS_REPLY_ERROR) {
    const std::string_view err = ErrorText(*r);
    if (err.find("cluster support disabled") != std::string_view::npos) {
      *standalone = true;
      return false;
    }
    if (IsAuthError(err)) {
      return InvalidArgument("redis " + host +
                             " asks for a password the URL does not give: " + std::string(err));
    }
    return Unavailable("redis CLUSTER SLOTS: " + std::string(err));
  }
  if (r->type != REDIS_REPLY_ARRAY) return Unavailable("redis CLUSTER SLOTS: not an array");
  std::vector<std::tuple<long long, long long, std::string, int>> ranges;
  for (size_t i = 0; i < r->elements; ++i) {
    const redisReply* e = r->element[i];
    if (e->type != REDIS_REPLY_ARRAY || e->elements < 3) continue;
    const redisReply* primary = e->element[2];
    if (e->element[0]->type != REDIS_REPLY_INTEGER || e->element[1]->type != REDIS_REPLY_INTEGER ||
        primary->type != REDIS_REPLY_ARRAY || primary->elements < 2 ||
        primary->element[0]->type != REDIS_REPLY_STRING ||
        primary->element[1]->type != REDIS_REPLY_INTEGER) {
      continue;
    }
    std::string ip(primary->element[0]->str, primary->element[0]->len);
    // An empty or "?" endpoint means "the address you reached me at".
    if (ip.empty() || ip == "?") ip = host;
    ranges.emplace_back(e->element[0]->integer, e->element[1]->integer, std::move(ip),
                        static_cast<int>(primary->element[1]->integer));
  }
  MutexLock lock(mu_);
  std::vector<uint16_t> map(kSlots, kNoNode);
  for (const auto& [lo, hi, ip, port] : ranges) {
    const uint16_t n = NodeFor(ip, port);
    for (long long s = std::max(0LL, lo); s <= std::min<long long>(hi, kSlots - 1); ++s) {
      map[static_cast<size_t>(s)] = n;
    }
  }
  slots_ = std::move(map);
  last_refresh_ = Clock::now();
  return true;
}

// Rereads the slot map from the first node that answers (rate-limited;
// one thread at a time), after a MOVED or a failing node: through an idle
// connection of a node not held to be down if there is one, else a new
// one, else a seed not in the map. It runs on a caller's thread (a
// worker's control thread, for lookups), so each try gets the lookup
// timeout and at most kMaxRefreshFailures tries fail.
void RedisClusterClient::Refresh() {
  if (!cluster_) return;
  std::vector<uint16_t> live;
  std::vector<std::pair<std::string, int>> seeds;
  {
    MutexLock lock(mu_);
    const Clock::time_point now = Clock::now();
    if (refreshing_ || now - last_refresh_ < kMinRefreshInterval) return;
    refreshing_ = true;
    last_refresh_ = now;
    // The nodes the map names first (a node that left the cluster long
    // ago is in `nodes` still, and never answers), then the others.
    std::vector<bool> mapped(nodes_.size(), false);
    for (uint16_t n : slots_) {
      if (n != kNoNode) mapped[n] = true;
    }
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t i = 0; i < nodes_.size(); ++i) {
        if (mapped[i] == (pass == 0) && now >= nodes_[i]->down_until) {
          live.push_back(static_cast<uint16_t>(i));
        }
      }
    }
    for (const auto& seed : url_.seeds) {
      if (!node_index_.contains(Addr(seed.first, seed.second))) seeds.push_back(seed);
    }
  }
  int failures = 0;
  bool done = false;
  // Rereads the map through `c`; false when it could not (the connection
  // is then not fit to pool).
  auto load = [&](redisContext* c, const std::string& host) {
    redisSetTimeout(c, TimeVal(options_.refresh_timeout));
    bool standalone = false;
    auto loaded = LoadSlots(c, host, &standalone);
    done = loaded.ok() && *loaded;
    if (!done) ++failures;
    return loaded.ok();
  };
  for (uint16_t n : live) {
    if (done || failures >= kMaxRefreshFailures) break;
    auto c = Take(n, options_.refresh_timeout);
    if (!c.ok()) {
      ++failures;
      continue;
    }
    std::string host;
    {
      MutexLock lock(mu_);
      host = nodes_[n]->host;
    }
    if (load(c->get(), host)) Give(n, std::move(c).value());
  }
  for (const auto& [host, port] : seeds) {
    if (done || failures >= kMaxRefreshFailures) break;
    auto c = Dial(host, port, std::min(options_.connect_timeout, options_.refresh_timeout));
    if (!c.ok()) {
      ++failures;
      continue;
    }
    load(c->get(), host);
  }
  MutexLock lock(mu_);
  refreshing_ = false;
}

// Runs `cmds`, each on the node its key's slot maps to: every node's
// commands are written before any reply is read. Follows MOVED (and
// rereads the map) and ASK. A command whose node cannot be reached, that
// times out, or that meets a cluster in transition is UNAVAILABLE.
std::vector<RedisClusterClient::Outcome> RedisClusterClient::Run(
    std::vector<RedisCommand>& cmds, std::chrono::milliseconds timeout) {
  std::vector<Outcome> out;
  out.reserve(cmds.size());
  for (size_t i = 0; i < cmds.size(); ++i) out.emplace_back(Unavailable("redis: not run"));
  std::vector<uint16_t> ask_node(cmds.size(), kNoNode);
  std::vector<size_t> pending(cmds.size());
  for (size_t i = 0; i < cmds.size(); ++i) pending[i] = i;
  bool refresh = false;
  for (int round = 0; round <= kMaxRedirects && !pending.empty(); ++round) {
    std::map<uint16_t, std::vector<size_t>> groups;
    {
      MutexLock lock(mu_);
      for (size_t i : pending) {
        const uint16_t n = cmds[i].asking ? ask_node[i] : slots_[RedisSlot(cmds[i].key)];
        if (n == kNoNode) {
          out[i] = Unavailable("redis: no node serves the slot of " + cmds[i].key);
          refresh = true;
          continue;
        }
        groups[n].push_back(i);
      }
    }
    pending.clear();
    struct Open {
      uint16_t node;
      ContextPtr c;
      const std::vector<size_t>* idx;
      std::string host;  // the node's
      int port = 0;
    };
    std::vector<Open> open;
    for (auto& [n, idx] : groups) {
      auto c = Take(n, timeout);
      if (c.ok()) {
        redisSetTimeout(c->get(), TimeVal(timeout));
        std::vector<const RedisCommand*> batch;
        for (size_t i : idx) batch.push_back(&cmds[i]);
        Status st = WriteAll(c->get(), batch);
        if (st.ok()) {
          MutexLock lock(mu_);
          open.push_back({n, std::move(c).value(), &idx, nodes_[n]->host, nodes_[n]->port});
          continue;
        }
        MarkDown(n);
        c = st;
      }
      for (size_t i : idx) out[i] = c.status();
      refresh = true;
    }
    for (Open& o : open) {
      for (size_t k = 0; k < o.idx->size(); ++k) {
        const size_t i = (*o.idx)[k];
        Outcome r = Unavailable("redis: no reply");
        if (cmds[i].asking) r = ReadReply(o.c.get());  // ASKING's +OK
        if (!cmds[i].asking || r.ok()) r = ReadReply(o.c.get());
        if (!r.ok()) {
          // The connection is gone: so is every reply still owed on it.
          for (size_t j = k; j < o.idx->size(); ++j) out[(*o.idx)[j]] = r.status();
          MarkDown(o.node);
          refresh = true;
          break;
        }
        cmds[i].asking = false;
        const redisReply& reply = **r;
        if (reply.type == REDIS_REPLY_ERROR) {
          const std::string_view err = ErrorText(reply);
          std::string host;
          int port = 0;
          if ((StartsWith(err, "MOVED ") || StartsWith(err, "ASK ")) &&
              ParseRedirect(err, o.host, &host, &port)) {
            MutexLock lock(mu_);
            const uint16_t to = NodeFor(host, port);
            if (StartsWith(err, "MOVED ")) {
              slots_[RedisSlot(cmds[i].key)] = to;
              refresh = true;
            } else {
              ask_node[i] = to;
              cmds[i].asking = true;
            }
            pending.push_back(i);
            out[i] = Unavailable("redis: redirected too often: " + std::string(err));
            continue;
          }
          if (TransientError(err)) {
            refresh = true;
            out[i] = Unavailable("redis: " + std::string(err));
            continue;
          }
          // Not a cluster in transition: a refusal (OOM under noeviction,
          // NOPERM for the ACL user, MISCONF, ...) that will not pass by
          // itself. A miss too, but said in the log.
          limiter_.Warn("redis: {} refused {}: {}", Addr(o.host, o.port), cmds[i].key, err);
          out[i] = Internal("redis: " + std::string(err));
          continue;
        }
        out[i] = std::move(r);
      }
      Give(o.node, std::move(o.c));
    }
  }
  if (refresh) Refresh();
  return out;
}

Result<std::unique_ptr<RedisClusterClient>> RedisClusterClient::Connect(
    const RedisUrl& url, RedisClusterOptions options) {
  std::unique_ptr<RedisClusterClient> client(new RedisClusterClient(url, options));
  std::string tried;
  for (const auto& [host, port] : url.seeds) {
    auto c = client->Dial(host, port, options.connect_timeout);
    if (!c.ok()) {
      if (c.status().code() == StatusCode::kInvalidArgument) return c.status();
      tried += (tried.empty() ? "" : "; ") + c.status().message();
      continue;
    }
    bool standalone = false;
    auto loaded = client->LoadSlots(c->get(), host, &standalone);
    if (!loaded.ok()) {
      if (loaded.status().code() == StatusCode::kInvalidArgument) return loaded.status();
      tried += (tried.empty() ? "" : "; ") + loaded.status().message();
      continue;
    }
    if (standalone) {
      client->cluster_ = false;
      MutexLock lock(client->mu_);
      const uint16_t n = client->NodeFor(host, port);
      std::fill(client->slots_.begin(), client->slots_.end(), n);
    }
    if (client->clustered()) {
      LogInfo("redis: a cluster of {} primaries, reached through {}", client->primaries(),
              Addr(host, port));
    } else {
      LogInfo("redis: {} is not in cluster mode: it is the KDN's one shard", Addr(host, port));
    }
    return client;
  }
  return Unavailable("redis: no seed of " + url.Redacted() + " answers: " + tried);
}

std::string RedisClusterClient::NodeOf(std::string_view key) {
  MutexLock lock(mu_);
  const uint16_t n = slots_[RedisSlot(key)];
  if (n == kNoNode) return "";
  return Addr(nodes_[n]->host, nodes_[n]->port);
}

size_t RedisClusterClient::primaries() {
  MutexLock lock(mu_);
  std::vector<uint16_t> seen(slots_);
  std::sort(seen.begin(), seen.end());
  seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
  return static_cast<size_t>(
      std::count_if(seen.begin(), seen.end(), [](uint16_t n) { return n != kNoNode; }));
}

}  // namespace kdn::kvbus
