// kdn-store: a shared KDN tier (host memory, then disk) served over ZeroMQ so
// that every worker of a node or cluster reads and fills one cache. With
// --disk-dir, every put is written through to disk before it is acknowledged,
// so chunks survive a restart or a crash: the disk tier's index is rebuilt
// from its folder on start. --disk-codec codes what the disk tier writes
// (kdn/kvbus/codec.h).
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>

#include "kdn/common/log_flags.h"
#include "kdn/kvbus/codec.h"
#include "kdn/net/curve_flag.h"
#include "kdn/kvbus/disk_tier.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/store_service.h"
#include "kdn/kvbus/tiered_store.h"
#include "proto_log.h"

namespace {
volatile std::sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

void PrintStats(kdn::kvbus::TieredStore& store) {
  for (const auto& [name, s] : store.TierBreakdown()) {
    kdn::LogInfo(
        "{:<5} {:8} chunks {:10.1f} MiB of {:10.1f} MiB; hits {} misses {} evictions {} "
        "corrupt {}",
        name, s.chunks, s.bytes / 1048576.0, s.capacity_bytes / 1048576.0, s.hits, s.misses,
        s.evictions, s.corrupt);
  }
}
}  // namespace

int main(int argc, char** argv) {
  using namespace kdn::kvbus;
  CLI::App app{"kdn-store: the shared KV-chunk store (host memory + disk) served over ZeroMQ."};
  kdn::LogFlags log_flags;
  log_flags.Add(app);
  std::string listen = "tcp://127.0.0.1:5560", disk_dir;
  double host_mib = 1024, disk_mib = 10240;
  int stats_every_s = 0;
  std::string disk_codec = "raw";
  app.add_option("--listen", listen, "ZeroMQ endpoint to serve (port 0 picks a free one)")
      ->capture_default_str();
  app.add_option("--host-mib", host_mib, "Host-memory tier capacity in MiB")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI::Option* disk_dir_opt =
      app.add_option("--disk-dir", disk_dir, "Folder of the disk tier (none: memory only)");
  app.add_option("--disk-mib", disk_mib, "Disk tier capacity in MiB")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--stats-every", stats_every_s,
                 "Log tier figures every N seconds (0: only at exit)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--disk-codec", disk_codec,
                 "KV codec level the disk tier writes chunks put raw at: raw, lossless, or q2 "
                 "... q8 (docs/kvbus.md, \"KV codec\"); chunks put already encoded are kept as "
                 "they are, and clients decode what they get")
      ->check([](const std::string& s) {
        auto l = ParseCodecLevel(s);
        return l.ok() ? std::string() : l.status().message();
      })
      ->needs(disk_dir_opt)
      ->capture_default_str();
  kdn::net::CurveFlag curve_flag;
  curve_flag.Add(app);
  CLI11_PARSE(app, argc, argv);
  if (kdn::Status st = log_flags.Init("store"); !st.ok()) {
    kdn::LogError("{}", st.ToString());
    return 2;
  }
  kdn::proto::RouteProtobufLogs();
  auto curve = curve_flag.Load();
  if (!curve.ok()) return 2;

  auto host = std::make_unique<HostTier>(static_cast<uint64_t>(host_mib * 1048576.0));
  std::unique_ptr<DiskTier> disk;
  if (!disk_dir.empty()) {
    auto d = DiskTier::Open(disk_dir, static_cast<uint64_t>(disk_mib * 1048576.0));
    if (!d.ok()) {
      kdn::LogError("{}", d.status().ToString());
      return 1;
    }
    disk = std::move(d).value();
  }
  const bool has_disk = disk != nullptr;
  std::vector<std::unique_ptr<ChunkStore>> tiers;
  tiers.push_back(std::move(host));
  if (has_disk) {
    // The disk holds chunks coded; they go back to clients as they are.
    tiers.push_back(std::make_unique<CodecTier>(
        std::move(disk),
        CodecTierOptions{.level = ParseCodecLevel(disk_codec).value(), .decode_on_get = false}));
  }
  TieredStore store(std::move(tiers), {.write_through = has_disk});
  auto server = StoreServer::Start(store, listen, [&store] { return store.TierBreakdown(); },
                                   {.curve = *curve});
  if (!server.ok()) {
    kdn::LogError("{}", server.status().ToString());
    return 1;
  }
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  const TierStats at_start = store.Stats();
  kdn::LogInfo("serving on {} ({} chunks restored from disk)", (*server)->endpoint(),
               at_start.chunks);
  std::printf("%s\n", (*server)->endpoint().c_str());
  std::fflush(stdout);
  int ticks = 0;
  while (!g_stop) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (stats_every_s > 0 && ++ticks % (stats_every_s * 10) == 0) PrintStats(store);
  }
  (*server)->Stop();
  PrintStats(store);
  kdn::LogInfo("stopped");
  return 0;
}
