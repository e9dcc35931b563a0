#pragma once
// Private to kvbus: the host backend's link (kdn/kvbus/device_ops.h,
// DeviceLink), what the nccl plane runs on where the host backend stands
// in for a device. A TCP connection on loopback: rank 0 listens on a port
// of 127.0.0.1 when it makes the id, "host-link:<port>:<token>", and
// accepts at its first Send; rank 1 connects and writes the token, which
// rank 0 checks (a 128-bit secret that travelled over kdn's authenticated
// control channel). Each message is its length (8 bytes, little-endian)
// and its bytes. Same host only: it stands in for NCCL in tests and test
// deployments, not across machines.

#include <chrono>
#include <memory>
#include <string>

#include "kdn/common/status.h"
#include "kdn/kvbus/device_ops.h"

namespace kdn::kvbus {

Result<std::string> NewHostLinkId();
Result<std::unique_ptr<DeviceLink>> JoinHostLink(const std::string& id, int rank,
                                                 std::chrono::milliseconds timeout);

}  // namespace kdn::kvbus
