// kdn-bench slow-tier: a burst of cold prompts at one prefill worker
// (PrefillService, in this process) with no shared tier, then with a shared
// tier that answers every call `delay_ms` late: a real kdn-store (StoreServer
// over a host tier, in this process) reached through its client, behind a
// delay. The prompts need nothing from it, but each job still asks it; the
// worker's KV I/O threads ask while the compute thread computes the jobs
// already asked (docs/serving.md, "Inside a worker"), so the slow tier should
// cost little throughput. A third burst reads on the compute thread, as the
// worker did before. Reports the three throughputs and their ratios to the
// first (aim: at least 0.9x read ahead).

#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
#include <zmq.hpp>

#include "bench_util.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/store_service.h"
#include "kdn/prefill_worker/prefill_service.h"
#include "serving.pb.h"

namespace kdn::bench {

namespace {

using Clock = std::chrono::steady_clock;

// A shared tier `delay` late on every call, as a slow network or a loaded
// Redis would be.
class LateStore final : public kvbus::ChunkStore {
 public:
  LateStore(std::unique_ptr<kvbus::ChunkStore> store, std::chrono::milliseconds delay)
      : store_(std::move(store)), delay_(delay) {}
  std::string name() const override { return "late " + store_->name(); }
  Result<std::shared_ptr<const kvbus::Chunk>> Get(const kvbus::ChunkKey& key) override {
    Wait();
    return store_->Get(key);
  }
  bool Contains(const kvbus::ChunkKey& key) override {
    Wait();
    return store_->Contains(key);
  }
  std::vector<bool> ContainsMany(std::span<const kvbus::ChunkKey> keys) override {
    Wait();
    return store_->ContainsMany(keys);
  }
  Status Put(std::shared_ptr<const kvbus::Chunk> chunk) override {
    Wait();
    return store_->Put(std::move(chunk));
  }
  kvbus::TierStats Stats() override { return store_->LocalStats(); }
  uint64_t calls() const { return calls_.load(); }

