// The host backend's link (host_link.h).

#include "host_link.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <map>
#include <mutex>
#include <random>

namespace kdn::kvbus {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kTokenBytes = 16;
constexpr std::string_view kPrefix = "host-link:";

std::string Hex(const uint8_t* p, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += kDigits[p[i] >> 4];
    s += kDigits[p[i] & 15];
  }
  return s;
}

Status Errno(const std::string& what) {
  return Unavailable("kvbus host link: " + what + ": " + std::strerror(errno));
}

// Listeners made by NewHostLinkId and not yet joined, by id.
struct Pending {
  std::mutex mu;
  std::map<std::string, int> fds;
};
Pending& PendingLinks() {
  static Pending* p = new Pending;  // never destroyed: links may outlive statics
  return *p;
}

struct ParsedId {
  int port = 0;
  std::string token;
};

Result<ParsedId> ParseId(const std::string& id) {
  const auto bad = [&] { return InvalidArgument("kvbus host link: malformed link id"); };
  if (id.rfind(kPrefix, 0) != 0) return bad();
  const std::string_view rest = std::string_view(id).substr(kPrefix.size());
  const size_t colon = rest.find(':');
  if (colon == std::string_view::npos) return bad();
  ParsedId p;
  const auto [end, ec] = std::from_chars(rest.data(), rest.data() + colon, p.port);
  if (ec != std::errc{} || end != rest.data() + colon || p.port <= 0 || p.port > 65535) {
    return bad();
  }
  p.token = std::string(rest.substr(colon + 1));
  if (p.token.size() != 2 * kTokenBytes ||
      p.token.find_first_not_of("0123456789abcdef") != std::string::npos) {
    return bad();
  }
  return p;
}

// Waits until `fd` is ready for `events` or `deadline` passes.
Status WaitReady(int fd, short events, Clock::time_point deadline, const char* what) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      return Status(StatusCode::kDeadlineExceeded,
                    std::string("kvbus host link: the peer did not ") + what + " in time");
    }
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (n > 0) return Status::Ok();
    if (n < 0 && errno != EINTR) return Errno("poll");
  }
}

class HostLink final : public DeviceLink {
 public:
  HostLink(int fd, int listener, std::string token, int rank, std::chrono::milliseconds timeout)
      : fd_(fd), listener_(listener), token_(std::move(token)), rank_(rank), timeout_(timeout) {}
  ~HostLink() override { Abort(); }

  Status Send(const uint8_t* base, std::span<const Extent> extents) override {
    if (rank_ != 0) return FailedPrecondition("kvbus host link: rank 1 receives, it does not send");
    KDN_RETURN_IF_ERROR(Usable());
    const Clock::time_point deadline = Clock::now() + timeout_;
    Status st = Accept(deadline);
    uint64_t total = 0;
    for (const Extent& x : extents) total += x.bytes;
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(total >> (8 * i));
    if (st.ok()) st = Write(len, sizeof(len), deadline);
    for (size_t i = 0; st.ok() && i < extents.size(); ++i) {
      st = Write(base + extents[i].offset, extents[i].bytes, deadline);
    }
    return Settle(std::move(st));
  }

  Status Recv(uint8_t* base, std::span<const Extent> extents) override {
    if (rank_ != 1) return FailedPrecondition("kvbus host link: rank 0 sends, it does not receive");
    KDN_RETURN_IF_ERROR(Usable());
    const Clock::time_point deadline = Clock::now() + timeout_;
    uint64_t total = 0;
    for (const Extent& x : extents) total += x.bytes;
    uint8_t len[8];
    Status st = Read(len, sizeof(len), deadline);
    uint64_t sent = 0;
    for (int i = 0; i < 8; ++i) sent |= uint64_t{len[i]} << (8 * i);
    if (st.ok() && sent != total) {
      st = InvalidArgument("kvbus host link: a message of " + std::to_string(sent) +
                           " bytes for extents of " + std::to_string(total));
    }
    for (size_t i = 0; st.ok() && i < extents.size(); ++i) {
      st = Read(base + extents[i].offset, extents[i].bytes, deadline);
    }
    return Settle(std::move(st));
  }

  void Abort() override {
    if (fd_ >= 0) close(fd_);
    if (listener_ >= 0) close(listener_);
    fd_ = listener_ = -1;
    aborted_ = true;
  }
  bool aborted() const override { return aborted_; }

 private:
  Status Usable() const {
    return aborted_ ? FailedPrecondition("kvbus host link: aborted") : Status::Ok();
  }
  Status Settle(Status st) {
    if (!st.ok()) Abort();
    return st;
  }

