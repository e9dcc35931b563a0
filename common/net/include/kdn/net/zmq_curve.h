#pragma once
// CURVE on ZeroMQ sockets (kdn/net/curve.h has the keys). A server socket
// encrypts and proves it holds the members' secret key; a client must know
// the servers' public key and prove it holds a secret key of its own, which
// the context's CurveAuthenticator (ZeroMQ's ZAP handler) checks: a data
// socket (kvbus, kdn-store) admits the members' key, a control socket the
// router's. Without an authenticator ZeroMQ would admit any client that
// knows the server's public key, so SecureServer starts one.

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <zmq.hpp>

#include "kdn/common/status.h"
#include "kdn/net/curve.h"

namespace kdn::net {

// Which peers a server socket admits.
enum class CurveRole {
  kData,     // kvbus receivers, kdn-store: the members (workers, kdn-store)
  kControl,  // workers' control sockets: the router
};

// ZeroMQ's ZAP handler for one context: admits CURVE clients whose public
// key is the one the socket's role admits, and refuses every other client
// (logging each refusal, rate-limited). One per context, started before any
// of its server sockets binds; destroy it before closing the context.
class CurveAuthenticator {
 public:
  static Result<std::unique_ptr<CurveAuthenticator>> Start(zmq::context_t& context,
                                                           const CurveKeys& keys);
  ~CurveAuthenticator();
  CurveAuthenticator(const CurveAuthenticator&) = delete;
  CurveAuthenticator& operator=(const CurveAuthenticator&) = delete;

  uint64_t admitted() const { return admitted_.load(std::memory_order_relaxed); }
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }

 private:
  CurveAuthenticator(zmq::context_t& context, std::string data_key, std::string control_key);
  void Run();

  zmq::socket_t socket_;           // REP at inproc://zeromq.zap.01; the thread's alone
  const std::string data_key_;     // the members' public key, 32 bytes
  const std::string control_key_;  // the router's, 32 bytes
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> admitted_{0}, refused_{0};
  std::thread thread_;
};

// Makes `socket`, before it binds, a CURVE server for `keys` that admits
// the clients of `role`, when `keys` is set, starting `*auth` on `context`
// first if it is not running; with no keys, does nothing (a plaintext
// socket).
Status SecureServer(zmq::context_t& context, zmq::socket_t& socket,
                    const std::optional<CurveKeys>& keys, CurveRole role,
                    std::unique_ptr<CurveAuthenticator>* auth);

// Makes `socket`, before it connects, a CURVE client for `keys` when set:
// it checks the server against keys.ServerKey() and presents its keypair.
Status SecureClient(zmq::socket_t& socket, const std::optional<CurveKeys>& keys);

}  // namespace kdn::net