 private:
  void Wait() {
    ++calls_;
    std::this_thread::sleep_for(delay_);
  }
  std::unique_ptr<kvbus::ChunkStore> store_;
  const std::chrono::milliseconds delay_;
  std::atomic<uint64_t> calls_{0};
};

struct Burst {
  double seconds = 0;
  int errors = 0;
};

// `prompts` prompts of `tokens` random ids (seeded by `seed`), sent at once to
// the worker at `endpoint`; returns when every reply is in.
Result<Burst> RunBurst(const std::string& endpoint, int prompts, int tokens, uint32_t seed) {
  zmq::context_t ctx;
  zmq::socket_t sock(ctx, zmq::socket_type::dealer);
  sock.set(zmq::sockopt::linger, 0);
  sock.set(zmq::sockopt::rcvtimeo, 600000);
  sock.connect(endpoint);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> id(1, 255);
  const auto start = Clock::now();
  for (int i = 0; i < prompts; ++i) {
    proto::WorkerMessage m;
    m.set_request_id(static_cast<uint64_t>(i) + 1);
    auto* p = m.mutable_prefill();
    for (int t = 0; t < tokens; ++t) p->add_tokens(id(rng));
    p->mutable_sampling()->set_top_p(1.0f);
    p->set_transfer_id("slow-tier-" + std::to_string(seed) + "-" + std::to_string(i));
    const std::string bytes = m.SerializeAsString();
    sock.send(zmq::buffer(bytes), zmq::send_flags::none);
  }
  Burst b;
  for (int done = 0; done < prompts;) {
    zmq::message_t msg;
    if (!sock.recv(msg, zmq::recv_flags::none)) return Unavailable("no reply in 10 minutes");
    proto::WorkerMessage r;
    if (!r.ParseFromArray(msg.data(), static_cast<int>(msg.size()))) continue;
    if (r.body_case() != proto::WorkerMessage::kPrefillReply) continue;
    ++done;
    if (r.prefill_reply().has_error()) {
      ++b.errors;
      std::fprintf(stderr, "slow-tier: request %llu failed: %s\n",
                   static_cast<unsigned long long>(r.request_id()),
                   r.prefill_reply().error().message().c_str());
    }
  }
  b.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return b;
}

}  // namespace

int RunSlowTier(const Common& c, int prompts, int tokens, int delay_ms) {
  if (c.model_dir.empty()) {
    std::fprintf(stderr, "slow-tier: --model (a model folder or .gguf file) is needed\n");
    return 2;
  }
  kvbus::HostTier backing(uint64_t{4} << 30);
  auto server = kvbus::StoreServer::Start(backing, "tcp://127.0.0.1:0");
  if (!server.ok()) {
    std::fprintf(stderr, "slow-tier: %s\n", server.status().ToString().c_str());
    return 1;
  }
  auto client = kvbus::RemoteStore::Connect((*server)->endpoint());
  if (!client.ok()) {
    std::fprintf(stderr, "slow-tier: %s\n", client.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<kvbus::ChunkStore> remote = std::move(client).value();
  auto late = std::make_shared<LateStore>(std::move(remote), std::chrono::milliseconds(delay_ms));
  json rows = json::array();
  // The burst with no shared tier, with the late one read ahead by the KV
  // I/O threads, and with the late one read on the compute thread.
  struct Setup {
    const char* name;
    bool late;
    int io_threads;
  };
  const Setup setups[] = {{"no shared tier", false, 2},
                          {"late tier, read ahead", true, 2},
                          {"late tier, read on the compute thread", true, 0}};
  double tps[3] = {0, 0, 0};
  int errors = 0;
  for (int k = 0; k < 3; ++k) {
    const Setup& setup = setups[k];
    prefill_worker::PrefillServiceOptions o;
    o.model_dir = c.model_dir;
    o.name = "prefill-slow-tier-" + std::to_string(k);
    o.host_bytes = uint64_t{1} << 30;
    o.engine.kv_tokens = std::max<int64_t>(int64_t{prompts} * tokens, 32768);
    o.engine.threads = c.threads;
    o.kv_io_threads = setup.io_threads;
    if (setup.late) o.shared_store = late;
    auto service = prefill_worker::PrefillService::Start(o);
    if (!service.ok()) {
      std::fprintf(stderr, "slow-tier: %s\n", service.status().ToString().c_str());
      return 1;
    }
    // A warm-up prompt, so that no burst pays for first-touch costs.
    if (auto warm = RunBurst((*service)->endpoint(), 1, tokens, 1000 + k); !warm.ok()) {
      std::fprintf(stderr, "slow-tier: %s\n", warm.status().ToString().c_str());
      return 1;
    }
    const uint64_t calls_before = late->calls();
    auto burst = RunBurst((*service)->endpoint(), prompts, tokens, 2000 + k);
    if (!burst.ok()) {
      std::fprintf(stderr, "slow-tier: %s\n", burst.status().ToString().c_str());
      return 1;
    }
    errors += burst->errors;
    tps[k] = static_cast<double>(prompts) * tokens / burst->seconds;
    const uint64_t calls = late->calls() - calls_before;
    std::printf(
        "slow-tier: %-40s %d prompts of %d tokens in %6.2f s: %7.1f prompt tokens/s, %llu "
        "tier calls\n",
        setup.name, prompts, tokens, burst->seconds, tps[k],
        static_cast<unsigned long long>(calls));
    rows.push_back({{"setup", setup.name},
                    {"delay_ms", setup.late ? delay_ms : 0},
                    {"kv_io_threads", setup.io_threads},
                    {"prompts", prompts},
                    {"tokens", tokens},
                    {"seconds", burst->seconds},
                    {"prompt_tokens_per_s", tps[k]},
                    {"tier_calls", calls},
                    {"errors", burst->errors}});
  }
  const double ratio = tps[1] / tps[0];
  const double before = tps[2] / tps[0];
  std::printf(
      "slow-tier: a tier %d ms late against none: %.2fx the prompt tokens/s read ahead "
      "(aim: at least 0.9x), %.2fx read on the compute thread\n",
      delay_ms, ratio, before);
  Emit(c, {{"workload", "slow-tier"},
           {"machine", Machine(c)},
           {"model", c.model_dir},
           {"rows", rows},
           {"ratio_late_to_none", ratio},
           {"ratio_late_read_on_compute_to_none", before}});
  return errors == 0 ? 0 : 1;
}

}  // namespace kdn::bench