  // Rank 0's first Send: the peer's connection, which must bring the token.
  Status Accept(Clock::time_point deadline) {
    if (fd_ >= 0) return Status::Ok();
    KDN_RETURN_IF_ERROR(WaitReady(listener_, POLLIN, deadline, "join"));
    fd_ = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd_ < 0) return Errno("accept");
    close(listener_);
    listener_ = -1;
    const int one = 1;
    setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    std::string got(token_.size(), '\0');
    KDN_RETURN_IF_ERROR(Read(reinterpret_cast<uint8_t*>(got.data()), got.size(), deadline));
    if (got != token_) {
      return FailedPrecondition("kvbus host link: the peer's token is not the id's");
    }
    return Status::Ok();
  }

  Status Write(const uint8_t* p, uint64_t n, Clock::time_point deadline) {
    while (n > 0) {
      const ssize_t w = send(fd_, p, n, MSG_NOSIGNAL);
      if (w > 0) {
        p += w;
        n -= static_cast<uint64_t>(w);
      } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
        KDN_RETURN_IF_ERROR(WaitReady(fd_, POLLOUT, deadline, "take the bytes"));
      } else {
        return Errno("send");
      }
    }
    return Status::Ok();
  }

  Status Read(uint8_t* p, uint64_t n, Clock::time_point deadline) {
    while (n > 0) {
      const ssize_t r = recv(fd_, p, n, 0);
      if (r > 0) {
        p += r;
        n -= static_cast<uint64_t>(r);
      } else if (r == 0) {
        return Unavailable("kvbus host link: the peer closed the link");
      } else if (errno == EAGAIN || errno == EINTR) {
        KDN_RETURN_IF_ERROR(WaitReady(fd_, POLLIN, deadline, "send the bytes"));
      } else {
        return Errno("recv");
      }
    }
    return Status::Ok();
  }

  int fd_;
  int listener_;
  const std::string token_;
  const int rank_;
  const std::chrono::milliseconds timeout_;
  bool aborted_ = false;
};

}  // namespace

Result<std::string> NewHostLinkId() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Errno("socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 1) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    Status st = Errno("listen");
    close(fd);
    return st;
  }
  uint8_t token[kTokenBytes];
  std::random_device rd;
  for (uint8_t& b : token) b = static_cast<uint8_t>(rd());
  std::string id =
      std::string(kPrefix) + std::to_string(ntohs(a.sin_port)) + ":" + Hex(token, kTokenBytes);
  Pending& p = PendingLinks();
  std::lock_guard<std::mutex> lock(p.mu);
  p.fds[id] = fd;
  return id;
}

Result<std::unique_ptr<DeviceLink>> JoinHostLink(const std::string& id, int rank,
                                                 std::chrono::milliseconds timeout) {
  KDN_ASSIGN_OR_RETURN(ParsedId parsed, ParseId(id));
  if (timeout.count() <= 0) return InvalidArgument("kvbus host link: the timeout must be > 0");
  if (rank == 0) {
    Pending& p = PendingLinks();
    std::lock_guard<std::mutex> lock(p.mu);
    const auto it = p.fds.find(id);
    if (it == p.fds.end()) {
      return InvalidArgument("kvbus host link: rank 0 of a link this process did not make");
    }
    const int listener = it->second;
    p.fds.erase(it);
    return std::unique_ptr<DeviceLink>(
        std::make_unique<HostLink>(-1, listener, parsed.token, 0, timeout));
  }
  if (rank != 1) return InvalidArgument("kvbus host link: rank " + std::to_string(rank));
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Errno("socket");
  auto link = std::make_unique<HostLink>(fd, -1, parsed.token, 1, timeout);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(parsed.port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 && errno != EINPROGRESS) {
    return Errno("connect to port " + std::to_string(parsed.port));
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // The token goes first; rank 0 reads it when it accepts. (It fits any
  // socket buffer: the connect completes, or this send fails, at once on
  // loopback.)
  const Clock::time_point deadline = Clock::now() + timeout;
  KDN_RETURN_IF_ERROR(WaitReady(fd, POLLOUT, deadline, "accept"));
  int err = 0;
  socklen_t elen = sizeof(err);
  getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen);
  if (err != 0) {
    errno = err;
    return Errno("connect to port " + std::to_string(parsed.port));
  }
  if (send(fd, parsed.token.data(), parsed.token.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(parsed.token.size())) {
    return Errno("send the token");
  }
  return std::unique_ptr<DeviceLink>(std::move(link));
}

}  // namespace kdn::kvbus
