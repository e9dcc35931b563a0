// The tier conformance suite (tier_conformance.h) over the tiers kdn has
// in one process or one machine: host memory, disk, both as a TieredStore,
// a kdn-store reached over ZeroMQ, and that kdn-store seen through the
// KV codec (lossless) as workers see it.

#include <memory>

#include "kdn/kvbus/codec.h"
#include "kdn/kvbus/disk_tier.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/store_service.h"
#include "kdn/kvbus/tiered_store.h"
#include "tier_conformance.h"

namespace kdn::kvbus::testing {
namespace {

constexpr uint64_t kCapacity = uint64_t{64} << 20;

// A kdn-store (host tier) served on loopback, and a client of it.
struct Served {
  HostTier backing{kCapacity};
  std::unique_ptr<StoreServer> server;
};

std::unique_ptr<TierHarness> RemoteHarness(bool codec) {
  auto served = std::make_unique<Served>();
  auto server = StoreServer::Start(served->backing, "tcp://127.0.0.1:0");
  EXPECT_TRUE(server.ok()) << server.status().ToString();
  if (!server.ok()) return nullptr;
  served->server = std::move(server).value();
  auto client = RemoteStore::Connect(served->server->endpoint());
  EXPECT_TRUE(client.ok()) << client.status().ToString();
  if (!client.ok()) return nullptr;
  std::unique_ptr<ChunkStore> store = std::move(client).value();
  if (codec) {
    store = std::make_unique<CodecTier>(std::move(store),
                                        CodecTierOptions{.level = {KvCodec::kKvc, 0}});
  }
  return std::make_unique<OwnedTier<Served>>(std::move(store), std::move(served));
}

INSTANTIATE_TEST_SUITE_P(
    Local, TierConformance,
    ::testing::Values(
        TierMaker{"host",
                  [](const std::filesystem::path&) -> std::unique_ptr<TierHarness> {
                    return std::make_unique<OwnedTier<>>(std::make_unique<HostTier>(kCapacity));
                  }},
        TierMaker{"disk",
                  [](const std::filesystem::path& dir) -> std::unique_ptr<TierHarness> {
                    auto disk = DiskTier::Open(dir / "disk", kCapacity);
                    EXPECT_TRUE(disk.ok()) << disk.status().ToString();
                    if (!disk.ok()) return nullptr;
                    return std::make_unique<OwnedTier<>>(std::move(disk).value());
                  }},
        TierMaker{"tiered",
                  [](const std::filesystem::path& dir) -> std::unique_ptr<TierHarness> {
                    auto disk = DiskTier::Open(dir / "disk", kCapacity);
                    if (!disk.ok()) return nullptr;
                    return std::make_unique<OwnedTier<>>(std::make_unique<TieredStore>(
                        std::make_unique<HostTier>(kCapacity), std::move(disk).value()));
                  }},
        TierMaker{"kdn_store", [](const std::filesystem::path&) { return RemoteHarness(false); }},
        TierMaker{"kdn_store_lossless",
                  [](const std::filesystem::path&) { return RemoteHarness(true); }}),
    TierName);

}  // namespace
}  // namespace kdn::kvbus::testing
