#pragma once
// Command-line flags kdn-prefill and kdn-decode share: where the engine runs
// and how much KV it holds, kvbus's data plane and the KV codec of what they
// put into kdn-store. Header-only, so that only the programs' mains see
// CLI11.

#include <CLI/CLI.hpp>

#include <chrono>
#include <string>

#include "kdn/common/status.h"
#include "kdn/engine/open_engine.h"
#include "kdn/kvbus/codec.h"
#include "kdn/kvbus/redis_store.h"
#include "kdn/kvbus/transport.h"

namespace kdn::worker {

// A CLI11 check of a device name (engine::ParseDevice's refusal as the
// message), for every program's --device.
inline std::string CheckDeviceName(const std::string& s) {
  auto d = engine::ParseDevice(s);
  return d.ok() ? std::string() : d.status().message();
}

// A CLI11 option for --weights-dtype (engine::WeightsDType), shared by every
// program that loads a model.
inline CLI::Option* AddWeightsDTypeOption(CLI::App& app, std::string* dtype) {
  return app
      .add_option("--weights-dtype", *dtype,
                  "CPU engine: native keeps weight matrices in the file's format (GGUF's "
                  "Q8_0/Q4_0/Q4_1/F16/BF16, safetensors' F16/BF16) and computes with quantized "
                  "dot products; f32 widens them at load (docs/engine.md, \"Weight formats\")")
      ->check(CLI::IsMember({"native", "f32"}))
      ->capture_default_str();
}

// --device, --gpu-mem-fraction, --kv-tokens, --threads and --weights-dtype.
// On a GPU the KV pool fills the memory share unless --kv-tokens is given.
struct EngineFlags {
  std::string device = "cpu";
  double gpu_mem_fraction = 0.9;
  int64_t kv_tokens;
  int threads = 0;
  std::string weights_dtype = "native";
  CLI::Option* kv_tokens_option = nullptr;
  CLI::Option* fraction_option = nullptr;

  explicit EngineFlags(int64_t default_kv_tokens) : kv_tokens(default_kv_tokens) {}

  void Add(CLI::App& app) {
    app.add_option("--device", device, "Where the engine runs: cpu, cuda (device 0) or cuda:N")
        ->check(CheckDeviceName)
        ->capture_default_str();
    fraction_option =
        app.add_option("--gpu-mem-fraction", gpu_mem_fraction,
                       "With --device cuda: the share of the GPU's memory this worker takes "
                       "(weights, activations, and a KV pool filling the rest), so that workers "
                       "can share a GPU; --kv-tokens sizes the pool instead when given")
            ->check(CLI::Range(0.0, 1.0).description("in (0, 1]"))
            ->check([](const std::string& s) {
              return std::stod(s) > 0 ? std::string() : std::string("must be more than 0");
            })
            ->capture_default_str();
    kv_tokens_option =
        app.add_option("--kv-tokens", kv_tokens, "Tokens of KV the engine's paged cache holds")
            ->capture_default_str()
            ->check(CLI::PositiveNumber);
    app.add_option("--threads", threads, "CPU threads (0 = all cores)")
        ->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    AddWeightsDTypeOption(app, &weights_dtype);
  }
  // After parsing: `o` with the flags' device, KV pool and threads, or why
  // the flags do not go together.
  Result<engine::OpenOptions> Options(engine::OpenOptions o) const {
    KDN_ASSIGN_OR_RETURN(o.device, engine::ParseDevice(device));
    o.kv_tokens = kv_tokens;
    o.threads = threads;
    KDN_ASSIGN_OR_RETURN(o.weights_dtype, engine::ParseWeightsDType(weights_dtype));
    if (o.device.cuda()) {
      if (kv_tokens_option->count() > 0 && fraction_option->count() > 0) {
        return InvalidArgument("give --kv-tokens or --gpu-mem-fraction, not both");
      }
      if (kv_tokens_option->count() == 0) o.gpu_mem_fraction = gpu_mem_fraction;
    }
    return o;
  }
};

struct KvFlags {
  std::string kv_transport = "auto";
  std::string store_codec = "raw";
  std::string store;                // --store: a kdn-store endpoint
  std::string kdn_redis;            // --kdn-redis: a Redis Cluster's seeds
  std::string redis_password_file;  // --kdn-redis-password-file
  double redis_ttl_s = 0;           // --kdn-redis-ttl

