// The cuda_ipc device plane on the CPU (docs/kvbus.md, "Device planes"):
// the host backend of kdn/kvbus/device_ops.h stands in for a device, so the
// plane's whole code path (the receiver exporting its landing region as a
// device region, the sender opening it and writing claimed payloads through
// the backend, verification through the backend) runs here. The
// conformance suite over it, then the plane's own cases: which plane wrote
// the bytes, refusals, damage, a handle that cannot be opened. ctest label
// device_plane (tests/CMakeLists.txt).

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/region_plane.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/transport.h"
#include "landing_site.h"
#include "plane_rig.h"
#include "kdn/testing/recording_store.h"
#include "sourcing_sender.h"
#include "transport_conformance.h"
#include "transport_test_util.h"

namespace kdn::kvbus {
namespace {

using namespace std::chrono_literals;
using namespace transport_test;  // NOLINT: transport_test_util.h
using kdn::testing::RecordingStore;
using testing::InPlaceReceiver;
using testing::LandingSegmentBytes;
using testing::PlaneRig;
using testing::SourcingSender;

// `o` over the cuda_ipc plane, the host backend standing in for a device.
SenderOptions OverCudaIpc(SenderOptions o) {
  o.transport = TransportKind::kCudaIpc;
  o.device_ops = &HostDeviceOps();
  return o;
}

SenderOptions DeviceSender(TransportKind kind = TransportKind::kCudaIpc) {
  SenderOptions o;
  o.peer_timeout = 5s;
  o.heartbeat_interval = 100ms;
  o = OverCudaIpc(o);
  o.transport = kind;
  return o;
}

// The suite with every claimed payload written by the sender's cuda_ipc
// plane into a device region (the host backend's memory); what the site
// does not claim goes as auto sends it.
INSTANTIATE_TEST_SUITE_P(DevicePlane, TransportConformance,
                         ::testing::Values(TransportFactory{
                             "cuda_ipc_host_in_place",
                             [](ChunkStore& sink, const ReceiverOptions& o) {
                               return InPlaceReceiver::Listen(sink, o, LandingSegmentBytes(o),
                                                              RegionKind::kDevice);
                             },
                             [](const std::string& endpoint, SenderOptions o) {
                               return Connect(endpoint, OverCudaIpc(o));
                             }}),
                         TransportFactoryName);

// Sourced chunks (read where they lie, SubmitSourced): the same suite with
// every chunk's payload in a region of the host backend, carried by each
// plane: copied by the device plane straight into the landing site's device
// region, by shm into the landing segment, and read into host memory for
// tcp.
INSTANTIATE_TEST_SUITE_P(
    DevicePlaneSourced, TransportConformance,
    ::testing::Values(TransportFactory{"cuda_ipc_host_sourced_in_place",
                                       [](ChunkStore& sink, const ReceiverOptions& o) {
                                         return InPlaceReceiver::Listen(
                                             sink, o, LandingSegmentBytes(o), RegionKind::kDevice);
                                       },
                                       [](const std::string& endpoint, SenderOptions o) {
                                         return SourcingSender::Connect(endpoint, OverCudaIpc(o));
                                       }},
                      TransportFactory{"shm_sourced",
                                       [](ChunkStore& sink, ReceiverOptions o) {
                                         o.shm_landing_bytes = LandingSegmentBytes(o);
                                         return Listen("tcp://127.0.0.1:0", sink, o);
                                       },
                                       [](const std::string& endpoint, SenderOptions o) {
                                         o.transport = TransportKind::kShm;
                                         return SourcingSender::Connect(endpoint, o);
                                       }},
                      TransportFactory{"tcp_sourced",
                                       [](ChunkStore& sink, const ReceiverOptions& o) {
                                         return Listen("tcp://127.0.0.1:0", sink, o);
                                       },
                                       [](const std::string& endpoint, SenderOptions o) {
                                         o.transport = TransportKind::kTcp;
                                         return SourcingSender::Connect(endpoint, o);
                                       }}),
    TransportFactoryName);

TEST(DevicePlane, TheHostBackendOpensWritesAndChecksumsByHandle) {
  DeviceOps& ops = HostDeviceOps();
  KDN_ASSERT_OK_AND_ASSIGN(auto mine, ops.Allocate(1 << 16));
  EXPECT_EQ(&mine->ops(), &ops);
  KDN_ASSERT_OK_AND_ASSIGN(auto peer, ops.Open(mine->handle(), mine->bytes()));
  EXPECT_EQ(peer->handle(), mine->handle());
  std::vector<uint8_t> src(3000);
  std::iota(src.begin(), src.end(), uint8_t{1});
  const std::vector<Extent> extents = {{40000, 1000}, {64, 2000}};
  KDN_ASSERT_OK(ops.Upload(src.data(), peer->data(), extents));
  // Written through the peer's mapping, seen in the owner's.
  EXPECT_EQ(std::memcmp(mine->data() + 40000, src.data(), 1000), 0);
  EXPECT_EQ(std::memcmp(mine->data() + 64, src.data() + 1000, 2000), 0);
  KDN_ASSERT_OK_AND_ASSIGN(uint64_t sum, ops.Checksum(mine->data(), extents));
  const Extent whole{0, src.size()};
  EXPECT_EQ(sum, PayloadChecksum(src.data(), {&whole, 1}));

  EXPECT_EQ(ops.Allocate(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ops.Open(mine->handle(), mine->bytes() + 1).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ops.Open("kdn-cuda-ipc:1:2", 64).status().code(), StatusCode::kInvalidArgument);
}

TEST(DevicePlane, TheSenderWritesClaimedPayloadsThroughTheBackend) {
  for (TransportKind kind : {TransportKind::kCudaIpc, TransportKind::kAuto}) {
    PlaneRig rig(RegionKind::kDevice, DeviceSender(kind));
    const std::vector<ChunkPtr> chunks = MakeChunks(10, 6, 16);
    KDN_ASSERT_OK(rig.Move(chunks).ToStatus());
    for (const ChunkPtr& c : chunks) EXPECT_TRUE(rig.sink.Contains(c->key()));
    EXPECT_EQ(rig.site().landed(), 6u);
    const ReceiverStats r = rig.receiver->Stats();
    EXPECT_EQ(r.in_place_chunks, 6u);
    EXPECT_EQ(r.in_place_plane_chunks, 6u) << TransportKindName(kind);
    EXPECT_EQ(r.shm_chunks, 0u) << "a device region's chunks are not shm's";
    const SenderStats s = rig.sender->Stats();
    EXPECT_EQ(s.plane("cuda_ipc").chunks, 6u);
    EXPECT_EQ(s.plane("cuda_ipc").bytes, 6 * chunks[0]->size());
    EXPECT_EQ(s.planes.count("shm"), 0u);
    EXPECT_EQ(s.planes.count("tcp"), 0u);
  }
}

TEST(DevicePlane, ASenderWithoutABackendSendsByTcpAndTheReceiverLandsIt) {
  SenderOptions so = DeviceSender(TransportKind::kAuto);
  so.device_ops = nullptr;
  PlaneRig rig(RegionKind::kDevice, so);
  KDN_ASSERT_OK(rig.Move(MakeChunks(20, 3, 16)).ToStatus());
  const ReceiverStats r = rig.receiver->Stats();
  EXPECT_EQ(r.in_place_chunks, 3u);
  EXPECT_EQ(r.in_place_plane_chunks, 0u);
  EXPECT_EQ(rig.sender->Stats().plane("tcp").chunks, 3u);
}

TEST(DevicePlane, CudaIpcRefusesToLandInHostMemoryAndShmInADeviceRegion) {
  {
    PlaneRig rig(RegionKind::kShm, DeviceSender(TransportKind::kCudaIpc));
    const BatchStatus bs = rig.Move({MakeChunk(30, 16)});
    ASSERT_EQ(bs.chunks[0].outcome, ChunkOutcome::kFailed);
    EXPECT_EQ(bs.chunks[0].status.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(bs.chunks[0].status.message().find("outside a device region"), std::string::npos)
        << bs.chunks[0].status.ToString();
  }
  {
    SenderOptions so = DeviceSender(TransportKind::kShm);
    PlaneRig rig(RegionKind::kDevice, so);
    const BatchStatus bs = rig.Move({MakeChunk(31, 16)});
    ASSERT_EQ(bs.chunks[0].outcome, ChunkOutcome::kFailed);
    EXPECT_EQ(bs.chunks[0].status.code(), StatusCode::kFailedPrecondition)
        << bs.chunks[0].status.ToString();
  }
}

TEST(DevicePlane, ADamagedPayloadIsCaughtWhereItLanded) {
  SenderOptions so = DeviceSender();
  so.faults.corrupt_data = [](const ChunkKey& k) { return k.lo == 41; };
  PlaneRig rig(RegionKind::kDevice, so);
  const BatchStatus bs = rig.Move({MakeChunk(40, 16), MakeChunk(41, 16)});
  EXPECT_EQ(bs.chunks[0].outcome, ChunkOutcome::kSent);
  ASSERT_EQ(bs.chunks[1].outcome, ChunkOutcome::kFailed);
  EXPECT_EQ(bs.chunks[1].status.code(), StatusCode::kCorruption) << bs.chunks[1].status.ToString();
  EXPECT_FALSE(rig.sink.Contains(MakeChunk(41, 16)->key()));
  EXPECT_EQ(rig.receiver->Stats().chunks_rejected, 1u);
}

TEST(DevicePlane, OptionsThatCannotWorkAreRefused) {
  SenderOptions so = DeviceSender();
  so.device_ops = nullptr;
  EXPECT_EQ(Connect("tcp://127.0.0.1:9", so).status().code(), StatusCode::kInvalidArgument);
  RecordingStore sink;
  ReceiverOptions ro;
  KDN_ASSERT_OK_AND_ASSIGN(auto memory, HostDeviceOps().Allocate(1 << 20));
  testing::SinkLandingSite site(sink, *memory, 1 << 20);
  ro.landing = &site;
  ro.landing_region = memory.get();
  ro.landing_kind = RegionKind::kUnknown;
  EXPECT_EQ(Listen("tcp://127.0.0.1:0", sink, ro).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseTransportKind("cuda_ipc").value(), TransportKind::kCudaIpc);
}

// A receiver whose device region cannot be opened from here (its handle
// names a process's descriptor this one cannot reach): cuda_ipc fails the
// chunk and says why; auto sends it by tcp.
TEST(DevicePlane, ARegionThatCannotBeOpenedFailsCudaIpcAndAutoFallsBackToTcp) {
  for (TransportKind kind : {TransportKind::kCudaIpc, TransportKind::kAuto}) {
    StandInReceiver r;
    KDN_ASSERT_OK_AND_ASSIGN(auto sender, Connect(r.endpoint, DeviceSender(kind)));
    const ChunkPtr c = MakeChunk(50, 16);
    KDN_ASSERT_OK_AND_ASSIGN(uint64_t batch, sender->Submit({c}));
    bool done = false;
    for (int i = 0; i < 200 && !done; ++i) {
      auto m = r.Next();
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      if (auto* o = std::get_if<WireOffer>(&*m)) {
        EXPECT_NE(std::find(o->planes.begin(), o->planes.end(), kCudaIpcPlaneName),
                  o->planes.end());
        WireDecision grant{c->key(), WireDecisionKind::kGranted, Status::Ok()};
        grant.region = 7;
        grant.in_place = true;
        grant.extents = {{0, c->payload().size()}};
        WireDecisions d{o->batch, {grant}, {}};
        d.regions.push_back(WireRegion{7, 1 << 20, "memfd:1:999999", kCudaIpcPlaneName});
        r.Reply(d);
      } else if (auto* h = std::get_if<WireChunkHeader>(&*m)) {
        EXPECT_FALSE(h->landed);
        zmq::message_t body;
        ASSERT_TRUE(r.router.recv(body));
        EXPECT_EQ(body.size(), c->size());
        r.Reply(WireAcks{{WireAck{h->batch, h->key, Status::Ok(), false}}});
        done = true;
      } else if (std::holds_alternative<WireCancel>(*m)) {
        done = true;  // cuda_ipc gave the grant back
      } else if (auto* p = std::get_if<WirePing>(&*m)) {
        r.Reply(WirePong{p->seq, {}});
      }
    }
    KDN_ASSERT_OK_AND_ASSIGN(BatchStatus st, sender->Wait(batch, 5s));
    ASSERT_TRUE(st.done);
    if (kind == TransportKind::kCudaIpc) {
      EXPECT_EQ(st.chunks[0].status.code(), StatusCode::kFailedPrecondition);
      EXPECT_NE(st.chunks[0].status.message().find("could not be opened here"), std::string::npos)
          << st.chunks[0].status.ToString();
    } else {
      EXPECT_EQ(st.Count(ChunkOutcome::kSent), 1u);
      EXPECT_EQ(sender->Stats().plane("tcp").chunks, 1u);
    }
  }
}

// A sourced chunk: its header sealed over the payload where it lies; bad
// extents refused; a source changed after sealing caught on every plane.
TEST(DevicePlane, SourcedChunksAreSealedWhereTheyLieAndCaughtWhenTheyChange) {
  const ChunkPtr c = MakeChunk(60, 16);
  KDN_ASSERT_OK_AND_ASSIGN(auto pool, HostDeviceOps().Allocate(1 << 20));
  const uint64_t n = c->payload().size();
  const std::vector<Extent> extents = {{4096, n / 2}, {64, n - n / 2}};
  std::copy_n(c->payload().data(), n / 2, pool->data() + 4096);
  std::copy_n(c->payload().data() + n / 2, n - n / 2, pool->data() + 64);
  KDN_ASSERT_OK_AND_ASSIGN(SourcedChunk s, MakeSourcedChunk(c->info(), *pool, extents));
  EXPECT_TRUE(std::equal(s.header.begin(), s.header.end(), c->bytes().begin()))
      << "the same header as the chunk's own";
  EXPECT_EQ(s.size(), c->size());
  const std::vector<Extent> short_by_one = {{64, n - 1}};
  EXPECT_EQ(MakeSourcedChunk(c->info(), *pool, short_by_one).status().code(),
            StatusCode::kInvalidArgument);
  const std::vector<Extent> outside = {{(1 << 20) - 8, n}};
  EXPECT_EQ(MakeSourcedChunk(c->info(), *pool, outside).status().code(),
            StatusCode::kInvalidArgument);

  // Changed after sealing: the receiver finds the checksum wrong where it
  // landed (device plane), the sender when it reads it for tcp.
  pool->data()[64] ^= 0xff;
  for (TransportKind kind : {TransportKind::kCudaIpc, TransportKind::kTcp}) {
    PlaneRig rig(RegionKind::kDevice, DeviceSender(kind));
    KDN_ASSERT_OK_AND_ASSIGN(uint64_t batch, rig.sender->SubmitSourced({s}));
    KDN_ASSERT_OK_AND_ASSIGN(BatchStatus st, rig.sender->Wait(batch, kNoHang));
    ASSERT_TRUE(st.done);
    EXPECT_EQ(st.chunks[0].status.code(), StatusCode::kCorruption)
        << TransportKindName(kind) << ": " << st.chunks[0].status.ToString();
    EXPECT_FALSE(rig.sink.Contains(c->key()));
  }
  SourcedChunk none = s;
  none.memory = nullptr;
  PlaneRig rig(RegionKind::kDevice, DeviceSender());
  EXPECT_EQ(rig.sender->SubmitSourced({none}).status().code(), StatusCode::kInvalidArgument);
}

// The device plane copies a sourced payload from its extents straight into
// the landing site's blocks: what lands is the chunk's payload, and the
// sender's figures count it under cuda_ipc.
TEST(DevicePlane, ASourcedChunkIsCopiedFromWhereItLiesIntoTheClaimedBlocks) {
  const ChunkPtr c = MakeChunk(70, 16);
  KDN_ASSERT_OK_AND_ASSIGN(auto pool, HostDeviceOps().Allocate(1 << 16));
  const uint64_t n = c->payload().size();
  std::copy_n(c->payload().data(), n, pool->data() + 512);
  KDN_ASSERT_OK_AND_ASSIGN(SourcedChunk s, MakeSourcedChunk(c->info(), *pool, {{512, n}}));
  PlaneRig rig(RegionKind::kDevice, DeviceSender());
  KDN_ASSERT_OK_AND_ASSIGN(uint64_t batch, rig.sender->SubmitSourced({s}));
  KDN_ASSERT_OK_AND_ASSIGN(BatchStatus st, rig.sender->Wait(batch, kNoHang));
  KDN_ASSERT_OK(st.ToStatus());
  KDN_ASSERT_OK_AND_ASSIGN(auto got, rig.sink.Get(c->key()));
  EXPECT_TRUE(std::equal(got->bytes().begin(), got->bytes().end(), c->bytes().begin()));
  EXPECT_EQ(rig.receiver->Stats().in_place_plane_chunks, 1u);
  EXPECT_EQ(rig.sender->Stats().plane("cuda_ipc").chunks, 1u);
}

}  // namespace
}  // namespace kdn::kvbus
