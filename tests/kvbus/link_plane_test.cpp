// The nccl plane on the CPU (docs/kvbus.md, "Device planes"): the host
// backend's link (a loopback socket) stands in for NCCL, so the plane's
// whole code path runs here: the sender joining a link and naming it in
// its offers, the receiver joining it and granting claimed chunks into its
// device region, each payload sent over the link and received onto the
// claimed extents, verified there through the backend. The link alone,
// the conformance suite over the plane, then its own cases. ctest label
// device_plane (tests/CMakeLists.txt).

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <optional>
#include <set>
#include <thread>

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

// `o` over the nccl plane, the host backend's link standing in for NCCL.
SenderOptions OverLink(SenderOptions o) {
  o.transport = TransportKind::kNccl;
  o.device_ops = &HostDeviceOps();
  return o;
}

Result<std::unique_ptr<Receiver>> DeviceLanding(ChunkStore& sink, const ReceiverOptions& o) {
  return InPlaceReceiver::Listen(sink, o, LandingSegmentBytes(o), RegionKind::kDevice);
}

// The suite with every claimed payload sent over the link onto the landing
// site's device region; what the site does not claim goes as auto sends it.
INSTANTIATE_TEST_SUITE_P(
    DevicePlaneNccl, TransportConformance,
    ::testing::Values(TransportFactory{"nccl_host_in_place", DeviceLanding,
                                       [](const std::string& endpoint, SenderOptions o) {
                                         return Connect(endpoint, OverLink(o));
                                       }},
                      TransportFactory{"nccl_host_sourced_in_place", DeviceLanding,
                                       [](const std::string& endpoint, SenderOptions o) {
                                         return SourcingSender::Connect(endpoint, OverLink(o));
                                       }}),
    TransportFactoryName);

// ---- the host link alone ----------------------------------------------------

struct LinkPair {
  std::unique_ptr<DeviceLink> send, recv;
  explicit LinkPair(std::chrono::milliseconds timeout = 5s) {
    DeviceOps& ops = HostDeviceOps();
    const std::string id = ops.NewLinkId().value();
    send = ops.JoinLink(id, 0, timeout).value();
    recv = ops.JoinLink(id, 1, timeout).value();
  }
};

TEST(DevicePlaneLink, TheHostLinkCarriesMessagesInOrderOntoExtents) {
  LinkPair link;
  // Larger than any socket buffer, so both ends wait on each other.
  std::vector<uint8_t> big(24 << 20);
  std::iota(big.begin(), big.end(), uint8_t{3});
  std::vector<uint8_t> small(1000, 0xab);
  Status sent;
  std::thread sender([&] {
    const std::vector<Extent> from = {{4096, big.size() - 4096}, {0, 4096}};
    sent = link.send->Send(big.data(), from);
    const Extent whole{0, small.size()};
    if (sent.ok()) sent = link.send->Send(small.data(), {&whole, 1});
    const Extent none{0, 0};
    if (sent.ok()) sent = link.send->Send(small.data(), {&none, 1});
  });
  std::vector<uint8_t> got(big.size() + 64, 0);
  const std::vector<Extent> onto = {{64, big.size()}};
  KDN_ASSERT_OK(link.recv->Recv(got.data(), onto));
  EXPECT_EQ(std::memcmp(got.data() + 64, big.data() + 4096, big.size() - 4096), 0);
  EXPECT_EQ(std::memcmp(got.data() + 64 + big.size() - 4096, big.data(), 4096), 0);
  const std::vector<Extent> split = {{10, 400}, {2000, 600}};
  KDN_ASSERT_OK(link.recv->Recv(got.data(), split));
  EXPECT_EQ(got[10], 0xab);
  EXPECT_EQ(got[2599], 0xab);
  KDN_ASSERT_OK(link.recv->Recv(got.data(), {}));
  sender.join();
  KDN_ASSERT_OK(sent);
  EXPECT_EQ(link.recv->Send(got.data(), {}).code(), StatusCode::kFailedPrecondition)
      << "rank 1 only receives";
}

