// kdn-bench cuda-ipc: the kvbus device data planes (kvbus/cuda,
// docs/kvbus.md, "Device planes") moving one request's KV between the paged KV
// pools of two processes on the GPU, against a plain device-to-device
// cudaMemcpy of the same bytes measured in the same run (the aim: >= 0.8 of
// it).
//
// The request: --tokens tokens of the --preset's KV shape (llama3-8b: 32
// layers, 8 kv heads, head_dim 128, bf16; 16-token blocks) on blocks
// scattered at random in each side's pool (twice the blocks it needs), one
// layer slice (its K rows, then its V rows) per CopyExtents call. Paths:
//   cuda_ipc        the decode process exports its pool, the prefill process
//                   imports it and copies every layer into it on one stream
//                   (32 launches), one event wait at the end.
//   cuda_ipc/layer  the same with an event wait after each layer, as a
//                   transport that tells the peer per layer does.
//   local           CopyExtents between two pools of one process (the
//                   kernel alone, no IPC mapping).
//   nccl            NcclLink between the two processes: gather, one ncclSend
//                   per layer, scatter; timed from the go to the receiver's
//                   done over a pipe. Two ranks on one GPU need NCCL >= 2.30
//                   (NCCL_MULTI_RANK_GPU_ENABLE=1); with two GPUs the
//                   receiver uses the second; otherwise the row is skipped.
//   nccl-self       one rank sending to itself (gather, send, recv, scatter).
// The decode process checks the first and the last layer's bytes after each
// two-process path.
#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "kdn/engine/presets.h"
#include "kdn/kvbus/copy_plan.h"
#include "kdn/kvbus/cuda/copy_extents.h"
#include "kdn/kvbus/cuda/cuda_ipc.h"
#include "kdn/common/cuda_status.h"
#include "kdn/kvbus/cuda/nccl_link.h"

