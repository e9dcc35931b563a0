#pragma once
// A deployment's CURVE keys (docs/kvbus.md, "Authenticated sockets"). Every
// ZeroMQ socket between kdn's processes (control, kvbus, kdn-store) can run
// ZeroMQ's CURVE mechanism: encrypted, and open only to the peers the
// deployment's keys name. A deployment has two keypairs:
// - the members' key, held by the workers and kdn-store: every server
//   socket proves it holds its secret half, and kvbus receivers and
//   kdn-store admit only clients that hold it too;
// - the router's key, held by the router alone: the workers' control
//   sockets admit only it, so that no other process, a worker included,
//   can prepare, prefill or start a request the router did not start.
// The router's file names the members' public key (to check the servers
// against); the members' file names the router's public key (to admit it).
// kdn-keygen writes both files, readable by their owner only; kdn-launch
// runs it into the run folder. A members' file without a router key admits
// members on control sockets too (one key for the whole deployment).
//
// No ZeroMQ types here, so that option structs can carry keys.

#include <optional>
#include <string>
#include <utility>

#include "kdn/common/status.h"

namespace kdn::net {

struct CurveKeys {
  std::string public_key;  // this process's keypair: ZeroMQ's Z85 text, 40 characters
  std::string secret_key;
  // The servers' public key, when it is not this keypair's (the router's
  // file: the members' public key). Empty: public_key.
  std::string server_key;
  // The one client key the control sockets admit (the members' file: the
  // router's public key). Empty: public_key.
  std::string router_key;

  const std::string& ServerKey() const { return server_key.empty() ? public_key : server_key; }
  const std::string& ControlClientKey() const {
    return router_key.empty() ? public_key : router_key;
  }
};

// Whether this libzmq was built with CURVE (Debian's is, with libsodium).
bool CurveAvailable();

// A fresh random keypair (public_key and secret_key only).
// FAILED_PRECONDITION without CURVE.
Result<CurveKeys> GenerateCurveKeys();

// A new deployment's two key sets: {members', router's}, each naming the
// other's public key as above.
Result<std::pair<CurveKeys, CurveKeys>> GenerateDeploymentKeys();

// Writes `keys` to a new file at `path` with mode 0600. FAILED_PRECONDITION
// if `path` exists (a deployment's key is never silently replaced),
// IO_ERROR if it cannot be written.
Status WriteCurveKeys(const std::string& path, const CurveKeys& keys);

// Reads a key file. INVALID_ARGUMENT if it is malformed or its keypair's two
// halves do not belong together, FAILED_PRECONDITION if group or others may
// read it (as ssh refuses such a private key), NOT_FOUND / IO_ERROR if
// unreadable.
Result<CurveKeys> ReadCurveKeys(const std::string& path);

// The keys a program should use: ReadCurveKeys(path) when `path` is not
// empty, else the file named by the environment variable KDN_CURVE_KEYS when
// set, else none (plaintext sockets).
Result<std::optional<CurveKeys>> CurveKeysFromFlagOrEnv(const std::string& path);

}  // namespace kdn::net
