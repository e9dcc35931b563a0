// The tcp transport's factories and the socket helpers its two ends share.
// The ends themselves: sender.cpp and receiver.cpp.

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>

#include "transport_internal.h"
#include "kdn/net/zmq_check.h"

namespace kdn::kvbus {

Result<std::unique_ptr<WakeFd>> WakeFd::Make() {
  const int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (fd < 0) return IoError(std::string("eventfd: ") + std::strerror(errno));
  return std::unique_ptr<WakeFd>(new WakeFd(fd));
}

WakeFd::~WakeFd() { close(fd_); }

void WakeFd::Signal() {
  const uint64_t one = 1;
  // Fails only when the counter would overflow, in which case it is already
  // readable: the wake-up is not lost.
  [[maybe_unused]] ssize_t n = write(fd_, &one, sizeof(one));
}

void WakeFd::Drain() {
  uint64_t count = 0;
  [[maybe_unused]] ssize_t n = read(fd_, &count, sizeof(count));
}

Result<std::string> NormalizeTcpEndpoint(const std::string& endpoint, bool for_bind) {
  const std::string kScheme = "tcp://";
  const auto bad = [&](const std::string& why) {
    return InvalidArgument("kvbus tcp endpoint '" + endpoint + "': " + why);
  };
  if (endpoint.rfind(kScheme, 0) != 0) return bad("expected tcp://host:port");
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos || colon < kScheme.size()) return bad("no port");
  const std::string host = endpoint.substr(kScheme.size(), colon - kScheme.size());
  const std::string port = endpoint.substr(colon + 1);
  if (host.empty()) return bad("no host");
  if (port == "*" || port == "0") {
    if (!for_bind) return bad("a sender needs the receiver's actual port");
    return kScheme + host + ":*";
  }
  if (port.empty() || port.size() > 5 ||
      port.find_first_not_of("0123456789") != std::string::npos || std::stoi(port) > 65535 ||
      std::stoi(port) == 0) {
    return bad("port '" + port + "' is not a number in 1..65535");
  }
  return endpoint;
}

Result<bool> TrySend(zmq::socket_t& socket, zmq::message_t& frame, bool more) {
  zmq::send_result_t sent;
  KDN_ZMQ_RETURN_IF_ERROR(
      sent = socket.send(frame, more ? zmq::send_flags::sndmore | zmq::send_flags::dontwait
                                     : zmq::send_flags::dontwait));
  return sent.has_value();
}

Result<bool> TryRecv(zmq::socket_t& socket, zmq::message_t& frame) {
  zmq::recv_result_t got;
  KDN_ZMQ_RETURN_IF_ERROR(got = socket.recv(frame, zmq::recv_flags::dontwait));
  return got.has_value();
}

Status SetCommonSocketOptions(zmq::socket_t& socket, std::chrono::milliseconds heartbeat_interval,
                              std::chrono::milliseconds heartbeat_timeout) {
  const auto ms = [](std::chrono::milliseconds d) {
    return static_cast<int>(std::min<int64_t>(d.count(), INT32_MAX));
  };
  // A closing end drops what it has not sent: nothing waits on a dead peer.
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::linger, 0));
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::heartbeat_ivl, ms(heartbeat_interval)));
  KDN_ZMQ_RETURN_IF_ERROR(socket.set(zmq::sockopt::heartbeat_timeout, ms(heartbeat_timeout)));
  // ZeroMQ keeps the TTL in deciseconds in 16 bits.
  KDN_ZMQ_RETURN_IF_ERROR(
      socket.set(zmq::sockopt::heartbeat_ttl, std::min(ms(heartbeat_timeout), 6553599)));
  return Status::Ok();
}

const char* TransportKindName(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto: return "auto";
    case TransportKind::kTcp: return "tcp";
    case TransportKind::kShm: return "shm";
    case TransportKind::kCudaIpc: return "cuda_ipc";
    case TransportKind::kNccl: return "nccl";
  }
  return "?";
}

Result<TransportKind> ParseTransportKind(const std::string& name) {
  for (TransportKind k : {TransportKind::kAuto, TransportKind::kTcp, TransportKind::kShm,
                          TransportKind::kCudaIpc, TransportKind::kNccl}) {
    if (name == TransportKindName(k)) return k;
  }
  return InvalidArgument("kvbus transport '" + name +
                         "': expected auto, tcp, shm, cuda_ipc or nccl");
}

Result<std::unique_ptr<Sender>> Connect(const std::string& endpoint, const SenderOptions& options) {
  return TcpSender::Start(endpoint, options);
}

Result<std::unique_ptr<Receiver>> Listen(const std::string& endpoint, ChunkStore& sink,
                                         const ReceiverOptions& options) {
  return TcpReceiver::Start(endpoint, sink, options);
}

}  // namespace kdn::kvbus