TEST(DevicePlaneLink, AMessageOfTheWrongSizeAbortsTheLink) {
  LinkPair link;
  std::vector<uint8_t> bytes(100, 1);
  const Extent whole{0, 100};
  KDN_ASSERT_OK(link.send->Send(bytes.data(), {&whole, 1}));  // fits the socket buffer
  const Extent more{0, 101};
  EXPECT_EQ(link.recv->Recv(bytes.data(), {&more, 1}).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(link.recv->aborted());
  EXPECT_EQ(link.recv->Recv(bytes.data(), {&whole, 1}).code(), StatusCode::kFailedPrecondition);
  // The peer sees the link gone at its next message.
  Status st;
  for (int i = 0; i < 100 && st.ok(); ++i) st = link.send->Send(bytes.data(), {&whole, 1});
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(link.send->aborted());
}

TEST(DevicePlaneLink, ASilentOrMissingPeerIsADeadlineOrAClearError) {
  DeviceOps& ops = HostDeviceOps();
  {
    LinkPair link(200ms);
    uint8_t b = 0;
    const Extent one{0, 1};
    EXPECT_EQ(link.recv->Recv(&b, {&one, 1}).code(), StatusCode::kDeadlineExceeded);
    EXPECT_TRUE(link.recv->aborted());
  }
  {
    // Nobody joins: rank 0's first message waits for the join, then gives up.
    const std::string id = ops.NewLinkId().value();
    auto alone = ops.JoinLink(id, 0, 200ms).value();
    uint8_t b = 0;
    const Extent one{0, 1};
    EXPECT_EQ(alone->Send(&b, {&one, 1}).code(), StatusCode::kDeadlineExceeded);
  }
  {
    // A peer that goes away mid-link.
    LinkPair link;
    link.send.reset();
    uint8_t b = 0;
    const Extent one{0, 1};
    EXPECT_FALSE(link.recv->Recv(&b, {&one, 1}).ok());
  }
  const std::string id = ops.NewLinkId().value();
  EXPECT_EQ(ops.JoinLink(id, 2, 1s).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ops.JoinLink("host-link:x:y", 1, 1s).status().code(), StatusCode::kInvalidArgument);
  KDN_ASSERT_OK(ops.JoinLink(id, 0, 1s).status());
  EXPECT_EQ(ops.JoinLink(id, 0, 1s).status().code(), StatusCode::kInvalidArgument)
      << "rank 0 of a link is joined once";
}

TEST(DevicePlaneLink, APeerWithoutTheTokenIsRefused) {
  DeviceOps& ops = HostDeviceOps();
  const std::string id = ops.NewLinkId().value();
  auto send = ops.JoinLink(id, 0, 2s).value();
  // The same port, another token.
  std::string forged = id;
  forged.back() = forged.back() == '0' ? '1' : '0';
  auto intruder = ops.JoinLink(forged, 1, 2s).value();
  uint8_t b = 7;
  const Extent one{0, 1};
  EXPECT_EQ(send->Send(&b, {&one, 1}).code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(send->aborted());
}

// ---- the plane in the transport ---------------------------------------------

SenderOptions LinkSender() {
  SenderOptions o;
  o.peer_timeout = 5s;
  o.heartbeat_interval = 100ms;
  return OverLink(o);
}

TEST(DevicePlaneNcclCases, ClaimedPayloadsGoOverTheLinkTheRestAsAuto) {
  PlaneRig rig(RegionKind::kDevice, LinkSender());
  const std::vector<ChunkPtr> chunks = MakeChunks(10, 6, 16);
  KDN_ASSERT_OK(rig.Move(chunks).ToStatus());
  for (const ChunkPtr& c : chunks) EXPECT_TRUE(rig.sink.Contains(c->key()));
  const ReceiverStats r = rig.receiver->Stats();
  EXPECT_EQ(r.in_place_chunks, 6u);
  EXPECT_EQ(r.in_place_plane_chunks, 6u);
  ASSERT_EQ(r.planes.count("nccl"), 1u);
  EXPECT_EQ(r.planes.at("nccl").chunks, 6u);
  EXPECT_EQ(r.planes.count("cuda_ipc"), 0u) << "a nccl sender maps no device region";
  const SenderStats s = rig.sender->Stats();
  EXPECT_EQ(s.plane("nccl").chunks, 6u);
  EXPECT_EQ(s.plane("nccl").bytes, 6 * chunks[0]->size());
  EXPECT_EQ(s.planes.count("tcp"), 0u);
}

TEST(DevicePlaneNcclCases, AClaimOutsideADeviceRegionOrWithoutTheLinkFails) {
  {
    PlaneRig rig(RegionKind::kShm, LinkSender());
    const BatchStatus bs = rig.Move({MakeChunk(30, 16)});
    ASSERT_EQ(bs.chunks[0].outcome, ChunkOutcome::kFailed);
    EXPECT_EQ(bs.chunks[0].status.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(bs.chunks[0].status.message().find("outside a device region"), std::string::npos)
        << bs.chunks[0].status.ToString();
  }
  {
    // A receiver whose senders may not write its region (a decode worker
    // with --kv-transport tcp) joins no link.
    ReceiverOptions ro = TestReceiverOptions();
    ro.landing_by_plane = false;
    PlaneRig rig(RegionKind::kDevice, LinkSender(), ro);
    const BatchStatus bs = rig.Move({MakeChunk(31, 16)});
    ASSERT_EQ(bs.chunks[0].outcome, ChunkOutcome::kFailed);
    EXPECT_EQ(bs.chunks[0].status.code(), StatusCode::kFailedPrecondition)
        << bs.chunks[0].status.ToString();
  }
  SenderOptions none = LinkSender();
  none.device_ops = nullptr;
  EXPECT_EQ(Connect("tcp://127.0.0.1:9", none).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseTransportKind("nccl").value(), TransportKind::kNccl);
}

TEST(DevicePlaneNcclCases, ADamagedPayloadIsCaughtWhereItLandedAndTheLinkServesOn) {
  SenderOptions so = LinkSender();
  so.faults.corrupt_data = [](const ChunkKey& k) { return k.lo == 41; };
  PlaneRig rig(RegionKind::kDevice, so);
  const BatchStatus bs = rig.Move({MakeChunk(40, 16), MakeChunk(41, 16), MakeChunk(42, 16)});
  EXPECT_EQ(bs.chunks[0].outcome, ChunkOutcome::kSent);
  ASSERT_EQ(bs.chunks[1].outcome, ChunkOutcome::kFailed);
  EXPECT_EQ(bs.chunks[1].status.code(), StatusCode::kCorruption) << bs.chunks[1].status.ToString();
  EXPECT_EQ(bs.chunks[2].outcome, ChunkOutcome::kSent);
  EXPECT_FALSE(rig.sink.Contains(MakeChunk(41, 16)->key()));
  EXPECT_EQ(rig.sender->Stats().plane("nccl").chunks, 2u);
}

// A sourced chunk goes over the link from where it lies.
TEST(DevicePlaneNcclCases, ASourcedChunkIsSentFromWhereItLies) {
  const ChunkPtr c = MakeChunk(70, 16);
  KDN_ASSERT_OK_AND_ASSIGN(auto pool, HostDeviceOps().Allocate(1 << 16));
  const uint64_t n = c->payload().size();
  std::copy_n(c->payload().data(), n / 2, pool->data() + 8192);
  std::copy_n(c->payload().data() + n / 2, n - n / 2, pool->data() + 512);
  KDN_ASSERT_OK_AND_ASSIGN(SourcedChunk s,
                           MakeSourcedChunk(c->info(), *pool, {{8192, n / 2}, {512, n - n / 2}}));
  PlaneRig rig(RegionKind::kDevice, LinkSender());
  KDN_ASSERT_OK_AND_ASSIGN(uint64_t batch, rig.sender->SubmitSourced({s}));
  KDN_ASSERT_OK_AND_ASSIGN(BatchStatus st, rig.sender->Wait(batch, kNoHang));
  KDN_ASSERT_OK(st.ToStatus());
  KDN_ASSERT_OK_AND_ASSIGN(auto got, rig.sink.Get(c->key()));
  EXPECT_TRUE(std::equal(got->bytes().begin(), got->bytes().end(), c->bytes().begin()));
  EXPECT_EQ(rig.sender->Stats().plane("nccl").chunks, 1u);
}

// A link that fails (here: a receiver whose extents do not hold the
// message) is dropped at both ends: the receiver says so in the chunk's
// ack, and the sender's next offers name a new link, of a new id, over
// which the next chunk goes.
TEST(DevicePlaneNcclCases, AFailedLinkIsReplacedByANewOneOfANewId) {
  StandInReceiver r;
  KDN_ASSERT_OK_AND_ASSIGN(auto sender, Connect(r.endpoint, LinkSender()));
  const ChunkPtr first = MakeChunk(80, 16), second = MakeChunk(81, 16);
  const uint64_t n = first->payload().size();
  std::vector<uint8_t> region(4 * n);
  std::set<std::string> links;
  std::string joined;  // the id of `link`
  std::unique_ptr<DeviceLink> link;
  // Offers of one chunk each: join the link named, grant the chunk in
  // place, receive its payload over the link onto `extents`, ack.
  const auto serve = [&](uint64_t batch, const ChunkPtr& c, std::vector<Extent> extents) {
    for (int i = 0; i < 200; ++i) {
      auto m = r.Next();
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      if (auto* o = std::get_if<WireOffer>(&*m)) {
        if (o->batch != batch) continue;  // a repeated offer of a batch done with
        ASSERT_FALSE(o->link.empty());
        if (links.insert(o->link).second) {
          KDN_ASSERT_OK_AND_ASSIGN(link, HostDeviceOps().JoinLink(o->link, 1, 2s));
          joined = o->link;
        }
        WireDecision grant{c->key(), WireDecisionKind::kGranted, Status::Ok()};
        grant.region = 7;
        grant.in_place = true;
        grant.extents = {{0, n}};
        WireDecisions d{o->batch, {grant}, {}};
        d.regions.push_back(WireRegion{7, region.size(), "memfd:1:999999", kCudaIpcPlaneName});
        r.Reply(d);
      } else if (auto* h = std::get_if<WireChunkHeader>(&*m)) {
        EXPECT_TRUE(h->landed && h->linked);
        const Status got = link->Recv(region.data(), extents);
        WireAck ack{h->batch, h->key, got, false};
        if (!got.ok()) ack.dropped_link = joined;  // as a kvbus receiver tells it
        if (got.ok() && std::memcmp(region.data(), c->payload().data(), n) != 0) {
          ack.status = Corruption("not the payload");
        }
        r.Reply(WireAcks{{ack}});
        return;
      } else if (auto* p = std::get_if<WirePing>(&*m)) {
        r.Reply(WirePong{p->seq, {}});
      }
    }
    FAIL() << "no header came";
  };
  KDN_ASSERT_OK_AND_ASSIGN(uint64_t b1, sender->Submit({first}));
  serve(b1, first, {{0, n + 1}});  // one byte more than the message: the link aborts
  KDN_ASSERT_OK_AND_ASSIGN(BatchStatus st1, sender->Wait(b1, 5s));
  ASSERT_TRUE(st1.done);
  EXPECT_EQ(st1.chunks[0].outcome, ChunkOutcome::kFailed);
  KDN_ASSERT_OK_AND_ASSIGN(uint64_t b2, sender->Submit({second}));
  serve(b2, second, {{0, n}});
  KDN_ASSERT_OK_AND_ASSIGN(BatchStatus st2, sender->Wait(b2, 5s));
  ASSERT_TRUE(st2.done);
  KDN_ASSERT_OK(st2.ToStatus());
  EXPECT_EQ(links.size(), 2u) << "the second chunk went over a new link";
}

// A receiver that cannot join the link its sender names says so in its
// decisions; the sender names a new link at once, in an offer of no chunks.
TEST(DevicePlaneNcclCases, ALinkTheReceiverCouldNotJoinIsReplaced) {
  StandInReceiver r;
  KDN_ASSERT_OK_AND_ASSIGN(auto sender, Connect(r.endpoint, LinkSender()));
  KDN_ASSERT_OK_AND_ASSIGN(uint64_t batch, sender->Submit({MakeChunk(95, 16)}));
  (void)batch;
  std::string first;
  for (int i = 0; i < 200; ++i) {
    auto m = r.Next();
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    auto* o = std::get_if<WireOffer>(&*m);
    if (o == nullptr) {
      if (auto* p = std::get_if<WirePing>(&*m)) r.Reply(WirePong{p->seq, {}});
      continue;
    }
    ASSERT_FALSE(o->link.empty());
    if (first.empty()) {
      first = o->link;
      r.Reply(WireDecisions{0, {}, {}, first});  // as a receiver that failed to join it
      continue;
    }
    if (o->link == first) continue;  // a repeat sent before the sender heard
    EXPECT_EQ(o->batch, 0u) << "named at once, in an offer of no chunks";
    EXPECT_TRUE(o->entries.empty());
    return;
  }
  FAIL() << "no offer named a new link";
}

// A linked chunk whose grant is gone (it expired) finds nothing to take
// its payload off the link: the receiver drops the link and says so in
// the chunk's ack, rather than read the next chunk's bytes out of step.
// Played by hand against a real receiver: a DEALER speaking the wire, and
// a link this test made.
TEST(DevicePlaneNcclCases, ALinkedChunkWithoutItsGrantDropsTheLink) {
  RecordingStore sink;
  ReceiverOptions ro = TestReceiverOptions();
  ro.lease = 100ms;
  KDN_ASSERT_OK_AND_ASSIGN(
      auto receiver, InPlaceReceiver::Listen(sink, ro, uint64_t{8} << 20, RegionKind::kDevice));
  DeviceOps& ops = HostDeviceOps();
  KDN_ASSERT_OK_AND_ASSIGN(std::string id, ops.NewLinkId());
  KDN_ASSERT_OK_AND_ASSIGN(auto link, ops.JoinLink(id, 0, 2s));
  zmq::context_t ctx;
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.set(zmq::sockopt::rcvtimeo, 5000);
  dealer.connect(receiver->endpoint());
  const auto send = [&](const WireMessage& m) {
    auto frame = EncodeWire(m);
    ASSERT_TRUE(frame.ok());
    dealer.send(*frame, zmq::send_flags::none);
  };
  // The next message of type T from the receiver.
  const auto next = [&]<typename T>() -> std::optional<T> {
    for (int i = 0; i < 50; ++i) {
      zmq::message_t frame;
      if (!dealer.recv(frame)) return std::nullopt;
      auto m = DecodeWire(frame.data(), frame.size());
      if (m.ok() && std::holds_alternative<T>(*m)) return std::get<T>(*m);
    }
    return std::nullopt;
  };
  const ChunkPtr c = MakeChunk(90, 16);
  WireOffer offer{1, {{c->key(), c->size()}}, {}, HostId(), id};
  send(offer);
  const auto decisions = next.operator()<WireDecisions>();
  ASSERT_TRUE(decisions.has_value());
  ASSERT_EQ(decisions->decisions.size(), 1u);
  EXPECT_TRUE(decisions->decisions[0].in_place);
  EXPECT_NE(decisions->decisions[0].region, 0u) << "granted into the region: the link is joined";
  std::this_thread::sleep_for(300ms);  // the grant expires (lease 100 ms)
  WireChunkHeader h{1, c->key(), c->size(), /*landed=*/true, {}, /*linked=*/true};
  h.header.assign(reinterpret_cast<const char*>(c->bytes().data()), Chunk::kHeaderBytes);
  send(h);
  const Extent whole{0, c->payload().size()};
  (void)link->Send(c->payload().data(), {&whole, 1});  // taken by no one
  const auto acks = next.operator()<WireAcks>();
  ASSERT_TRUE(acks.has_value());
  ASSERT_EQ(acks->acks.size(), 1u);
  EXPECT_EQ(acks->acks[0].status.code(), StatusCode::kFailedPrecondition)
      << acks->acks[0].status.ToString();
  EXPECT_EQ(acks->acks[0].dropped_link, id);
  EXPECT_FALSE(sink.Contains(c->key()));
  // Named again, the dropped link is not joined: the chunk is granted for tcp.
  offer.batch = 2;
  send(offer);
  const auto again = next.operator()<WireDecisions>();
  ASSERT_TRUE(again.has_value());
  ASSERT_EQ(again->decisions.size(), 1u);
  EXPECT_EQ(again->decisions[0].region, 0u);
}

}  // namespace
}  // namespace kdn::kvbus
