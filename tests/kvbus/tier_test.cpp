// Tests for the storage tiers: HostTier (memory, pins with leases), DiskTier
// (files, verified on read) and TieredStore (promotion, demotion, lookups).
// Time is a fake clock; nothing sleeps.

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/disk_tier.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/tiered_store.h"
#include "kdn/testing/temp_dir.h"
#include "kdn/testing/chunks.h"

namespace kdn::kvbus {
namespace {

namespace fs = std::filesystem;
using kdn::testing::TempDir;
using std::chrono::milliseconds;

constexpr uint32_t kTokens = 4;
// 128-byte header + 1 layer * (K,V) * 4 tokens * 1 head * 4 dims * 4 bytes.
constexpr uint64_t kChunkBytes = Chunk::kHeaderBytes + 2 * kTokens * 4 * 4;

ChunkKey KeyOf(uint64_t id) {
  // Spread over the high digits too, so the disk tier's subfolders vary.
  return ChunkKey{id * 0x9e3779b97f4a7c15ull, id};
}

// A small f32 chunk (1 layer, 1 kv head, head_dim 4) whose payload depends
// on `id`.
std::shared_ptr<const Chunk> MakeChunk(uint64_t id, uint32_t tokens = kTokens) {
  return kdn::testing::MakeChunk(
      KeyOf(id), id,
      {.layers = 1, .kv_heads = 1, .head_dim = 4, .tokens = tokens, .model = ChunkKey{7, 7}});
}

std::vector<uint8_t> BytesOf(const Chunk& c) { return {c.bytes().begin(), c.bytes().end()}; }

// A clock the test moves by hand.
class FakeClock {
 public:
  HostTier::Clock AsClock() const {
    return [now = now_] { return *now; };
  }
  void Advance(milliseconds d) { *now_ += d; }

