// The shm data plane's own tests (the conformance suite runs for it in
// transport_test.cpp): which plane a chunk takes, falling back to tcp, the
// landing segment's accounting, and what a receiver does with a landed
// header it never granted. Also the pieces under it: RegionTable,
// RangeAllocator and SharedSegment.

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <zmq.hpp>

#include "kdn/kvbus/shared_segment.h"
#include "kdn/kvbus/wire.h"
#include "kdn/kvbus/region.h"
#include "kdn/kvbus/transport.h"
#include "kdn/testing/recording_store.h"
#include "kdn/testing/chunks.h"

namespace kdn::kvbus {
namespace {

using namespace std::chrono_literals;
using kdn::testing::RecordingStore;
using ChunkPtr = std::shared_ptr<const Chunk>;

constexpr auto kNoHang = std::chrono::milliseconds(20000);

kdn::testing::ChunkShape Shape(uint32_t tokens) {
  return {.layers = 2, .kv_heads = 2, .head_dim = 64, .tokens = tokens};
}

ChunkPtr MakeChunk(uint64_t id, uint32_t tokens = 16) {
  return kdn::testing::MakeChunk(ChunkKey{0x5a, id}, id, Shape(tokens));
}

std::vector<ChunkPtr> MakeChunks(int count, uint32_t tokens = 16) {
  return kdn::testing::MakeChunks(0x5a, 100, count, Shape(tokens));
}

// `lease` is long enough that no grant runs out on a loaded machine, but for
// the tests of expiry.
ReceiverOptions Landing(uint64_t bytes, std::chrono::milliseconds lease = 10s) {
  ReceiverOptions o;
  o.lease = lease;
  o.heartbeat_interval = 100ms;
  o.shm_landing_bytes = bytes;
  return o;
}

SenderOptions Sending(TransportKind kind) {
  SenderOptions o;
  o.peer_timeout = 5s;
  o.heartbeat_interval = 100ms;
  o.transport = kind;
  return o;
}

BatchStatus Move(Sender& sender, const std::vector<ChunkPtr>& chunks) {
  auto batch = sender.Submit(chunks);
  EXPECT_TRUE(batch.ok());
  auto status = sender.Wait(*batch, kNoHang);
  EXPECT_TRUE(status.ok());
  return *status;
}

bool Eventually(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + kNoHang;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

TEST(ShmTransport, LandsEveryChunkInTheSegmentWhenBothEndsShareAHost) {
  RecordingStore sink;
  auto receiver = Listen("tcp://127.0.0.1:0", sink, Landing(8 << 20));
  ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();
  auto sender = Connect((*receiver)->endpoint(), Sending(TransportKind::kAuto));
  ASSERT_TRUE(sender.ok());
  const auto chunks = MakeChunks(20);
  ASSERT_TRUE(Move(**sender, chunks).ToStatus().ok());
  uint64_t bytes = 0;
  for (const auto& c : chunks) {
    bytes += c->size();
    auto got = sink.Get(c->key());
    ASSERT_TRUE(got.ok());
    ASSERT_EQ(0, std::memcmp((*got)->bytes().data(), c->bytes().data(), c->size()));
  }
  const ReceiverStats r = (*receiver)->Stats();
  EXPECT_EQ(r.shm_chunks, 20u);
  EXPECT_EQ(r.shm_bytes, bytes);
  EXPECT_EQ(r.shm_landing_bytes, uint64_t{8} << 20);
  const SenderStats s = (*sender)->Stats();
  EXPECT_EQ(s.plane("shm").chunks, 20u);
  EXPECT_EQ(s.plane("shm").bytes, bytes);
  EXPECT_GT(s.plane("shm").copy_seconds, 0.0);
  EXPECT_EQ(s.plane("tcp").chunks, 0u);
  EXPECT_EQ(s.planes.count("tcp"), 0u);  // a plane shows up once used
  EXPECT_TRUE(Eventually([&] { return (*receiver)->Stats().shm_landed_bytes == 0; }))
      << "every landed range is given back once its chunk is stored";
}

TEST(ShmTransport, SendsByTcpWhenTheReceiverHasNoSegmentOrTheSenderAsksForTcp) {
  for (const bool landing : {false, true}) {
    RecordingStore sink;
    auto receiver = Listen("tcp://127.0.0.1:0", sink, Landing(landing ? 8 << 20 : 0));
    ASSERT_TRUE(receiver.ok());
    auto sender = Connect((*receiver)->endpoint(),
                          Sending(landing ? TransportKind::kTcp : TransportKind::kAuto));
    ASSERT_TRUE(sender.ok());
    const auto chunks = MakeChunks(5);
    ASSERT_TRUE(Move(**sender, chunks).ToStatus().ok());
    EXPECT_EQ(sink.size(), 5u);
    EXPECT_EQ((*receiver)->Stats().shm_chunks, 0u);
    EXPECT_EQ((*sender)->Stats().plane("tcp").chunks, 5u);
    EXPECT_EQ((*sender)->Stats().plane("shm").chunks, 0u);
  }
}

TEST(ShmTransport, SendsByTcpAChunkThatFindsNoRoomInTheSegment) {
  RecordingStore sink;
  // One 64 KiB segment: a 256-token chunk (256 KiB) never fits; the small ones do.
  auto receiver = Listen("tcp://127.0.0.1:0", sink, Landing(64 << 10));
  ASSERT_TRUE(receiver.ok());
  auto sender = Connect((*receiver)->endpoint(), Sending(TransportKind::kAuto));
  ASSERT_TRUE(sender.ok());
  const std::vector<ChunkPtr> chunks = {MakeChunk(1, 256), MakeChunk(2, 4)};
  ASSERT_TRUE(Move(**sender, chunks).ToStatus().ok());
  EXPECT_EQ(sink.size(), 2u);
  EXPECT_EQ((*sender)->Stats().plane("tcp").chunks, 1u);
  EXPECT_EQ((*sender)->Stats().plane("shm").chunks, 1u);
}

TEST(ShmTransport, FailsWhatAForcedShmSenderCannotLandAndFreesItsGrants) {
  RecordingStore sink;
  auto receiver = Listen("tcp://127.0.0.1:0", sink, Landing(0));
  ASSERT_TRUE(receiver.ok());
  auto sender = Connect((*receiver)->endpoint(), Sending(TransportKind::kShm));
  ASSERT_TRUE(sender.ok());
  const BatchStatus status = Move(**sender, MakeChunks(3));
  ASSERT_TRUE(status.done);
  EXPECT_EQ(status.Count(ChunkOutcome::kFailed), 3u);
  EXPECT_EQ(status.ToStatus().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(status.ToStatus().message().find("no shared-memory range"), std::string::npos)
      << status.ToStatus().ToString();
  EXPECT_EQ(sink.size(), 0u);
  EXPECT_TRUE(Eventually([&] { return (*receiver)->Stats().leased_bytes == 0; }))
      << "the sender cancels the grants it cannot use";
  EXPECT_GE((*receiver)->Stats().leases_cancelled, 3u);
}

TEST(ShmTransport, GivesTheSegmentBackAfterASenderDiesBetweenGrantAndData) {
  RecordingStore sink;
  auto receiver = Listen("tcp://127.0.0.1:0", sink, Landing(4 << 20, 300ms));
  ASSERT_TRUE(receiver.ok());
  {
    SenderOptions so = Sending(TransportKind::kShm);
    so.faults.withhold_data = [](const ChunkKey&) { return true; };
    auto sender = Connect((*receiver)->endpoint(), so);
    ASSERT_TRUE(sender.ok());
    ASSERT_TRUE((*sender)->Submit(MakeChunks(4)).ok());
    ASSERT_TRUE(Eventually([&] { return (*receiver)->Stats().shm_landed_bytes > 0; }));
  }
  // Expired leases keep their ranges for one more lease (a late writer may
  // still be copying), then the segment is whole again.
  ASSERT_TRUE(Eventually([&] {
    const ReceiverStats s = (*receiver)->Stats();
    return s.leased_bytes == 0 && s.shm_landed_bytes == 0;
  })) << "landed bytes "
      << (*receiver)->Stats().shm_landed_bytes;
  EXPECT_GE((*receiver)->Stats().leases_expired, 4u);
}

TEST(ShmTransport, RefusesALandedHeaderThatHoldsNoGrantAndStoresNothing) {
  RecordingStore sink;
  auto receiver = Listen("tcp://127.0.0.1:0", sink, Landing(1 << 20));
  ASSERT_TRUE(receiver.ok());
  zmq::context_t context;
  zmq::socket_t peer(context, zmq::socket_type::dealer);
  peer.set(zmq::sockopt::linger, 0);
  peer.set(zmq::sockopt::rcvtimeo, 10000);
  peer.connect((*receiver)->endpoint());
  const ChunkPtr c = MakeChunk(9);
  auto header = EncodeWire(WireChunkHeader{3, c->key(), c->size(), /*landed=*/true});
  ASSERT_TRUE(header.ok());
  peer.send(*header, zmq::send_flags::none);
  std::vector<WireAck> acks;
  for (int i = 0; i < 100 && acks.empty(); ++i) {
    zmq::message_t frame;
    ASSERT_TRUE(peer.recv(frame));
    auto m = DecodeWire(frame.data(), frame.size());
    if (m.ok() && std::holds_alternative<WireAcks>(*m)) acks = std::get<WireAcks>(*m).acks;
  }
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].status.code(), StatusCode::kFailedPrecondition) << acks[0].status.ToString();
  EXPECT_EQ(sink.size(), 0u);
  EXPECT_EQ((*receiver)->Stats().chunks_rejected, 1u);
}

TEST(ShmTransport, RefusesASegmentTooSmallForOnePage) {
  RecordingStore sink;
  EXPECT_EQ(Listen("tcp://127.0.0.1:0", sink, Landing(100)).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(TransportKind, ParsesItsNamesAndRefusesOthers) {
  EXPECT_EQ(*ParseTransportKind("auto"), TransportKind::kAuto);
  EXPECT_EQ(*ParseTransportKind("tcp"), TransportKind::kTcp);
  EXPECT_EQ(*ParseTransportKind("shm"), TransportKind::kShm);
  EXPECT_EQ(*ParseTransportKind("cuda_ipc"), TransportKind::kCudaIpc);
  EXPECT_EQ(*ParseTransportKind("nccl"), TransportKind::kNccl);
  for (TransportKind k : {TransportKind::kAuto, TransportKind::kTcp, TransportKind::kShm,
                          TransportKind::kCudaIpc, TransportKind::kNccl}) {
    EXPECT_EQ(*ParseTransportKind(TransportKindName(k)), k);
  }
  EXPECT_EQ(ParseTransportKind("rdma").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseTransportKind("NCCL").status().code(), StatusCode::kInvalidArgument);
}

TEST(RegionTable, ResolvesRangesInsideARegionOfTheRightKindOnly) {
  std::vector<uint8_t> host(4096), dev(1024);
  RegionTable table;
  auto h = table.Register(Region{MemoryKind::kHost, -1, host.data(), host.size()});
  auto d = table.Register(Region{MemoryKind::kDevice, 1, dev.data(), dev.size()});
  ASSERT_TRUE(h.ok() && d.ok());
  EXPECT_NE(*h, *d);
  EXPECT_EQ(*table.Resolve(*h, 100, 3996, MemoryKind::kHost), host.data() + 100);
  EXPECT_EQ(table.Resolve(*h, 100, 3997, MemoryKind::kHost).status().code(),
            StatusCode::kInvalidArgument);  // one byte past the end
  EXPECT_EQ(table.Resolve(*h, UINT64_MAX, 2, MemoryKind::kHost).status().code(),
            StatusCode::kInvalidArgument);  // no wrap-around
  EXPECT_EQ(table.Resolve(*h, 0, 8, MemoryKind::kDevice, 0).status().code(),
            StatusCode::kInvalidArgument);  // wrong kind
  EXPECT_EQ(*table.Resolve(*d, 0, 1024, MemoryKind::kDevice, 1), dev.data());
  auto wrong_device = table.Resolve(*d, 0, 8, MemoryKind::kDevice, 0);
  EXPECT_EQ(wrong_device.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong_device.status().message().find("device 1"), std::string::npos);
  EXPECT_EQ(table.Resolve(999, 0, 1, MemoryKind::kHost).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(table.Unregister(*h).ok());
  EXPECT_EQ(table.Resolve(*h, 0, 1, MemoryKind::kHost).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(table.Unregister(*h).code(), StatusCode::kNotFound);
  EXPECT_EQ(table.Register(Region{MemoryKind::kHost, 0, host.data(), 8}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Register(Region{MemoryKind::kDevice, -1, dev.data(), 8}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(table.Register(Region{MemoryKind::kHost, -1, nullptr, 8}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(RangeAllocator, HandsOutAlignedRangesAndCoalescesThemWhenFreed) {
  RangeAllocator a(16 * RangeAllocator::kAlign + 100);  // the tail past a page is unusable
  EXPECT_EQ(a.free_bytes(), 16 * RangeAllocator::kAlign);
  auto x = a.Allocate(1);
  auto y = a.Allocate(RangeAllocator::kAlign + 1);
  auto z = a.Allocate(RangeAllocator::kAlign);
  ASSERT_TRUE(x && y && z);
  EXPECT_EQ(*x, 0u);
  EXPECT_EQ(*y, RangeAllocator::kAlign);
  EXPECT_EQ(*z, 3 * RangeAllocator::kAlign);
  EXPECT_EQ(a.used_bytes(), 4 * RangeAllocator::kAlign);
  EXPECT_FALSE(a.Allocate(13 * RangeAllocator::kAlign));
  a.Free(*y, RangeAllocator::kAlign + 1);
  a.Free(*x, 1);
  a.Free(*z, RangeAllocator::kAlign);
  EXPECT_EQ(a.free_bytes(), 16 * RangeAllocator::kAlign);
  EXPECT_EQ(a.used_bytes(), 0u);
  EXPECT_EQ(a.Allocate(16 * RangeAllocator::kAlign), 0u) << "freed ranges merge into one";
}

TEST(SharedSegment, IsMappedByItsHandleAndRefusesBadHandles) {
  auto made = SharedSegment::Create(1 << 16);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  (*made)->data()[100] = 42;
  auto opened = SharedSegment::Open((*made)->handle(), 1 << 16);
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  EXPECT_EQ((*opened)->data()[100], 42);
  (*opened)->data()[200] = 7;  // shared, not copied
  EXPECT_EQ((*made)->data()[200], 7);
  EXPECT_EQ(SharedSegment::Open((*made)->handle(), 1 << 15).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedSegment::Open("memfd:12:x", 1 << 16).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SharedSegment::Open("memfd:999999999:3", 1 << 16).status().code(),
            StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kdn::kvbus