namespace kdn::bench {

using kvbus::Extent;
using namespace kdn::kvbus::cuda;

namespace {

constexpr int kBlockTokens = 16;
constexpr uint64_t kPatternBytes = uint64_t{64} << 20;  // the source pool repeats it

// Both pools' geometry and each layer's extents, from the seed (the two
// processes compute the same).
struct Plan {
  int layers = 0;
  uint64_t row_bytes = 0;
  uint64_t pool_blocks = 0;                   // per layer, K (and V)
  uint64_t pool_bytes = 0;                    // a side's whole pool: layers x (K, V)
  uint64_t slice_bytes = 0;                   // one layer's K and V rows of the request
  std::vector<std::vector<Extent>> src, dst;  // per layer
};

Plan MakePlan(const model::ModelConfig& cfg, int64_t tokens, uint64_t seed) {
  Plan p;
  p.layers = cfg.num_layers;
  p.row_bytes = uint64_t{2} * cfg.num_kv_heads * cfg.head_dim;
  const int used = static_cast<int>((tokens + kBlockTokens - 1) / kBlockTokens);
  p.pool_blocks = 2 * static_cast<uint64_t>(used);
  const uint64_t region = p.pool_blocks * kBlockTokens * p.row_bytes;  // one layer's K
  p.pool_bytes = 2 * region * p.layers;
  p.slice_bytes = 2 * static_cast<uint64_t>(tokens) * p.row_bytes;
  std::mt19937_64 rng(seed);
  auto pick = [&] {
    std::vector<int32_t> ids(p.pool_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(used);
    return ids;
  };
  const std::vector<int32_t> s = pick(), d = pick();
  for (int l = 0; l < p.layers; ++l) {
    const uint64_t k = 2 * region * l, v = k + region;
    p.src.push_back(kvbus::PagedSliceExtents(s, tokens, kBlockTokens, p.row_bytes, k, v));
    p.dst.push_back(kvbus::PagedSliceExtents(d, tokens, kBlockTokens, p.row_bytes, k, v));
  }
  return p;
}

std::vector<uint8_t> Pattern() {
  std::vector<uint8_t> v(kPatternBytes);
  std::mt19937_64 rng(12345);
  for (uint64_t i = 0; i < v.size(); i += 8) {
    const uint64_t r = rng();
    std::memcpy(v.data() + i, &r, 8);
  }
  return v;
}

// Fills the source pool with the pattern, repeated.
Status FillSource(uint8_t* pool, uint64_t bytes, const std::vector<uint8_t>& pattern) {
  for (uint64_t at = 0; at < bytes; at += kPatternBytes) {
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpy(
        pool + at, pattern.data(), std::min(kPatternBytes, bytes - at), cudaMemcpyHostToDevice));
  }
  return Status::Ok();
}

// "OK", or where the first and last layers' destination bytes differ from
// the source pattern's.
std::string CheckLayers(const uint8_t* pool, const Plan& p, const std::vector<uint8_t>& pattern) {
  std::vector<kvbus::CopyPiece> pieces;
  std::vector<uint8_t> got;
  for (int l : {0, p.layers - 1}) {
    if (!kvbus::SplitExtents(p.src[l], p.dst[l], 0, &pieces).ok()) return "bad plan";
    for (const kvbus::CopyPiece& piece : pieces) {
      got.resize(piece.bytes);
      if (cudaMemcpy(got.data(), pool + piece.dst_offset, piece.bytes, cudaMemcpyDeviceToHost) !=
          cudaSuccess) {
        return "cudaMemcpy failed";
      }
      for (uint64_t i = 0; i < piece.bytes; ++i) {
        if (got[i] != pattern[(piece.src_offset + i) % kPatternBytes]) {
          return "MISMATCH layer " + std::to_string(l) + " at destination byte " +
                 std::to_string(piece.dst_offset + i);
        }
      }
    }
  }
  return "OK";
}

std::string ReadLine(FILE* f) {
  std::string s;
  for (int c = std::fgetc(f); c != EOF && c != '\n'; c = std::fgetc(f)) s += static_cast<char>(c);
  return s;
}
void WriteLine(FILE* f, const std::string& s) {
  std::fprintf(f, "%s\n", s.c_str());
  std::fflush(f);
}

// The decode process: its pools, serving the parent's commands until QUIT
// or EOF. Commands: IPC (export the pool: HANDLE h), CHECK (OK or why not;
// then zeroes the pool), NCCL <id> <device> (CONNECTED), RECV (every layer,
// then DONE).
int DecodeProcess(FILE* in, FILE* out, const Plan& p) {
  const std::vector<uint8_t> pattern = Pattern();
  struct Pool {
    int device = -1;
    uint8_t* p = nullptr;
  } pool;
  auto need_pool = [&](int device) -> Status {
    if (pool.device == device) return Status::Ok();
    if (pool.p != nullptr) (void)cudaFree(pool.p), pool.p = nullptr;
    KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
    KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&pool.p), p.pool_bytes));
    KDN_CUDA_RETURN_IF_ERROR(cudaMemset(pool.p, 0, p.pool_bytes));
    pool.device = device;
    return Status::Ok();
  };
  std::unique_ptr<NcclLink> link;
  cudaStream_t stream = nullptr;
  for (std::string cmd = ReadLine(in); !cmd.empty() && cmd != "QUIT"; cmd = ReadLine(in)) {
    Status st;
    std::string reply;
    if (cmd == "IPC") {
      st = need_pool(0);
      if (st.ok()) {
        Result<std::string> h = ExportDeviceRegion(pool.p, p.pool_bytes, 0);
        st = h.status();
        if (h.ok()) reply = "HANDLE " + *h;
      }
    } else if (cmd == "CHECK") {
      reply = CheckLayers(pool.p, p, pattern);
      if (cudaMemset(pool.p, 0, p.pool_bytes) != cudaSuccess) reply = "cudaMemset failed";
    } else if (cmd.rfind("NCCL ", 0) == 0) {
      const std::string id = cmd.substr(5, cmd.rfind(' ') - 5);
      const int device = std::atoi(cmd.substr(cmd.rfind(' ') + 1).c_str());
      st = need_pool(device);
      if (st.ok() && stream == nullptr && cudaStreamCreate(&stream) != cudaSuccess) {
        st = Internal("cudaStreamCreate failed");
      }
      if (st.ok()) {
        Result<std::unique_ptr<NcclLink>> l = NcclLink::Connect(id, 1, device);
        st = l.status();
        if (l.ok()) link = std::move(*l), reply = "CONNECTED";
      }
    } else if (cmd == "RECV" && link != nullptr) {
      for (int l = 0; l < p.layers && st.ok(); ++l) st = link->Recv(pool.p, p.dst[l], stream);
      if (st.ok()) st = link->Wait(stream, std::chrono::seconds(60));
      reply = "DONE";
    } else {
      st = InvalidArgument("unknown command " + cmd);
    }
    WriteLine(out, st.ok() ? reply : "ERROR " + st.ToString());
  }
  link.reset();
  if (pool.p != nullptr) (void)cudaFree(pool.p);
  return 0;
}

