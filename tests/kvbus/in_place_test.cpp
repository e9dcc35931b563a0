// Landing in place (kdn/kvbus/transport.h; docs/kvbus.md, "Landing in
// place"): a receiver's LandingSite claims offered chunks, whose payloads
// land straight in its extents, verified there. The conformance suite runs
// over it in transport_test.cpp; these are its own cases: which plane
// wrote the bytes, damage, a key claimed twice, a site that refuses what
// arrived, a grant that runs out, a site that names ranges outside its
// region.

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <thread>
#include <zmq.hpp>

#include "kdn/kvbus/wire.h"
#include "kdn/kvbus/region_plane.h"
#include "kdn/common/mutex.h"
#include "kdn/kvbus/device_ops.h"
#include "kdn/kvbus/transport.h"
#include "kdn/testing/recording_store.h"
#include "kdn/testing/chunks.h"

namespace kdn::kvbus {
namespace {

using namespace std::chrono_literals;
using kdn::testing::RecordingStore;
using ChunkPtr = std::shared_ptr<const Chunk>;

constexpr auto kNoHang = std::chrono::milliseconds(20000);

ChunkPtr MakeChunk(uint64_t id, uint32_t tokens = 16) {
  return kdn::testing::MakeChunk(
      ChunkKey{0x1a, id}, id,
      {.layers = 1, .kv_heads = 2, .head_dim = 32, .tokens = tokens, .position = 64});
}

// A site that lands every claimed payload in `pieces` equal extents taken
// from the end of its segment backwards, and records how each claim ended.
class Site final : public LandingSite {
 public:
  explicit Site(uint64_t bytes, int pieces = 4) : pieces_(pieces) {
    segment_ = HostDeviceOps().Allocate(bytes).value();
  }
  std::optional<Landing> Claim(const ChunkKey& key, uint64_t payload) override {
    MutexLock lock(mu_);
    if (!claim_if || !claim_if(key)) return std::nullopt;
    Landing l{next_++, {}};
    const uint64_t piece = (payload + pieces_ - 1) / pieces_;
    for (uint64_t done = 0; done < payload; done += piece) {
      const uint64_t n = std::min(piece, payload - done);
      top_ -= (n + 63) / 64 * 64;
      l.extents.push_back({top_ + bad_offset, n});
    }
    claimed_[l.ticket] = {key, l.extents};
    return l;
  }
  Status Landed(uint64_t ticket, const Result<ChunkInfo>& arrived) override {
    MutexLock lock(mu_);
    ended_[ticket] = arrived.status();
    if (arrived.ok() && accept) return accept(*arrived);
    return Status::Ok();
  }
  // The payload claim `ticket` holds now, gathered.
  std::vector<uint8_t> Gather(uint64_t ticket) {
    MutexLock lock(mu_);
    std::vector<uint8_t> out;
    for (const Extent& x : claimed_[ticket].second) {
      out.insert(out.end(), segment_->data() + x.offset, segment_->data() + x.offset + x.bytes);
    }
    return out;
  }
  std::map<uint64_t, Status> ended() {
    MutexLock lock(mu_);
    return ended_;
  }
  std::map<uint64_t, std::pair<ChunkKey, std::vector<Extent>>> claimed() {
    MutexLock lock(mu_);
    return claimed_;
  }
  const DeviceMemory& segment() const { return *segment_; }

  std::function<bool(const ChunkKey&)> claim_if = [](const ChunkKey&) { return true; };
  std::function<Status(const ChunkInfo&)> accept;
  uint64_t bad_offset = 0;  // added to every extent (to name ranges outside the segment)

 private:
  const int pieces_;
  std::unique_ptr<DeviceMemory> segment_;
  Mutex mu_;
  uint64_t next_ = 1;
  uint64_t top_ = 0;
  std::map<uint64_t, std::pair<ChunkKey, std::vector<Extent>>> claimed_;
  std::map<uint64_t, Status> ended_;

 public:
  void Reset() { top_ = segment_->bytes(); }
};

struct Rig {
  RecordingStore sink;
  Site site{uint64_t{8} << 20};
  std::unique_ptr<Receiver> receiver;
  std::unique_ptr<Sender> sender;

