#pragma once
// A deployment's CURVE key (docs/kvbus.md, "Authenticated sockets"). Every
// ZeroMQ socket between kdn's processes (control, kvbus, kdn-store) can run
// ZeroMQ's CURVE mechanism: encrypted, and open only to peers that hold the
// deployment's key. One keypair serves a whole deployment: servers prove they
// hold its secret half, and admit only clients that prove the same (a ZAP
// handler checks the client's public key, kdn/kvbus/zmq_curve.h). The key
// lives in one file, written by kdn-keygen (kdn-launch runs it into the run
// folder), which must be readable by its owner only.
//
// No ZeroMQ types here, so that option structs can carry a key.

#include <optional>
#include <string>

#include "kdn/common/status.h"

namespace kdn::kvbus {

struct CurveKeys {
  std::string public_key;  // ZeroMQ's Z85 text, 40 characters
  std::string secret_key;  // likewise
};

// Whether this libzmq was built with CURVE (Debian's is, with libsodium).
bool CurveAvailable();

// A fresh random keypair. FAILED_PRECONDITION without CURVE.
Result<CurveKeys> GenerateCurveKeys();

// Writes `keys` to a new file at `path` with mode 0600. ALREADY_EXISTS-like
// FAILED_PRECONDITION if `path` exists (a deployment's key is never
// silently replaced), IO_ERROR if it cannot be written.
Status WriteCurveKeys(const std::string& path, const CurveKeys& keys);

// Reads a key file. INVALID_ARGUMENT if it is malformed or its two halves do
// not belong together, FAILED_PRECONDITION if group or others may read it
// (as ssh refuses such a private key), NOT_FOUND / IO_ERROR if unreadable.
Result<CurveKeys> ReadCurveKeys(const std::string& path);

// The key a program should use: ReadCurveKeys(path) when `path` is not
// empty, else the file named by the environment variable KDN_CURVE_KEYS when
// set, else none (plaintext sockets).
Result<std::optional<CurveKeys>> CurveKeysFromFlagOrEnv(const std::string& path);

}  // namespace kdn::kvbus