int Fail(const Status& st) {
  std::fprintf(stderr, "kdn-bench cuda-ipc: %s\n", st.ToString().c_str());
  return 1;
}

// Best-of-reps seconds of `work` between two events on `stream`.
template <typename Work>
Result<double> BestSeconds(cudaStream_t stream, int reps, Work&& work) {
  cudaEvent_t a = nullptr, b = nullptr;
  KDN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&a));
  KDN_CUDA_RETURN_IF_ERROR(cudaEventCreate(&b));
  double best = 1e30;
  Status st;
  for (int r = 0; r <= reps && st.ok(); ++r) {  // the first is a warm-up
    (void)cudaEventRecord(a, stream);
    st = work();
    (void)cudaEventRecord(b, stream);
    if (cudaEventSynchronize(b) != cudaSuccess) st = Internal("cudaEventSynchronize failed");
    float ms = 0;
    (void)cudaEventElapsedTime(&ms, a, b);
    if (r > 0) best = std::min<double>(best, ms / 1e3);
  }
  (void)cudaEventDestroy(a);
  (void)cudaEventDestroy(b);
  KDN_RETURN_IF_ERROR(st);
  return best;
}

}  // namespace

int RunCudaIpc(const Common& c, int tokens, const std::vector<std::string>& paths) {
  auto preset = engine::FindPreset(c.preset);
  if (!preset.ok()) return Fail(preset.status());
  const Plan plan = MakePlan(preset->config, tokens, c.seed + 1);
  const uint64_t total = plan.slice_bytes * plan.layers;
  const int reps = std::max(c.reps, 3);
  auto want = [&](const char* p) {
    return std::find(paths.begin(), paths.end(), p) != paths.end();
  };

  // Two ranks on one GPU (NCCL >= 2.30) are allowed by this variable, which
  // NCCL reads at init: set before the fork so that both processes have it
  // (older NCCL ignores it; a value already set is kept).
  if (want("nccl")) setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 0);
  // The decode process, forked before this one touches CUDA.
  int to[2], from[2];
  if (::pipe(to) != 0 || ::pipe(from) != 0) return Fail(IoError("pipe failed"));
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(to[1]);
    ::close(from[0]);
    FILE* in = fdopen(to[0], "r");
    FILE* out = fdopen(from[1], "w");
    ::_exit(in && out ? DecodeProcess(in, out, plan) : 1);
  }
  ::close(to[0]);
  ::close(from[1]);
  FILE* to_child = fdopen(to[1], "w");
  FILE* from_child = fdopen(from[0], "r");
  auto finish = [&](int code) {
    WriteLine(to_child, "QUIT");
    std::fclose(to_child);
    std::fclose(from_child);
    ::waitpid(child, nullptr, 0);
    return code;
  };
  auto ask = [&](const std::string& cmd) {
    WriteLine(to_child, cmd);
    return ReadLine(from_child);
  };

  const int devices = CudaDevices();
  if (devices == 0) {
    std::fprintf(stderr, "kdn-bench cuda-ipc: no CUDA device\n");
    return finish(1);
  }
  if (cudaSetDevice(0) != cudaSuccess) return finish(Fail(Internal("cudaSetDevice(0) failed")));
  uint8_t* src = nullptr;
  if (Status st = [&]() -> Status {
        KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&src), plan.pool_bytes));
        return Status::Ok();
      }();
      !st.ok()) {
    return finish(Fail(st));
  }
  cudaStream_t stream = nullptr;
  (void)cudaStreamCreate(&stream);
  // The ceiling: one cudaMemcpy of the request's bytes, from the pool's first
  // half to its second (before the pool holds the pattern).
  auto base = BestSeconds(stream, reps, [&]() -> Status {
    KDN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(src + plan.pool_bytes / 2, src, total, cudaMemcpyDeviceToDevice, stream));
    return Status::Ok();
  });
  if (!base.ok()) return finish(Fail(base.status()));
  const double base_gbps = total / *base / 1e9;
  const std::vector<uint8_t> pattern = Pattern();
  if (Status st = FillSource(src, plan.pool_bytes, pattern); !st.ok()) return finish(Fail(st));

  cudaDeviceProp prop{};
  (void)cudaGetDeviceProperties(&prop, 0);
  std::printf(
      "cuda-ipc on %s: %d tokens of %s KV (%d layers, %.1f MiB a layer slice, %zu extents a "
      "layer), %.2f GiB a request; device copy %.0f GB/s; best of %d\n",
      prop.name, tokens, c.preset.c_str(), plan.layers, plan.slice_bytes / 1048576.0,
      plan.src[0].size(), total / 1073741824.0, base_gbps, reps);
  std::printf("%-16s %10s %10s %10s  %s\n", "path", "ms", "GB/s", "of copy", "check");
  json rows = json::array();
  int rc = 0;
  auto row = [&](const std::string& path, double secs, const std::string& check,
                 const std::string& note = "") {
    const double gbps = total / secs / 1e9;
    std::printf("%-16s %10.3f %10.1f %9.1f%%  %s%s\n", path.c_str(), 1e3 * secs, gbps,
                100.0 * gbps / base_gbps, check.c_str(), note.empty() ? "" : (" " + note).c_str());
    rows.push_back({{"path", path},
                    {"seconds", secs},
                    {"gbytes_per_s", gbps},
                    {"fraction_of_device_copy", gbps / base_gbps},
                    {"check", check}});
    if (!note.empty()) rows.back()["note"] = note;
    if (check != "OK") rc = 1;
  };
  auto skip = [&](const std::string& path, const std::string& why) {
    std::printf("%-16s %10s %10s %10s  skipped: %s\n", path.c_str(), "-", "-", "-", why.c_str());
    rows.push_back({{"path", path}, {"skipped", why}});
  };

  // A row whose destination pool is in this process (local, nccl-self):
  // every layer moved by `move(dst, layer)`, timed, checked, the pool freed.
  auto in_process = [&](const std::string& path,
                        const std::function<Status(uint8_t*, int)>& move) -> Status {
    uint8_t* dst = nullptr;
    if (cudaMalloc(reinterpret_cast<void**>(&dst), plan.pool_bytes) != cudaSuccess) {
      return ResourceExhausted("cudaMalloc of the local destination pool failed");
    }
    Result<double> s = BestSeconds(stream, reps, [&]() -> Status {
      for (int l = 0; l < plan.layers; ++l) KDN_RETURN_IF_ERROR(move(dst, l));
      return Status::Ok();
    });
    if (s.ok()) row(path, *s, CheckLayers(dst, plan, pattern));
    (void)cudaFree(dst);
    return s.status();
  };

  if (want("local")) {
    const Status st = in_process("local", [&](uint8_t* dst, int l) {
      return CopyExtents(src, plan.src[l], dst, plan.dst[l], stream);
    });
    if (!st.ok()) return finish(Fail(st));
  }

  if (want("cuda_ipc")) {
    const std::string line = ask("IPC");
    if (line.rfind("HANDLE ", 0) != 0) return finish(Fail(Internal("decode process: " + line)));
    auto region = ImportedDeviceRegion::Open(line.substr(7), 0);
    if (!region.ok()) return finish(Fail(region.status()));
    uint8_t* dst = (*region)->data();
    auto s = BestSeconds(stream, reps, [&]() -> Status {
      for (int l = 0; l < plan.layers; ++l) {
        KDN_RETURN_IF_ERROR(CopyExtents(src, plan.src[l], dst, plan.dst[l], stream));
      }
      return Status::Ok();
    });
    if (!s.ok()) return finish(Fail(s.status()));
    row("cuda_ipc", *s, ask("CHECK"));
    s = BestSeconds(stream, reps, [&]() -> Status {
      for (int l = 0; l < plan.layers; ++l) {
        KDN_RETURN_IF_ERROR((*region)->WriteExtents(src, plan.src[l], plan.dst[l], stream));
      }
      return Status::Ok();
    });
    if (!s.ok()) return finish(Fail(s.status()));
    row("cuda_ipc/layer", *s, ask("CHECK"));
  }

  if (want("nccl")) {
    const int v = NcclLink::Version();
    const int child_device = devices >= 2 ? 1 : 0;
    if (v == 0) {
      skip("nccl", "no NCCL in this build");
    } else if (child_device == 0 && v < 23000) {
      skip("nccl", "one GPU and NCCL " + std::to_string(v) +
                       ": two ranks on one GPU need NCCL >= 2.30 (NCCL_MULTI_RANK_GPU_ENABLE=1)");
    } else {
      auto id = NcclLink::NewUniqueId();
      if (!id.ok()) return finish(Fail(id.status()));
      WriteLine(to_child, "NCCL " + *id + " " + std::to_string(child_device));
      auto link = NcclLink::Connect(*id, 0, 0);
      const std::string connected = ReadLine(from_child);
      if (!link.ok()) return finish(Fail(link.status()));
      if (connected != "CONNECTED") return finish(Fail(Internal("decode process: " + connected)));
      double best = 1e30;
      std::string check = "OK";
      for (int r = 0; r <= reps; ++r) {
        (void)cudaDeviceSynchronize();
        const auto t0 = Clock::now();
        WriteLine(to_child, "RECV");
        Status st;
        for (int l = 0; l < plan.layers && st.ok(); ++l)
          st = (*link)->Send(src, plan.src[l], stream);
        if (st.ok()) st = (*link)->Wait(stream, std::chrono::seconds(60));
        const std::string done = ReadLine(from_child);
        const double secs = Seconds(t0, Clock::now());
        if (!st.ok()) return finish(Fail(st));
        if (done != "DONE") return finish(Fail(Internal("decode process: " + done)));
        if (r > 0) best = std::min(best, secs);
        if (r == 0) check = ask("CHECK");
      }
      row("nccl", best, check,
          child_device == 1 ? "(receiver on GPU 1)" : "(two ranks on GPU 0; host-timed)");
    }
  }

  if (want("nccl-self")) {
    auto link = NcclLink::OpenSelf(0);
    if (!link.ok()) {
      skip("nccl-self", link.status().ToString());
    } else {
      const Status st = in_process("nccl-self", [&](uint8_t* dst, int l) {
        return (*link)->SendRecvSelf(src, plan.src[l], dst, plan.dst[l], stream);
      });
      if (!st.ok()) return finish(Fail(st));
    }
  }

  Emit(c, {{"workload", "cuda-ipc"},
           {"device", prop.name},
           {"preset", c.preset},
           {"tokens", tokens},
           {"layers", plan.layers},
           {"bytes", total},
           {"extents_per_layer", plan.src[0].size()},
           {"nccl_version", NcclLink::Version()},
           {"device_copy_gbytes_per_s", base_gbps},
           {"results", rows}});
  (void)cudaStreamDestroy(stream);
  (void)cudaFree(src);
  return finish(rc);
}

}  // namespace kdn::bench
