#pragma once
// The tcp transport's messages as kdn's own types, and their conversion
// to and from proto/kvbus_transport.proto (the only place the generated
// types are seen). One WireMessage is one ZeroMQ frame; a WireChunkHeader
// frame is followed by the chunk's bytes in a frame of their own.
// Public so that tests and the fuzzer can play a peer on the wire; the
// transports are its only other users. Thread-safe (pure functions over
// values).

#include <cstddef>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>
#include <zmq.hpp>

#include "kdn/common/status.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/region.h"

namespace kdn::kvbus {

// 2: regions and offers name their planes (RegionInfo.plane, Offer.planes
// as strings), where version 1 carried a RegionKind enum.
inline constexpr uint32_t kTransportWireVersion = 2;
// A sender splits its offers at this many entries; a receiver drops larger ones.
inline constexpr size_t kMaxOfferEntries = 16384;

struct WireOfferEntry {
  ChunkKey key;
  uint64_t bytes = 0;
};
struct WireOffer {
  uint64_t batch = 0;
  std::vector<WireOfferEntry> entries;
  // The region planes the sender can write with (their names,
  // kdn/kvbus/region_plane.h), when the receiver runs on the host host_id
  // names.
  std::vector<std::string> planes;
  std::string host_id;
  std::string link;  // the id of a link the sender joined as rank 0 ("": none)
};

enum class WireDecisionKind : uint8_t { kHeld, kGranted, kRejected };
struct WireDecision {
  ChunkKey key;
  WireDecisionKind kind = WireDecisionKind::kRejected;
  Status status;        // kRejected: why
  uint32_t region = 0;  // kGranted into a region (0: none): the bytes go at offset
  uint64_t offset = 0;
  // kGranted in place: the payload goes to these ranges of `region` (empty
  // with in_place: the whole chunk comes in a frame, the receiver lands it).
  std::vector<Extent> extents;
  bool in_place = false;
};
// A receiver's region that grants address (proto RegionInfo).
struct WireRegion {
  uint32_t id = 0;
  uint64_t bytes = 0;
  std::string handle;
  std::string plane = "shm";  // the region plane that writes it (kdn/kvbus/region_plane.h)
};
struct WireDecisions {
  uint64_t batch = 0;
  std::vector<WireDecision> decisions;
  std::vector<WireRegion> regions;  // those the decisions name
  std::string dropped_link;         // the sender's link the receiver could not join, or dropped
};

struct WireChunkHeader {
  uint64_t batch = 0;
  ChunkKey key;
  uint64_t bytes = 0;
  bool landed = false;  // the bytes are in the granted region: no frame follows
  std::string header;   // landed in place: the chunk's header (its payload in the extents)
  bool linked = false;  // landed: its payload comes next over the link, onto the extents
};

struct WireAck {
  uint64_t batch = 0;
  ChunkKey key;
  Status status;
  bool duplicate = false;
  std::string dropped_link;  // the sender's link the receiver dropped on this chunk
};
struct WireAcks {
  std::vector<WireAck> acks;
};

struct WirePing {
  uint64_t seq = 0;
};
struct WirePong {
  uint64_t seq = 0;
  std::vector<uint64_t> waiting_batches;  // sorted
};

// Empty keys: the whole batch.
struct WireCancel {
  uint64_t batch = 0;
  std::vector<ChunkKey> keys;
};

using WireMessage = std::variant<WireOffer, WireDecisions, WireChunkHeader, WireAcks, WirePing,
                                 WirePong, WireCancel>;

// One frame holding `message`. INTERNAL if it cannot be serialized.
Result<zmq::message_t> EncodeWire(const WireMessage& message);

// CORRUPTION for bytes that are not a TransportFrame of this version with a
// body; INVALID_ARGUMENT for a frame that is well-formed but unusable (a
// DECISION_UNSPECIFIED, an OK code on a rejection).
Result<WireMessage> DecodeWire(const void* data, size_t size);

}  // namespace kdn::kvbus
