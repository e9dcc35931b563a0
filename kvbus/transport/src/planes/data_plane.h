#pragma once
// Private to the kvbus transports: the nccl plane's sending half. The
// region planes, and their registry, are in kdn/kvbus/region_plane.h. The
// nccl plane (LinkPlane) writes no region itself: it sends each payload
// over a link the receiver joined, and the receiver receives it onto the
// claimed extents.
//
// Not thread-safe: the sender's I/O thread owns its planes.

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/region.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/transport.h"
#include "kdn/kvbus/region_plane.h"
#include "kdn/kvbus/wire.h"

namespace kdn::kvbus {

// The nccl plane's sending half: a link of a DeviceOps backend this sender
// made and joined as rank 0, its id named in the sender's offers. The
// receiver joins it as rank 1; an in-place grant into its device region
// then goes as the chunk's header, marked linked, and the payload as one
// message over the link: from where a sourced chunk of this backend lies,
// else from host memory (a device backend's through a staging buffer). A
// sourced payload goes as it lies now: the receiver checks it against the
// sealed header where it lands.
class LinkPlane {
 public:
  // `timeout` bounds the peer's join and each message.
  static Result<std::unique_ptr<LinkPlane>> Make(DeviceOps& ops, std::chrono::milliseconds timeout);

  const std::string& id() const { return id_; }
  bool usable() const { return error_.ok(); }
  const Status& error() const { return error_; }  // why the link ended
  // Sends `chunk`'s payload as the next message (`corrupt`: one byte
  // flipped, SenderFaults::corrupt_data). Any failure ends the link (the
  // receiver, waiting for the message, is out of step with it).
  Status Send(const OutChunk& chunk, bool corrupt);

 private:
  Status SendPayload(const OutChunk& chunk, bool corrupt);
  LinkPlane(DeviceOps& ops, std::string id, std::unique_ptr<DeviceLink> link)
      : ops_(ops), id_(std::move(id)), link_(std::move(link)) {}

  DeviceOps& ops_;
  const std::string id_;
  std::unique_ptr<DeviceLink> link_;
  std::unique_ptr<DeviceMemory> stage_;  // a device backend's: host payloads go through it
  Status error_;
};

}  // namespace kdn::kvbus