  // `setup` sets the site's policies before the receiver can call it. The
  // site's region is of `landing` kind: shm, or a device region (the host
  // backend standing in for a device), which a kCudaIpc sender writes.
  // `lease` is long enough that no grant runs out on a loaded machine, but
  // for the test of expiry.
  explicit Rig(TransportKind kind, std::function<void(SenderOptions&)> tweak = {},
               std::function<void(Site&)> setup = {}, RegionKind landing = RegionKind::kShm,
               std::chrono::milliseconds lease = 10s) {
    site.Reset();
    if (setup) setup(site);
    ReceiverOptions ro;
    ro.lease = lease;
    ro.heartbeat_interval = 100ms;
    ro.landing = &site;
    ro.landing_region = &site.segment();
    ro.landing_kind = landing;
    receiver = Listen("tcp://127.0.0.1:0", sink, ro).value();
    SenderOptions so;
    so.peer_timeout = 5s;
    so.heartbeat_interval = 100ms;
    so.transport = kind;
    if (kind == TransportKind::kCudaIpc) so.device_ops = &HostDeviceOps();
    if (tweak) tweak(so);
    sender = Connect(receiver->endpoint(), so).value();
  }
  BatchStatus Move(const std::vector<ChunkPtr>& chunks) {
    auto batch = sender->Submit(chunks);
    EXPECT_TRUE(batch.ok());
    auto status = sender->Wait(*batch, kNoHang);
    EXPECT_TRUE(status.ok());
    return *status;
  }
};

std::vector<uint8_t> PayloadOf(const ChunkPtr& c) {
  return {c->payload().begin(), c->payload().end()};
}

TEST(InPlace, TheSenderWritesEveryPayloadIntoItsExtentsOverShm) {
  Rig rig(TransportKind::kShm);
  std::vector<ChunkPtr> chunks;
  for (int i = 0; i < 6; ++i) chunks.push_back(MakeChunk(10 + i));
  ASSERT_TRUE(rig.Move(chunks).ToStatus().ok());
  const auto claimed = rig.site.claimed();
  ASSERT_EQ(claimed.size(), 6u);
  for (const auto& [ticket, claim] : claimed) {
    const auto& key = claim.first;  // a structured binding no lambda captures (clang 14)
    const auto c = std::find_if(chunks.begin(), chunks.end(),
                                [&](const ChunkPtr& x) { return x->key() == key; });
    ASSERT_NE(c, chunks.end());
    EXPECT_EQ(claim.second.size(), 4u);
    EXPECT_EQ(rig.site.Gather(ticket), PayloadOf(*c));
    EXPECT_TRUE(rig.site.ended()[ticket].ok());
  }
  EXPECT_EQ(rig.sink.Stats().puts, 0u) << "claimed chunks never reach the sink";
  const ReceiverStats r = rig.receiver->Stats();
  EXPECT_EQ(r.in_place_claims, 6u);
  EXPECT_EQ(r.in_place_chunks, 6u);
  EXPECT_EQ(r.in_place_plane_chunks, 6u);
  EXPECT_EQ(r.shm_chunks, 6u);
  EXPECT_EQ(r.in_place_bytes, 6 * chunks[0]->payload().size());
  EXPECT_EQ(r.leased_bytes, 0u);
  EXPECT_EQ(rig.sender->Stats().plane("shm").chunks, 6u);
}

// The plane registry (kdn/kvbus/region_plane.h): a plane registered under a
// name of its own (here a second plane over the host backend) is made by
// every sender, offered, and writes the regions a receiver names for it.
Status RegisterTestPlane() {
  static const Status registered =
      RegisterRegionPlane("test_host", [](const SenderOptions&) -> std::unique_ptr<RegionPlane> {
        return std::make_unique<MemoryPlane>("test_host", RegionKind::kShm, HostDeviceOps());
      });
  return registered;
}

TEST(PlaneRegistry, APlaneRegisteredUnderANewNameIsOfferedAndWritesTheRegionsNamedForIt) {
  ASSERT_TRUE(RegisterTestPlane().ok()) << RegisterTestPlane().ToString();
  const std::vector<std::string> names = RegionPlaneNames();
  EXPECT_NE(std::find(names.begin(), names.end(), "test_host"), names.end());
  RecordingStore sink;
  Site site{uint64_t{8} << 20};
  site.Reset();
  ReceiverOptions ro;
  ro.lease = 10s;
  ro.heartbeat_interval = 100ms;
  ro.landing = &site;
  ro.landing_region = &site.segment();
  ro.landing_plane = "test_host";
  auto listening = Listen("tcp://127.0.0.1:0", sink, ro);
  ASSERT_TRUE(listening.ok()) << listening.status().ToString();
  std::unique_ptr<Receiver> receiver = std::move(listening).value();
  SenderOptions so;
  so.peer_timeout = 5s;
  so.heartbeat_interval = 100ms;
  auto connected = Connect(receiver->endpoint(), so);
  ASSERT_TRUE(connected.ok()) << connected.status().ToString();
  std::unique_ptr<Sender> sender = std::move(connected).value();
  std::vector<ChunkPtr> chunks;
  for (int i = 0; i < 4; ++i) chunks.push_back(MakeChunk(40 + i));
  auto batch = sender->Submit(chunks);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  auto st = sender->Wait(*batch, kNoHang);
  ASSERT_TRUE(st.ok() && st->ToStatus().ok())
      << (st.ok() ? st->ToStatus().ToString() : st.status().ToString());
  const auto claimed = site.claimed();
  ASSERT_EQ(claimed.size(), 4u);
  for (const auto& [ticket, claim] : claimed) {
    const auto& key = claim.first;
    const auto c = std::find_if(chunks.begin(), chunks.end(),
                                [&](const ChunkPtr& x) { return x->key() == key; });
    ASSERT_NE(c, chunks.end());
    EXPECT_EQ(site.Gather(ticket), PayloadOf(*c));
  }
  EXPECT_EQ(sender->Stats().plane("test_host").chunks, 4u) << "written by the new plane";
  EXPECT_EQ(sender->Stats().plane("shm").chunks, 0u);
  EXPECT_EQ(sender->Stats().plane("tcp").chunks, 0u);
  const ReceiverStats r = receiver->Stats();
  EXPECT_EQ(r.in_place_plane_chunks, 4u);
  ASSERT_EQ(r.planes.count("test_host"), 1u);
  EXPECT_EQ(r.planes.at("test_host").chunks, 4u);
}

TEST(PlaneRegistry, AnUnknownNameIsRefusedByNameAndATakenOneCannotBeRegistered) {
  RecordingStore sink;
  Site site{uint64_t{1} << 20};
  ReceiverOptions ro;
  ro.landing = &site;
  ro.landing_region = &site.segment();
  ro.landing_plane = "rdma";
  auto refused = Listen("tcp://127.0.0.1:0", sink, ro);
  ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("'rdma'"), std::string::npos)
      << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("shm"), std::string::npos)
      << "names the registered planes: " << refused.status().ToString();
  ro.landing_plane = kCudaIpcPlaneName;  // host memory, which cuda_ipc does not write
  EXPECT_EQ(Listen("tcp://127.0.0.1:0", sink, ro).status().code(), StatusCode::kInvalidArgument);
  const RegionPlaneFactory none = [](const SenderOptions&) { return nullptr; };
  EXPECT_EQ(RegisterRegionPlane("shm", none).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(RegisterRegionPlane("tcp", none).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(RegisterRegionPlane("", none).code(), StatusCode::kInvalidArgument);
}

TEST(InPlace, TheReceiverPutsATcpChunksPayloadInPlace) {
  Rig rig(TransportKind::kTcp);
  const ChunkPtr c = MakeChunk(20);
  ASSERT_TRUE(rig.Move({c}).ToStatus().ok());
  EXPECT_EQ(rig.site.Gather(1), PayloadOf(c));
  const ReceiverStats r = rig.receiver->Stats();
  EXPECT_EQ(r.in_place_chunks, 1u);
  EXPECT_EQ(r.in_place_plane_chunks, 0u);
  EXPECT_EQ(rig.sender->Stats().plane("tcp").chunks, 1u);
}

TEST(InPlace, AReceiverThatTakesNoShmLandsEveryClaimFromTcpFrames) {
  RecordingStore sink;
  Site site(uint64_t{8} << 20);
  site.Reset();
  ReceiverOptions ro;
  ro.landing = &site;
  ro.landing_region = &site.segment();
  ro.landing_by_plane = false;
  auto receiver = Listen("tcp://127.0.0.1:0", sink, ro).value();
  SenderOptions so;
  so.transport = TransportKind::kAuto;  // would write shared memory if granted it
  auto sender = Connect(receiver->endpoint(), so).value();
  const ChunkPtr c = MakeChunk(25);
  auto batch = sender->Submit({c});
  ASSERT_TRUE(batch.ok());
  ASSERT_TRUE(sender->Wait(*batch, kNoHang)->ToStatus().ok());
  EXPECT_EQ(site.Gather(1), PayloadOf(c));
  EXPECT_EQ(receiver->Stats().in_place_chunks, 1u);
  EXPECT_EQ(receiver->Stats().in_place_plane_chunks, 0u);
  EXPECT_EQ(sender->Stats().plane("tcp").chunks, 1u);
}

TEST(InPlace, UnclaimedChunksGoToTheSinkAsBefore) {
  Rig rig(TransportKind::kAuto, {},
          [](Site& site) { site.claim_if = [](const ChunkKey& k) { return k.lo % 2 == 0; }; });
  const std::vector<ChunkPtr> chunks = {MakeChunk(30), MakeChunk(31)};
  ASSERT_TRUE(rig.Move(chunks).ToStatus().ok());
  EXPECT_EQ(rig.receiver->Stats().in_place_chunks, 1u);
  EXPECT_TRUE(rig.sink.Contains(chunks[1]->key()));
  EXPECT_FALSE(rig.sink.Contains(chunks[0]->key()));
}

TEST(InPlace, ADamagedPayloadFailsItsChunkAndTellsTheSite) {
  for (TransportKind kind : {TransportKind::kShm, TransportKind::kTcp}) {
    Rig rig(kind, [](SenderOptions& o) {
      o.faults.corrupt_data = [](const ChunkKey& k) { return k.lo == 41; };
    });
    const BatchStatus bs = rig.Move({MakeChunk(40), MakeChunk(41)});
    ASSERT_TRUE(bs.done);
    EXPECT_EQ(bs.chunks[0].outcome, ChunkOutcome::kSent);
    EXPECT_EQ(bs.chunks[1].outcome, ChunkOutcome::kFailed);
    EXPECT_EQ(bs.chunks[1].status.code(), StatusCode::kCorruption)
        << bs.chunks[1].status.ToString();
    const auto ended = rig.site.ended();
    ASSERT_EQ(ended.size(), 2u);
    int failed = 0;
    for (const auto& [t, st] : ended) failed += st.code() == StatusCode::kCorruption;
    EXPECT_EQ(failed, 1) << TransportKindName(kind);
    EXPECT_EQ(rig.receiver->Stats().chunks_rejected, 1u);
  }
}

TEST(InPlace, AKeyClaimedTwiceLandsTwice) {
  // Two requests on one decode worker with the same prefix each expect its
  // slices in their own blocks.
  Rig rig(TransportKind::kShm);
  const ChunkPtr c = MakeChunk(50);
  auto a = rig.sender->Submit({c});
  auto b = rig.sender->Submit({c});
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(rig.sender->Wait(*a, kNoHang)->ToStatus().ok());
  ASSERT_TRUE(rig.sender->Wait(*b, kNoHang)->ToStatus().ok());
  ASSERT_EQ(rig.site.claimed().size(), 2u);
  EXPECT_EQ(rig.site.Gather(1), PayloadOf(c));
  EXPECT_EQ(rig.site.Gather(2), PayloadOf(c));
  EXPECT_EQ(rig.receiver->Stats().in_place_chunks, 2u);
}

TEST(InPlace, TheSitesVerdictOnWhatArrivedReachesTheSender) {
  Rig rig(TransportKind::kShm, {}, [](Site& site) {
    site.accept = [](const ChunkInfo& info) {
      return info.position == 64 && info.tokens == 8
                 ? Status::Ok()
                 : Corruption("expected 8 tokens at 64, got " + std::to_string(info.tokens));
    };
  });
  const BatchStatus bs = rig.Move({MakeChunk(60, 8), MakeChunk(61, 16)});
  EXPECT_EQ(bs.chunks[0].outcome, ChunkOutcome::kSent);
  EXPECT_EQ(bs.chunks[1].outcome, ChunkOutcome::kFailed);
  EXPECT_NE(bs.chunks[1].status.message().find("expected 8 tokens"), std::string::npos);
}

TEST(InPlace, AGrantThatRunsOutEndsItsClaimWithAnError) {
  Rig rig(
      TransportKind::kShm,
      [](SenderOptions& o) {
        o.faults.withhold_data = [](const ChunkKey&) { return true; };
        o.peer_timeout = 30s;
      },
      {}, RegionKind::kShm, 300ms);
  auto batch = rig.sender->Submit({MakeChunk(70)});
  ASSERT_TRUE(batch.ok());
  const auto deadline = std::chrono::steady_clock::now() + kNoHang;
  while (rig.site.ended().empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(10ms);
  }
  const auto ended = rig.site.ended();
  ASSERT_EQ(ended.size(), 1u);
  EXPECT_EQ(ended.begin()->second.code(), StatusCode::kUnavailable)
      << ended.begin()->second.ToString();
  EXPECT_EQ(rig.receiver->Stats().leases_expired, 1u);
}

TEST(InPlace, ExtentsOutsideTheRegionAreRefusedBeforeAnyByteMoves) {
  Rig rig(TransportKind::kShm, {},
          [](Site& site) { site.bad_offset = uint64_t{64} << 20; });  // past the 8 MiB segment
  const BatchStatus bs = rig.Move({MakeChunk(80)});
  ASSERT_EQ(bs.chunks[0].outcome, ChunkOutcome::kFailed);
  EXPECT_EQ(rig.site.ended().begin()->second.code(), StatusCode::kInternal);
  EXPECT_EQ(rig.receiver->Stats().in_place_chunks, 0u);
}

TEST(InPlace, ALandedHeaderForATcpGrantIsRefusedAndNothingIsRead) {
  // A peer that claims to be on another host gets tcp grants; a landed
  // header for one must not make the receiver read the site's memory.
  Site site(uint64_t{1} << 20);
  site.Reset();
  RecordingStore sink;
  ReceiverOptions ro;
  ro.landing = &site;
  ro.landing_region = &site.segment();
  auto receiver = Listen("tcp://127.0.0.1:0", sink, ro).value();
  zmq::context_t ctx(1);
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(receiver->endpoint());
  const ChunkPtr c = MakeChunk(90);
  WireOffer offer{5, {{c->key(), c->size()}}, {kShmPlaneName}, "host:elsewhere"};
  dealer.send(EncodeWire(offer).value(), zmq::send_flags::none);
  zmq::message_t reply;
  ASSERT_TRUE(dealer.recv(reply).has_value());
  auto decisions = std::get<WireDecisions>(DecodeWire(reply.data(), reply.size()).value());
  ASSERT_EQ(decisions.decisions.size(), 1u);
  EXPECT_TRUE(decisions.decisions[0].in_place);
  EXPECT_EQ(decisions.decisions[0].region, 0u) << "another host: no region to write";
  WireChunkHeader h{
      5, c->key(), c->size(), /*landed=*/true,
      std::string(reinterpret_cast<const char*>(c->bytes().data()), Chunk::kHeaderBytes)};
  dealer.send(EncodeWire(h).value(), zmq::send_flags::none);
  ASSERT_TRUE(dealer.recv(reply).has_value());
  auto acks = std::get<WireAcks>(DecodeWire(reply.data(), reply.size()).value());
  ASSERT_EQ(acks.acks.size(), 1u);
  EXPECT_EQ(acks.acks[0].status.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(site.ended().begin()->second.code(), StatusCode::kFailedPrecondition);
}

TEST(InPlace, ASiteNeedsItsRegion) {
  Site site(uint64_t{1} << 20);
  RecordingStore sink;
  ReceiverOptions ro;
  ro.landing = &site;
  EXPECT_EQ(Listen("tcp://127.0.0.1:0", sink, ro).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kdn::kvbus