  // Adds --kv-transport, the shared KDN tier (--store or --kdn-redis) and
  // --store-codec to `app`, checked as they parse.
  void Add(CLI::App& app) {
    auto* store_opt = app.add_option("--store", store,
                                     "A kdn-store endpoint (tcp://host:port) to share chunks "
                                     "through");
    auto* redis_opt =
        app.add_option("--kdn-redis", kdn_redis,
                       "A Redis Cluster (or one standalone Redis or Valkey) to share chunks "
                       "through: redis://[user:password@]host:port[,host:port...], its seed "
                       "nodes (docs/kvbus.md, \"Redis tier\")")
            ->check([](const std::string& s) {
              auto u = kvbus::ParseRedisUrl(s);
              return u.ok() ? std::string() : u.status().message();
            });
    store_opt->excludes(redis_opt);
    app.add_option("--kdn-redis-password-file", redis_password_file,
                   "A file holding the password of the --kdn-redis URL (which then has none), "
                   "so that process listings do not show it")
        ->check(CLI::ExistingFile)
        ->needs(redis_opt);
    app.add_option("--kdn-redis-ttl", redis_ttl_s,
                   "Seconds after which a chunk put into --kdn-redis expires (0: never; Redis "
                   "evicts by its maxmemory policy)")
        ->check(CLI::NonNegativeNumber)
        ->needs(redis_opt)
        ->capture_default_str();
    app.add_option("--kv-transport", kv_transport,
                   "kvbus data plane: auto (shm with workers on this host, else tcp), tcp, shm, "
                   "cuda_ipc (GPU workers on one host: the decode worker exports its KV pool "
                   "and prefill workers write each layer slice into it) or nccl (GPU workers "
                   "on any hosts: prefill workers send each layer slice over an NCCL link into "
                   "the decode worker's pool); the device planes are not yet run on a GPU")
        ->check(CLI::IsMember({"auto", "tcp", "shm", "cuda_ipc", "nccl"}))
        ->capture_default_str();
    app.add_option("--store-codec", store_codec,
                   "KV codec level of chunks put into the --store or --kdn-redis: raw, lossless, "
                   "or q2 ... q8 "
                   "(docs/kvbus.md, \"KV codec\"); chunks read back are decoded whatever their "
                   "level")
        ->check([](const std::string& s) {
          auto l = kvbus::ParseCodecLevel(s);
          return l.ok() ? std::string() : l.status().message();
        })
        ->capture_default_str();
  }
  // After parsing (both were checked then).
  kvbus::TransportKind transport() const { return kvbus::ParseTransportKind(kv_transport).value(); }
  kvbus::CodecLevel codec() const { return kvbus::ParseCodecLevel(store_codec).value(); }
  // The shared tier's URI (kdn/kvbus/shared_tier.h), the Redis password
  // file's password put in; empty: none.
  Result<std::string> shared_tier() const {
    if (kdn_redis.empty()) return store;
    if (redis_password_file.empty()) return kdn_redis;
    return kvbus::RedisUrlWithPasswordFile(kdn_redis, redis_password_file);
  }
  std::chrono::milliseconds redis_ttl() const {
    return std::chrono::milliseconds(static_cast<int64_t>(redis_ttl_s * 1000));
  }
  // Sets a worker's options (PrefillServiceOptions, DecodeServiceOptions:
  // kv_transport, store_codec, shared_tier, shared_tier_ttl) from the flags;
  // shared_tier()'s error when the password file cannot be read.
  template <class Options>
  Status ApplyTo(Options& o) const {
    o.kv_transport = transport();
    o.store_codec = codec();
    KDN_ASSIGN_OR_RETURN(o.shared_tier, shared_tier());
    o.shared_tier_ttl = redis_ttl();
    return Status::Ok();
  }
};

}  // namespace kdn::worker