 private:
  std::shared_ptr<HostTier::TimePoint> now_ =
      std::make_shared<HostTier::TimePoint>(std::chrono::hours(1));
};

std::unique_ptr<DiskTier> OpenDisk(const fs::path& dir, uint64_t capacity) {
  auto disk = DiskTier::Open(dir, capacity);
  EXPECT_TRUE(disk.ok()) << disk.status().ToString();
  return disk.ok() ? std::move(disk).value() : nullptr;
}

// ---------------------------------------------------------------- HostTier

TEST(HostTier, EvictsLeastRecentlyUsedWhenFull) {
  HostTier host(3 * kChunkBytes);
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(host.Put(MakeChunk(id)).ok());
  EXPECT_FALSE(host.Contains(KeyOf(1)));
  for (uint64_t id = 2; id <= 4; ++id) EXPECT_TRUE(host.Contains(KeyOf(id)));
  const TierStats s = host.Stats();
  EXPECT_EQ(s.chunks, 3u);
  EXPECT_EQ(s.bytes, 3 * kChunkBytes);
  EXPECT_EQ(s.capacity_bytes, 3 * kChunkBytes);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.puts, 4u);
}

TEST(HostTier, GetRefreshesRecency) {
  HostTier host(3 * kChunkBytes);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(host.Put(MakeChunk(id)).ok());
  ASSERT_TRUE(host.Get(KeyOf(1)).ok());
  ASSERT_TRUE(host.Put(MakeChunk(4)).ok());
  EXPECT_TRUE(host.Contains(KeyOf(1)));
  EXPECT_FALSE(host.Contains(KeyOf(2)));
}

TEST(HostTier, GetOfAnAbsentChunkIsANotFoundMiss) {
  HostTier host(0);
  EXPECT_EQ(host.Get(KeyOf(1)).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  auto got = host.Get(KeyOf(1));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(BytesOf(**got), BytesOf(*MakeChunk(1)));
  EXPECT_EQ(host.Stats().hits, 1u);
  EXPECT_EQ(host.Stats().misses, 1u);
}

TEST(HostTier, PutOfAHeldKeyKeepsOneCopyAndMakesItMostRecent) {
  HostTier host(3 * kChunkBytes);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(host.Put(MakeChunk(id)).ok());
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  EXPECT_EQ(host.Stats().chunks, 3u);
  EXPECT_EQ(host.Stats().puts, 3u);
  ASSERT_TRUE(host.Put(MakeChunk(4)).ok());
  EXPECT_TRUE(host.Contains(KeyOf(1)));
  EXPECT_FALSE(host.Contains(KeyOf(2)));
}

TEST(HostTier, PinnedChunkIsNeverEvicted) {
  HostTier host(3 * kChunkBytes);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(host.Put(MakeChunk(id)).ok());
  auto pin = host.Pin(KeyOf(1), milliseconds(60'000));
  ASSERT_TRUE(pin.ok());
  EXPECT_NE(*pin, 0u);
  ASSERT_TRUE(host.Get(KeyOf(2)).ok());
  ASSERT_TRUE(host.Get(KeyOf(3)).ok());  // 1 is now least recent, but pinned
  ASSERT_TRUE(host.Put(MakeChunk(4)).ok());
  ASSERT_TRUE(host.Put(MakeChunk(5)).ok());
  EXPECT_TRUE(host.Contains(KeyOf(1)));
  EXPECT_FALSE(host.Contains(KeyOf(2)));
  EXPECT_FALSE(host.Contains(KeyOf(3)));
  // Unpinned, it is the least recent again and goes next.
  ASSERT_TRUE(host.Unpin(*pin).ok());
  ASSERT_TRUE(host.Put(MakeChunk(6)).ok());
  EXPECT_FALSE(host.Contains(KeyOf(1)));
}

TEST(HostTier, ChunkWithTwoPinsStaysProtectedUntilBothAreGone) {
  HostTier host(2 * kChunkBytes);
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  auto a = host.Pin(KeyOf(1), milliseconds(1000));
  auto b = host.Pin(KeyOf(1), milliseconds(1000));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  ASSERT_TRUE(host.Unpin(*a).ok());
  ASSERT_TRUE(host.Put(MakeChunk(2)).ok());
  ASSERT_TRUE(host.Put(MakeChunk(3)).ok());
  EXPECT_TRUE(host.Contains(KeyOf(1)));
  ASSERT_TRUE(host.Unpin(*b).ok());
  ASSERT_TRUE(host.Put(MakeChunk(4)).ok());
  ASSERT_TRUE(host.Put(MakeChunk(5)).ok());
  EXPECT_FALSE(host.Contains(KeyOf(1)));
}

TEST(HostTier, ExpiredPinStopsProtecting) {
  FakeClock clock;
  HostTier host(3 * kChunkBytes, clock.AsClock());
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(host.Put(MakeChunk(id)).ok());
  auto pin = host.Pin(KeyOf(1), milliseconds(100));
  ASSERT_TRUE(pin.ok());
  ASSERT_TRUE(host.Get(KeyOf(2)).ok());
  ASSERT_TRUE(host.Get(KeyOf(3)).ok());  // order: 3, 2, 1 (pinned)
  clock.Advance(milliseconds(99));
  ASSERT_TRUE(host.Put(MakeChunk(4)).ok());  // lease still running: 2 goes
  EXPECT_TRUE(host.Contains(KeyOf(1)));
  EXPECT_FALSE(host.Contains(KeyOf(2)));
  EXPECT_EQ(host.PinCount(), 1u);
  clock.Advance(milliseconds(1));  // the lease has run out
  ASSERT_TRUE(host.Put(MakeChunk(5)).ok());
  EXPECT_FALSE(host.Contains(KeyOf(1)));
  EXPECT_EQ(host.PinCount(), 0u);
  EXPECT_EQ(host.Unpin(*pin).code(), StatusCode::kNotFound);
}

TEST(HostTier, ExpirePinsDropsOnlyLapsedLeases) {
  FakeClock clock;
  HostTier host(0, clock.AsClock());
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  ASSERT_TRUE(host.Pin(KeyOf(1), milliseconds(10)).ok());
  ASSERT_TRUE(host.Pin(KeyOf(1), milliseconds(20)).ok());
  ASSERT_TRUE(host.Pin(KeyOf(1), milliseconds(30)).ok());
  clock.Advance(milliseconds(20));
  EXPECT_EQ(host.ExpirePins(), 2u);
  EXPECT_EQ(host.ExpirePins(), 0u);
  EXPECT_EQ(host.PinCount(), 1u);
}

TEST(HostTier, RenewSetsTheLeaseFromNow) {
  FakeClock clock;
  HostTier host(0, clock.AsClock());
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  auto pin = host.Pin(KeyOf(1), milliseconds(100));
  ASSERT_TRUE(pin.ok());
  clock.Advance(milliseconds(90));
  ASSERT_TRUE(host.Renew(*pin, milliseconds(100)).ok());
  clock.Advance(milliseconds(90));  // 180 ms after pinning, 90 after renewing
  EXPECT_EQ(host.PinCount(), 1u);
  clock.Advance(milliseconds(10));
  EXPECT_EQ(host.PinCount(), 0u);
  EXPECT_EQ(host.Renew(*pin, milliseconds(100)).code(), StatusCode::kNotFound);
}

TEST(HostTier, UnpinAndRenewOfAnUnknownPinReturnNotFound) {
  HostTier host(0);
  EXPECT_EQ(host.Unpin(42).code(), StatusCode::kNotFound);
  EXPECT_EQ(host.Renew(42, milliseconds(10)).code(), StatusCode::kNotFound);
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  auto pin = host.Pin(KeyOf(1), milliseconds(10));
  ASSERT_TRUE(pin.ok());
  ASSERT_TRUE(host.Unpin(*pin).ok());
  EXPECT_EQ(host.Unpin(*pin).code(), StatusCode::kNotFound);
}

TEST(HostTier, PinOfAnAbsentChunkOrWithoutALeaseIsRefused) {
  HostTier host(0);
  EXPECT_EQ(host.Pin(KeyOf(1), milliseconds(10)).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  EXPECT_EQ(host.Pin(KeyOf(1), milliseconds(0)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(host.PinCount(), 0u);
}

TEST(HostTier, PinWithAnEndlessLeaseDoesNotOverflowTheClock) {
  HostTier host(0);
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  ASSERT_TRUE(host.Pin(KeyOf(1), milliseconds::max()).ok());
  EXPECT_EQ(host.PinCount(), 1u);
}

TEST(HostTier, PutIntoAFullyPinnedTierFailsAndChangesNothing) {
  HostTier host(2 * kChunkBytes);
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  ASSERT_TRUE(host.Put(MakeChunk(2)).ok());
  ASSERT_TRUE(host.Pin(KeyOf(1), milliseconds(1000)).ok());
  ASSERT_TRUE(host.Pin(KeyOf(2), milliseconds(1000)).ok());
  const TierStats before = host.Stats();
  EXPECT_EQ(host.Put(MakeChunk(3)).code(), StatusCode::kResourceExhausted);
  const TierStats after = host.Stats();
  EXPECT_EQ(after.chunks, before.chunks);
  EXPECT_EQ(after.bytes, before.bytes);
  EXPECT_EQ(after.evictions, 0u);
  EXPECT_EQ(after.puts, before.puts);
  EXPECT_TRUE(host.Contains(KeyOf(1)));
  EXPECT_TRUE(host.Contains(KeyOf(2)));
  EXPECT_FALSE(host.Contains(KeyOf(3)));
}

TEST(HostTier, PutThatPinsLeaveNoRoomForEvictsNothing) {
  HostTier host(3 * kChunkBytes);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(host.Put(MakeChunk(id)).ok());
  ASSERT_TRUE(host.Pin(KeyOf(1), milliseconds(1000)).ok());
  ASSERT_TRUE(host.Pin(KeyOf(2), milliseconds(1000)).ok());
  // Twice the size: evicting chunk 3 alone would not make room.
  EXPECT_EQ(host.Put(MakeChunk(9, 3 * kTokens)).code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(host.Contains(KeyOf(3)));
  EXPECT_EQ(host.Stats().evictions, 0u);
}

// A pinned prompt prefix (ChunkStore::Keep): kept before its chunk arrives,
// through eviction pressure, until its deadline.
TEST(HostTier, AKeyKeptBeforeItsChunkArrivesIsKeptUntilItsDeadline) {
  FakeClock clock;
  HostTier host(3 * kChunkBytes, clock.AsClock());
  const std::vector<ChunkKey> kept = {KeyOf(1)};
  auto n = host.Keep(kept, milliseconds(1000));
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 1u);
  EXPECT_EQ(host.KeptCount(), 1u);
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  for (uint64_t id = 2; id <= 8; ++id) ASSERT_TRUE(host.Put(MakeChunk(id)).ok());
  EXPECT_TRUE(host.Contains(KeyOf(1)));
  EXPECT_EQ(host.Stats().chunks, 3u);
  clock.Advance(milliseconds(999));
  ASSERT_TRUE(host.Put(MakeChunk(9)).ok());
  EXPECT_TRUE(host.Contains(KeyOf(1)));
  clock.Advance(milliseconds(1));  // the deadline: evictable again, least recent
  EXPECT_EQ(host.KeptCount(), 0u);
  ASSERT_TRUE(host.Put(MakeChunk(10)).ok());
  EXPECT_FALSE(host.Contains(KeyOf(1)));
}

TEST(HostTier, KeepingAgainKeepsTheLaterDeadlineAndAZeroLeaseLetsGo) {
  FakeClock clock;
  HostTier host(2 * kChunkBytes, clock.AsClock());
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  const std::vector<ChunkKey> kept = {KeyOf(1)};
  ASSERT_TRUE(host.Keep(kept, milliseconds(1000)).ok());
  ASSERT_TRUE(host.Keep(kept, milliseconds(10)).ok());  // the 1000 ms stands
  clock.Advance(milliseconds(500));
  ASSERT_TRUE(host.Put(MakeChunk(2)).ok());
  ASSERT_TRUE(host.Put(MakeChunk(3)).ok());
  EXPECT_TRUE(host.Contains(KeyOf(1)));
  // A pin on a kept chunk outlives the keep; letting the key go leaves it.
  auto pin = host.Pin(KeyOf(1), milliseconds(60'000));
  ASSERT_TRUE(pin.ok());
  auto none = host.Keep(kept, milliseconds(0));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(host.KeptCount(), 0u);
  ASSERT_TRUE(host.Put(MakeChunk(4)).ok());
  EXPECT_TRUE(host.Contains(KeyOf(1)));
  ASSERT_TRUE(host.Unpin(*pin).ok());
  ASSERT_TRUE(host.Put(MakeChunk(5)).ok());
  ASSERT_TRUE(host.Put(MakeChunk(6)).ok());
  EXPECT_FALSE(host.Contains(KeyOf(1)));
  EXPECT_EQ(host.Keep(kept, milliseconds(-1)).status().code(), StatusCode::kInvalidArgument);
}

TEST(HostTier, KeptChunksLeaveNoRoomAsPinnedOnesDo) {
  HostTier host(2 * kChunkBytes);
  const std::vector<ChunkKey> kept = {KeyOf(1), KeyOf(2)};
  ASSERT_TRUE(host.Keep(kept, milliseconds(60'000)).ok());
  ASSERT_TRUE(host.Put(MakeChunk(1)).ok());
  ASSERT_TRUE(host.Put(MakeChunk(2)).ok());
  EXPECT_EQ(host.Put(MakeChunk(3)).code(), StatusCode::kResourceExhausted);
  EXPECT_TRUE(host.Contains(KeyOf(1)));
  EXPECT_TRUE(host.Contains(KeyOf(2)));
  EXPECT_FALSE(host.Erase(KeyOf(1)));  // kept: it stays
}

TEST(HostTier, ChunkLargerThanTheWholeCapacityIsRejected) {
  HostTier host(kChunkBytes);
  EXPECT_EQ(host.Put(MakeChunk(1, 2 * kTokens)).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(host.Stats().chunks, 0u);
  EXPECT_TRUE(host.Put(MakeChunk(2)).ok());
}

TEST(HostTier, EvictionHandlerReceivesEachEvictedChunkWhileItIsStillVisible) {
  HostTier host(2 * kChunkBytes);
  std::vector<ChunkKey> evicted;
  std::vector<bool> visible;
  host.SetEvictionHandler([&](std::shared_ptr<const Chunk> c) {
    evicted.push_back(c->key());
    visible.push_back(host.Contains(c->key()) && host.Get(c->key()).ok());
  });
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(host.Put(MakeChunk(id)).ok());
  ASSERT_EQ(evicted.size(), 2u);
  EXPECT_EQ(evicted[0], KeyOf(1));
  EXPECT_EQ(evicted[1], KeyOf(2));
  EXPECT_EQ(visible, std::vector<bool>({true, true}));
  EXPECT_FALSE(host.Contains(KeyOf(1)));  // gone once the handler returned
  host.SetEvictionHandler(nullptr);
  ASSERT_TRUE(host.Put(MakeChunk(5)).ok());
  EXPECT_EQ(evicted.size(), 2u);
}

TEST(HostTier, ConcurrentPutGetAndPinKeepTheTierWithinCapacity) {
  HostTier host(16 * kChunkBytes);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&host, t] {
      for (uint64_t i = 0; i < 300; ++i) {
        const uint64_t id = 1 + (t * 1000 + i) % 40;
        (void)host.Put(MakeChunk(id));
        if (auto pin = host.Pin(KeyOf(id), milliseconds(1000)); pin.ok()) {
          (void)host.Get(KeyOf(id));
          EXPECT_TRUE(host.Unpin(*pin).ok());
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  const TierStats s = host.Stats();
  EXPECT_LE(s.bytes, 16 * kChunkBytes);
  EXPECT_EQ(s.bytes, s.chunks * kChunkBytes);
  EXPECT_EQ(host.PinCount(), 0u);
}

// ---------------------------------------------------------------- DiskTier

TEST(DiskTier, SurvivesReopeningWithByteIdenticalChunks) {
  TempDir dir;
  {
    auto disk = OpenDisk(dir.path(), 0);
    ASSERT_TRUE(disk);
    for (uint64_t id = 1; id <= 5; ++id) ASSERT_TRUE(disk->Put(MakeChunk(id)).ok());
    EXPECT_TRUE(fs::exists(disk->PathFor(KeyOf(3))));
    EXPECT_EQ(disk->PathFor(KeyOf(3)).filename(), KeyOf(3).ToHex() + ".kvc");
  }
  auto disk = OpenDisk(dir.path(), 0);
  ASSERT_TRUE(disk);
  const TierStats s = disk->Stats();
  EXPECT_EQ(s.chunks, 5u);
  EXPECT_EQ(s.bytes, 5 * kChunkBytes);
  for (uint64_t id = 1; id <= 5; ++id) {
    EXPECT_TRUE(disk->Contains(KeyOf(id)));
    auto got = disk->Get(KeyOf(id));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(BytesOf(**got), BytesOf(*MakeChunk(id)));
  }
  EXPECT_EQ(disk->Stats().corrupt, 0u);
}

TEST(DiskTier, TruncatedFileIsAMissRemovedAndNeverServed) {
  TempDir dir;
  auto disk = OpenDisk(dir.path(), 0);
  ASSERT_TRUE(disk);
  ASSERT_TRUE(disk->Put(MakeChunk(1)).ok());
  const fs::path file = disk->PathFor(KeyOf(1));
  fs::resize_file(file, kChunkBytes - 10);
  EXPECT_EQ(disk->Get(KeyOf(1)).status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(fs::exists(file));
  EXPECT_FALSE(disk->Contains(KeyOf(1)));
  EXPECT_EQ(disk->Get(KeyOf(1)).status().code(), StatusCode::kNotFound);
  const TierStats s = disk->Stats();
  EXPECT_EQ(s.corrupt, 1u);
  EXPECT_EQ(s.hits, 0u);
  EXPECT_EQ(s.chunks, 0u);
  EXPECT_EQ(s.bytes, 0u);
}

TEST(DiskTier, FileWithAFlippedByteIsAMissRemovedAndNeverServed) {
  TempDir dir;
  auto disk = OpenDisk(dir.path(), 0);
  ASSERT_TRUE(disk);
  ASSERT_TRUE(disk->Put(MakeChunk(1)).ok());
  ASSERT_TRUE(disk->Put(MakeChunk(2)).ok());
  const fs::path file = disk->PathFor(KeyOf(1));
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(200);
    const char c = static_cast<char>(f.get());
    f.seekp(200);
    f.put(static_cast<char>(c ^ 0x01));
  }
  auto got = disk->Get(KeyOf(1));
  EXPECT_EQ(got.status().code(), StatusCode::kNotFound);
  EXPECT_NE(got.status().message().find(file.string()), std::string::npos);
  EXPECT_FALSE(fs::exists(file));
  EXPECT_EQ(disk->Stats().corrupt, 1u);
  EXPECT_TRUE(disk->Get(KeyOf(2)).ok());  // its neighbour is unharmed
}

TEST(DiskTier, FileWhoseHeaderNamesAnotherKeyIsAMiss) {
  TempDir dir;
  {
    auto disk = OpenDisk(dir.path(), 0);
    ASSERT_TRUE(disk);
    ASSERT_TRUE(disk->Put(MakeChunk(2)).ok());
    // A well-formed chunk 2 under chunk 1's name.
    fs::create_directories(disk->PathFor(KeyOf(1)).parent_path());
    fs::copy_file(disk->PathFor(KeyOf(2)), disk->PathFor(KeyOf(1)));
  }
  auto disk = OpenDisk(dir.path(), 0);
  ASSERT_TRUE(disk);
  EXPECT_TRUE(disk->Contains(KeyOf(1)));  // indexed by name, not yet read
  EXPECT_EQ(disk->Get(KeyOf(1)).status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(fs::exists(disk->PathFor(KeyOf(1))));
  EXPECT_EQ(disk->Stats().corrupt, 1u);
  EXPECT_TRUE(disk->Get(KeyOf(2)).ok());
}

TEST(DiskTier, OpenRemovesLeftoverTemporaryFiles) {
  TempDir dir;
  fs::path sub = dir.path() / KeyOf(1).ToHex().substr(0, 2);
  fs::create_directories(sub);
  const fs::path temp = sub / (KeyOf(1).ToHex() + ".kvc.tmp-123-4");
  std::ofstream(temp) << "half a chunk";
  const fs::path foreign = dir.path() / "README";
  std::ofstream(foreign) << "not a chunk";
  auto disk = OpenDisk(dir.path(), 0);
  ASSERT_TRUE(disk);
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_TRUE(fs::exists(foreign));  // not ours: left alone
  EXPECT_EQ(disk->Stats().chunks, 0u);
  EXPECT_FALSE(disk->Contains(KeyOf(1)));
}

TEST(DiskTier, EvictsLeastRecentlyUsedWhenFull) {
  TempDir dir;
  auto disk = OpenDisk(dir.path(), 3 * kChunkBytes);
  ASSERT_TRUE(disk);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(disk->Put(MakeChunk(id)).ok());
  ASSERT_TRUE(disk->Get(KeyOf(1)).ok());
  ASSERT_TRUE(disk->Put(MakeChunk(4)).ok());
  EXPECT_FALSE(disk->Contains(KeyOf(2)));
  EXPECT_FALSE(fs::exists(disk->PathFor(KeyOf(2))));
  for (uint64_t id : {1, 3, 4}) EXPECT_TRUE(disk->Contains(KeyOf(id)));
  const TierStats s = disk->Stats();
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.bytes, 3 * kChunkBytes);
}

TEST(DiskTier, ReopeningOrdersEvictionByModificationTime) {
  TempDir dir;
  {
    auto disk = OpenDisk(dir.path(), 0);
    ASSERT_TRUE(disk);
    for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(disk->Put(MakeChunk(id)).ok());
    // Oldest to newest: 3, 1, 4, 2.
    const auto base = fs::file_time_type::clock::now() - std::chrono::hours(1);
    int minute = 0;
    for (uint64_t id : {3, 1, 4, 2}) {
      fs::last_write_time(disk->PathFor(KeyOf(id)), base + std::chrono::minutes(minute++));
    }
  }
  // Room for two: the two oldest go at once.
  auto disk = OpenDisk(dir.path(), 2 * kChunkBytes);
  ASSERT_TRUE(disk);
  EXPECT_FALSE(fs::exists(disk->PathFor(KeyOf(3))));
  EXPECT_FALSE(fs::exists(disk->PathFor(KeyOf(1))));
  EXPECT_TRUE(disk->Contains(KeyOf(4)));
  EXPECT_TRUE(disk->Contains(KeyOf(2)));
  EXPECT_EQ(disk->Stats().evictions, 2u);
  ASSERT_TRUE(disk->Put(MakeChunk(5)).ok());
  EXPECT_FALSE(disk->Contains(KeyOf(4)));
  EXPECT_TRUE(disk->Contains(KeyOf(2)));
}

TEST(DiskTier, ChunkLargerThanTheCapacityIsRejectedAndLeavesNoFile) {
  TempDir dir;
  auto disk = OpenDisk(dir.path(), kChunkBytes);
  ASSERT_TRUE(disk);
  EXPECT_EQ(disk->Put(MakeChunk(1, 2 * kTokens)).code(), StatusCode::kResourceExhausted);
  EXPECT_FALSE(fs::exists(disk->PathFor(KeyOf(1))));
  EXPECT_EQ(disk->Stats().chunks, 0u);
}

TEST(DiskTier, OpenOfAFileInsteadOfAFolderFailsNamingThePath) {
  TempDir dir;
  const fs::path file = dir.path() / "plain_file";
  std::ofstream(file) << "x";
  auto disk = DiskTier::Open(file, 0);
  ASSERT_FALSE(disk.ok());
  EXPECT_NE(disk.status().message().find(file.string()), std::string::npos);
}

TEST(DiskTier, SecondOpenOfAFolderInUseFails) {
  TempDir dir;
  auto first = OpenDisk(dir.path(), 0);
  ASSERT_TRUE(first);
  auto second = DiskTier::Open(dir.path(), 0);
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  first.reset();
  EXPECT_TRUE(DiskTier::Open(dir.path(), 0).ok());
}

TEST(DiskTier, MissingFileIsAMissAndIsForgotten) {
  TempDir dir;
  auto disk = OpenDisk(dir.path(), 0);
  ASSERT_TRUE(disk);
  ASSERT_TRUE(disk->Put(MakeChunk(1)).ok());
  fs::remove(disk->PathFor(KeyOf(1)));
  EXPECT_EQ(disk->Get(KeyOf(1)).status().code(), StatusCode::kNotFound);
  EXPECT_FALSE(disk->Contains(KeyOf(1)));
  EXPECT_EQ(disk->Stats().corrupt, 0u);
  EXPECT_EQ(disk->Stats().bytes, 0u);
}

TEST(DiskTier, ConcurrentPutAndGetLoseNoChunks) {
  TempDir dir;
  auto disk = OpenDisk(dir.path(), 0);
  ASSERT_TRUE(disk);
  std::vector<std::thread> threads;
  for (uint64_t t = 0; t < 4; ++t) {
    threads.emplace_back([&disk, t] {
      for (uint64_t i = 0; i < 50; ++i) {
        // Overlapping ids, so that threads also race to write one key.
        const uint64_t id = 1 + t * 25 + i;
        EXPECT_TRUE(disk->Put(MakeChunk(id)).ok());
        auto got = disk->Get(KeyOf(id));
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        EXPECT_EQ((*got)->key(), KeyOf(id));
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(disk->Stats().chunks, 125u);
  EXPECT_EQ(disk->Stats().corrupt, 0u);
  for (uint64_t id = 1; id <= 125; ++id) EXPECT_TRUE(disk->Get(KeyOf(id)).ok()) << id;
}

// ------------------------------------------------------------- TieredStore

// Host memory for `host_chunks` chunks over an unbounded disk in `dir`.
TieredStore MakeStore(const fs::path& dir, uint64_t host_chunks, TieredStoreOptions options = {}) {
  return TieredStore(std::make_unique<HostTier>(host_chunks * kChunkBytes), OpenDisk(dir, 0),
                     options);
}

TEST(TieredStore, PromotesDiskHitsIntoHost) {
  TempDir dir;
  TieredStore store = MakeStore(dir.path(), 2);
  ASSERT_EQ(store.tier_count(), 2u);
  ASSERT_NE(store.host(), nullptr);
  ASSERT_TRUE(store.tier(1).Put(MakeChunk(1)).ok());
  EXPECT_FALSE(store.tier(0).Contains(KeyOf(1)));
  auto got = store.Get(KeyOf(1));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(BytesOf(**got), BytesOf(*MakeChunk(1)));
  EXPECT_TRUE(store.tier(0).Contains(KeyOf(1)));
  // The next Get is served by the host.
  ASSERT_TRUE(store.Get(KeyOf(1)).ok());
  const auto breakdown = store.TierBreakdown();
  ASSERT_EQ(breakdown.size(), 2u);
  EXPECT_EQ(breakdown[0].first, "host");
  EXPECT_EQ(breakdown[0].second.hits, 1u);
  EXPECT_EQ(breakdown[1].first, "disk");
  EXPECT_EQ(breakdown[1].second.hits, 1u);
}

TEST(TieredStore, DemotesHostEvictionsToDisk) {
  TempDir dir;
  TieredStore store = MakeStore(dir.path(), 2);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(store.Put(MakeChunk(id)).ok());
  EXPECT_FALSE(store.tier(0).Contains(KeyOf(1)));
  EXPECT_TRUE(store.tier(1).Contains(KeyOf(1)));
  EXPECT_FALSE(store.tier(1).Contains(KeyOf(2)));  // not written through
  EXPECT_EQ(store.tier(1).Stats().puts, 1u);
  // Bringing 1 back pushes 2 down.
  ASSERT_TRUE(store.Get(KeyOf(1)).ok());
  EXPECT_TRUE(store.tier(0).Contains(KeyOf(1)));
  EXPECT_FALSE(store.tier(0).Contains(KeyOf(2)));
  EXPECT_TRUE(store.tier(1).Contains(KeyOf(2)));
  for (uint64_t id = 1; id <= 3; ++id) EXPECT_TRUE(store.Contains(KeyOf(id)));
}

TEST(TieredStore, LongestPrefixStopsAtTheFirstMissAcrossTiers) {
  TempDir dir;
  TieredStore store = MakeStore(dir.path(), 8);
  ASSERT_TRUE(store.tier(0).Put(MakeChunk(1)).ok());
  ASSERT_TRUE(store.tier(0).Put(MakeChunk(2)).ok());
  ASSERT_TRUE(store.tier(1).Put(MakeChunk(3)).ok());
  ASSERT_TRUE(store.tier(0).Put(MakeChunk(5)).ok());  // after the gap at 4
  const std::vector<ChunkKey> keys = {KeyOf(1), KeyOf(2), KeyOf(3), KeyOf(4), KeyOf(5)};
  EXPECT_EQ(store.LongestPrefix(keys), 3u);
  EXPECT_EQ(store.LongestPrefix(std::span<const ChunkKey>(keys).subspan(3)), 0u);
  EXPECT_EQ(store.LongestPrefix({}), 0u);
  EXPECT_EQ(store.Stats().hits, 0u);  // lookups are not reads
}

TEST(TieredStore, ContainsManyReportsEveryKeyInOrder) {
  TempDir dir;
  TieredStore store = MakeStore(dir.path(), 8);
  ASSERT_TRUE(store.tier(0).Put(MakeChunk(1)).ok());
  ASSERT_TRUE(store.tier(1).Put(MakeChunk(3)).ok());
  ASSERT_TRUE(store.tier(0).Put(MakeChunk(5)).ok());
  const std::vector<ChunkKey> keys = {KeyOf(1), KeyOf(2), KeyOf(3), KeyOf(4), KeyOf(5)};
  EXPECT_EQ(store.ContainsMany(keys), std::vector<bool>({true, false, true, false, true}));
  EXPECT_TRUE(store.ContainsMany({}).empty());
}

TEST(TieredStore, WriteThroughPutsIntoEveryTier) {
  TempDir dir;
  TieredStore store = MakeStore(dir.path(), 8, {.write_through = true});
  ASSERT_TRUE(store.Put(MakeChunk(1)).ok());
  EXPECT_TRUE(store.tier(0).Contains(KeyOf(1)));
  EXPECT_TRUE(store.tier(1).Contains(KeyOf(1)));
}

TEST(TieredStore, PutFallsThroughToDiskWhenTheHostIsAllPinned) {
  TempDir dir;
  TieredStore store = MakeStore(dir.path(), 1);
  ASSERT_TRUE(store.Put(MakeChunk(1)).ok());
  ASSERT_TRUE(store.host()->Pin(KeyOf(1), milliseconds(1000)).ok());
  ASSERT_TRUE(store.Put(MakeChunk(2)).ok());
  EXPECT_FALSE(store.tier(0).Contains(KeyOf(2)));
  EXPECT_TRUE(store.tier(1).Contains(KeyOf(2)));
  // A Get still works; promotion is skipped since the host has no room.
  EXPECT_TRUE(store.Get(KeyOf(2)).ok());
  EXPECT_TRUE(store.tier(0).Contains(KeyOf(1)));
}

TEST(TieredStore, StatsCountOneHitPerGetAndSumTheTiers) {
  TempDir dir;
  TieredStore store = MakeStore(dir.path(), 2);
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(store.Put(MakeChunk(id)).ok());
  ASSERT_TRUE(store.Get(KeyOf(3)).ok());  // host hit
  ASSERT_TRUE(store.Get(KeyOf(1)).ok());  // host miss, disk hit: one hit
  EXPECT_EQ(store.Get(KeyOf(9)).status().code(), StatusCode::kNotFound);
  const TierStats s = store.Stats();
  EXPECT_EQ(s.hits, 2u);
  EXPECT_EQ(s.misses, 1u);
  const TierStats host = store.tier(0).Stats();
  const TierStats disk = store.tier(1).Stats();
  EXPECT_EQ(s.chunks, host.chunks + disk.chunks);
  EXPECT_EQ(s.bytes, host.bytes + disk.bytes);
  EXPECT_EQ(s.evictions, host.evictions + disk.evictions);
  EXPECT_EQ(s.capacity_bytes, 0u);  // the disk is unbounded
}

TEST(TieredStore, WithoutTiersMissesAndRefusesPuts) {
  TieredStore store(std::vector<std::unique_ptr<ChunkStore>>{});
  EXPECT_EQ(store.Get(KeyOf(1)).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(store.Put(MakeChunk(1)).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store.LongestPrefix(std::vector<ChunkKey>{KeyOf(1)}), 0u);
}

TEST(TieredStore, ConcurrentPutAndGetFromFourThreadsLoseNoChunks) {
  TempDir dir;
  // A small host, so most chunks are demoted while other threads read them.
  TieredStore store = MakeStore(dir.path(), 8);
  constexpr uint64_t kPerThread = 100;
  std::vector<std::thread> threads;
  for (uint64_t t = 0; t < 4; ++t) {
    threads.emplace_back([&store, t] {
      for (uint64_t i = 0; i < kPerThread; ++i) {
        const uint64_t id = 1 + t * kPerThread + i;
        ASSERT_TRUE(store.Put(MakeChunk(id)).ok());
        auto got = store.Get(KeyOf(id));
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        EXPECT_EQ((*got)->key(), KeyOf(id));
        // And one this thread wrote earlier, likely demoted by now.
        const uint64_t old = 1 + t * kPerThread + (i * 7919) % (i + 1);
        EXPECT_TRUE(store.Get(KeyOf(old)).ok()) << old;
      }
    });
  }
  for (auto& th : threads) th.join();
  for (uint64_t id = 1; id <= 4 * kPerThread; ++id) {
    auto got = store.Get(KeyOf(id));
    ASSERT_TRUE(got.ok()) << id << ": " << got.status().ToString();
    EXPECT_EQ(BytesOf(**got), BytesOf(*MakeChunk(id)));
  }
  EXPECT_LE(store.tier(0).Stats().bytes, 8 * kChunkBytes);
  EXPECT_EQ(store.Stats().corrupt, 0u);
}

}  // namespace
}  // namespace kdn::kvbus
