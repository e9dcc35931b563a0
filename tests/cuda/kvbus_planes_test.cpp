// The kvbus device data planes (kvbus/cuda, docs/kvbus.md, "Device planes") on
// a GPU: the one-launch extent copy against a host reference, cuda_ipc
// between two processes, NCCL to itself in one rank and between two
// processes (one GPU with NCCL >= 2.30, or two GPUs). Every test that needs
// a device skips without one; the handle parsing tests run anywhere.
//
// The two-process tests run this binary again as the peer (KDN_KVBUS_CHILD
// names its role; main() dispatches before gtest), never fork() after CUDA
// is initialized. Parent and child talk over two pipes on fds 3 and 4 (the
// child's stdout stays free for CUDA's and NCCL's own messages); both derive
// the slice's layout and bytes from the seed they share.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kdn/kvbus/copy_plan.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/cuda/copy_extents.h"
#include "kdn/kvbus/cuda/cuda_device_ops.h"
#include "kdn/kvbus/cuda/cuda_ipc.h"
#include "kdn/common/cuda_status.h"
#include "kdn/kvbus/cuda/nccl_link.h"

extern char** environ;

namespace kdn::kvbus::cuda {
namespace {

#define SKIP_WITHOUT_DEVICE() \
  if (CudaDevices() == 0) GTEST_SKIP() << "no CUDA device"

// ---- Layouts and bytes, shared by the parent and its child -----------------

// One layer slice between two paged pools of a small KV shape (16-token
// blocks, 2 kv heads x 64 dims of bf16: 256-byte rows): `tokens` tokens on
// random blocks of each pool, K then V.
struct SliceCase {
  uint64_t src_pool_bytes = 0, dst_pool_bytes = 0;
  std::vector<Extent> src, dst;
};

SliceCase MakeSliceCase(uint64_t seed, int64_t tokens = 1000, uint64_t row_bytes = 256) {
  std::mt19937_64 rng(seed);
  constexpr int kBlockTokens = 16;
  const int used = static_cast<int>((tokens + kBlockTokens - 1) / kBlockTokens);
  auto pick = [&](int pool_blocks) {
    std::vector<int32_t> ids(pool_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(used);
    return ids;
  };
  SliceCase c;
  const uint64_t block_bytes = kBlockTokens * row_bytes;
  const int src_blocks = 3 * used, dst_blocks = 2 * used + 7;
  c.src_pool_bytes = 2 * src_blocks * block_bytes;
  c.dst_pool_bytes = 2 * dst_blocks * block_bytes;
  const std::vector<int32_t> s = pick(src_blocks), d = pick(dst_blocks);
  c.src = PagedSliceExtents(s, tokens, kBlockTokens, row_bytes, 0, src_blocks * block_bytes);
  c.dst = PagedSliceExtents(d, tokens, kBlockTokens, row_bytes, 0, dst_blocks * block_bytes);
  return c;
}

std::vector<uint8_t> Pattern(uint64_t bytes, uint64_t seed) {
  std::vector<uint8_t> v(bytes);
  std::mt19937_64 rng(seed * 7919 + 1);
  for (uint64_t i = 0; i < bytes; i += 8) {
    const uint64_t r = rng();
    std::memcpy(v.data() + i, &r, std::min<uint64_t>(8, bytes - i));
  }
  return v;
}

// The reference: byte i of the source extents' concatenation onto byte i of
// the destination's, one byte at a time (independent of SplitExtents).
void RefCopy(const std::vector<uint8_t>& from, const std::vector<Extent>& src,
             std::vector<uint8_t>* to, const std::vector<Extent>& dst) {
  size_t si = 0, di = 0;
  uint64_t so = 0, dof = 0;
  for (;;) {
    while (si < src.size() && so == src[si].bytes) ++si, so = 0;
    while (di < dst.size() && dof == dst[di].bytes) ++di, dof = 0;
    if (si == src.size() || di == dst.size()) break;
    (*to)[dst[di].offset + dof++] = from[src[si].offset + so++];
  }
}

// Index of the first difference, or -1.
int64_t FirstDiff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return -1;
}

// A device buffer, freed on scope exit.
struct DeviceBuffer {
  uint8_t* p = nullptr;
  explicit DeviceBuffer(uint64_t bytes) {
    if (cudaMalloc(reinterpret_cast<void**>(&p), std::max<uint64_t>(bytes, 1)) != cudaSuccess) {
      p = nullptr;
    }
  }
  ~DeviceBuffer() {
    if (p != nullptr) (void)cudaFree(p);
  }
};

std::vector<uint8_t> ToHost(const uint8_t* d, uint64_t bytes) {
  std::vector<uint8_t> h(bytes);
  if (cudaMemcpy(h.data(), d, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) h.clear();
  return h;
}

// ---- The child process ------------------------------------------------------

// A line from the parent (fd 3) or to it (fd 4).
std::string ReadLine(FILE* f) {
  std::string s;
  for (int c = std::fgetc(f); c != EOF && c != '\n'; c = std::fgetc(f)) s += static_cast<char>(c);
  return s;
}
void WriteLine(FILE* f, const std::string& s) {
  std::fprintf(f, "%s\n", s.c_str());
  std::fflush(f);
}

std::string Word(const std::string& line, int n) {
  size_t start = 0;
  for (int i = 0; i < n; ++i) {
    start = line.find(' ', start);
    if (start == std::string::npos) return "";
    ++start;
  }
  return line.substr(start, line.find(' ', start) - start);
}

// Checks the child's destination pool against the reference; "OK" or why not.
std::string CheckPool(const uint8_t* dev, const SliceCase& c, uint64_t seed) {
  std::vector<uint8_t> want(c.dst_pool_bytes, 0);
  RefCopy(Pattern(c.src_pool_bytes, seed), c.src, &want, c.dst);
  const std::vector<uint8_t> got = ToHost(dev, c.dst_pool_bytes);
  const int64_t at = FirstDiff(got, want);
  return at < 0 ? "OK" : "MISMATCH at byte " + std::to_string(at);
}

// cuda_ipc: exports a zeroed pool (256 bytes into its allocation, so the
// offset travels), waits for WRITTEN, checks.
int ChildIpcExport(FILE* in, FILE* out, uint64_t seed) {
  const SliceCase c = MakeSliceCase(seed);
  DeviceBuffer buf(c.dst_pool_bytes + 4096);
  if (buf.p == nullptr || cudaMemset(buf.p, 0, c.dst_pool_bytes + 4096) != cudaSuccess) {
    WriteLine(out, "ERROR cudaMalloc");
    return 1;
  }
  uint8_t* base = buf.p + 256;
  Result<std::string> h = ExportDeviceRegion(base, c.dst_pool_bytes, 0);
  if (!h.ok()) {
    WriteLine(out, "ERROR " + h.status().ToString());
    return 1;
  }
  WriteLine(out, "HANDLE " + *h);
  if (ReadLine(in) != "WRITTEN") return 1;
  const std::string verdict = CheckPool(base, c, seed);
  WriteLine(out, verdict);
  return verdict == "OK" ? 0 : 1;
}

// The slice's payload as a sender has it in host memory: the source
// pattern's bytes at c.src, in order.
std::vector<uint8_t> Gathered(const SliceCase& c, uint64_t seed) {
  const std::vector<uint8_t> src = Pattern(c.src_pool_bytes, seed);
  std::vector<uint8_t> out;
  for (const Extent& x : c.src)
    out.insert(out.end(), src.begin() + x.offset, src.begin() + x.offset + x.bytes);
  return out;
}

// The CUDA DeviceOps backend: allocates and exports a pool, waits for
// WRITTEN, checks it, and that the backend's checksum of the slice where it
// landed is the host's of the payload.
int ChildOpsExport(FILE* in, FILE* out, uint64_t seed) {
  const SliceCase c = MakeSliceCase(seed);
  Result<DeviceOps*> ops = CudaDeviceOps(0);
  if (!ops.ok()) {
    WriteLine(out, "ERROR " + ops.status().ToString());
    return 1;
  }
  Result<std::unique_ptr<DeviceMemory>> pool = (*ops)->Allocate(c.dst_pool_bytes);
  if (!pool.ok()) {
    WriteLine(out, "ERROR " + pool.status().ToString());
    return 1;
  }
  WriteLine(out, "HANDLE " + (*pool)->handle());
  if (ReadLine(in) != "WRITTEN") return 1;
  std::string verdict = CheckPool((*pool)->data(), c, seed);
  const std::vector<uint8_t> payload = Gathered(c, seed);
  const Extent whole{0, payload.size()};
  Result<uint64_t> sum = (*ops)->Checksum((*pool)->data(), c.dst);
  if (verdict == "OK" && (!sum.ok() || *sum != PayloadChecksum(payload.data(), {&whole, 1}))) {
    verdict = "CHECKSUM " + (sum.ok() ? std::to_string(*sum) : sum.status().ToString());
  }
  WriteLine(out, verdict);
  return verdict == "OK" ? 0 : 1;
}

// nccl rank 1 on `device`: reads the unique id, connects, receives the
// slice into its pool, checks.
int ChildNcclRecv(FILE* in, FILE* out, uint64_t seed, int device) {
  const std::string id = Word(ReadLine(in), 1);
  const SliceCase c = MakeSliceCase(seed);
  if (cudaSetDevice(device) != cudaSuccess) return 1;
  DeviceBuffer pool(c.dst_pool_bytes);
  if (pool.p == nullptr || cudaMemset(pool.p, 0, c.dst_pool_bytes) != cudaSuccess) return 1;
  Result<std::unique_ptr<NcclLink>> link =
      NcclLink::Connect(id, 1, device, std::chrono::seconds(60));
  if (!link.ok()) {
    WriteLine(out, "ERROR " + link.status().ToString());
    return 1;
  }
  cudaStream_t stream = nullptr;
  if (cudaStreamCreate(&stream) != cudaSuccess) return 1;
  Status st = (*link)->Recv(pool.p, c.dst, stream);
  if (st.ok()) st = (*link)->Wait(stream, std::chrono::seconds(60));
  if (!st.ok()) {
    WriteLine(out, "ERROR " + st.ToString());
    return 1;
  }
  const std::string verdict = CheckPool(pool.p, c, seed);
  WriteLine(out, verdict);
  (void)cudaStreamDestroy(stream);
  return verdict == "OK" ? 0 : 1;
}

// The CUDA backend's link, rank 1: reads the link id, joins it, receives
// the slice onto its pool's extents (the first Recv waits for the join),
// checks.
int ChildOpsLinkRecv(FILE* in, FILE* out, uint64_t seed) {
  const std::string id = Word(ReadLine(in), 1);
  const SliceCase c = MakeSliceCase(seed);
  Result<DeviceOps*> ops = CudaDeviceOps(0);
  if (!ops.ok()) {
    WriteLine(out, "ERROR " + ops.status().ToString());
    return 1;
  }
  Result<std::unique_ptr<DeviceMemory>> pool = (*ops)->Allocate(c.dst_pool_bytes);
  Result<std::unique_ptr<DeviceLink>> link =
      pool.ok() ? (*ops)->JoinLink(id, 1, std::chrono::seconds(60)) : pool.status();
  Status st = link.ok() ? (*link)->Recv((*pool)->data(), c.dst) : link.status();
  if (!st.ok()) {
    WriteLine(out, "ERROR " + st.ToString());
    return 1;
  }
  const std::string verdict = CheckPool((*pool)->data(), c, seed);
  WriteLine(out, verdict);
  return verdict == "OK" ? 0 : 1;
}

int RunChild(const std::string& role) {
  FILE* in = fdopen(3, "r");
  FILE* out = fdopen(4, "w");
  if (in == nullptr || out == nullptr) return 2;
  const char* seed_env = std::getenv("KDN_KVBUS_CHILD_SEED");
  const uint64_t seed = seed_env ? std::strtoull(seed_env, nullptr, 10) : 1;
  if (role == "ipc-export") return ChildIpcExport(in, out, seed);
  if (role == "ops-export") return ChildOpsExport(in, out, seed);
  if (role == "nccl-recv-0") return ChildNcclRecv(in, out, seed, 0);
  if (role == "nccl-recv-1") return ChildNcclRecv(in, out, seed, 1);
  if (role == "ops-link-recv") return ChildOpsLinkRecv(in, out, seed);
  WriteLine(out, "ERROR unknown role " + role);
  return 2;
}

// ---- The parent's side ------------------------------------------------------

// This binary again, as the child `role`, with pipes on its fds 3 and 4.
class Child {
 public:
  Child(const std::string& role, uint64_t seed, const std::vector<std::string>& extra_env = {}) {
    // Close-on-exec, above the fds the child is given, so that only its
    // fds 3 and 4 reach it (and EOF reaches each side when the other closes).
    int to[2], from[2];
    if (pipe(to) != 0 || pipe(from) != 0) return;
    for (int* fd : {&to[0], &to[1], &from[0], &from[1]}) {
      const int high = fcntl(*fd, F_DUPFD_CLOEXEC, 10);
      close(*fd);
      *fd = high;
    }
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) env.emplace_back(*e);
    env.push_back("KDN_KVBUS_CHILD=" + role);
    env.push_back("KDN_KVBUS_CHILD_SEED=" + std::to_string(seed));
    for (const std::string& e : extra_env) env.push_back(e);
    std::vector<char*> envp;
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to[0], 3);
    posix_spawn_file_actions_adddup2(&fa, from[1], 4);
    std::string self = "/proc/self/exe";
    char* argv[] = {self.data(), nullptr};
    if (posix_spawn(&pid_, "/proc/self/exe", &fa, nullptr, argv, envp.data()) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
    close(to[0]);
    close(from[1]);
    to_ = fdopen(to[1], "w");
    from_ = fdopen(from[0], "r");
  }
  ~Child() {
    if (to_ != nullptr) std::fclose(to_);
    if (from_ != nullptr) std::fclose(from_);
    if (pid_ > 0) (void)Exit();
  }
  bool ok() const { return pid_ > 0 && to_ != nullptr && from_ != nullptr; }
  std::string Read() { return ReadLine(from_); }
  void Write(const std::string& s) { WriteLine(to_, s); }
  // The child's exit status (-1 if it did not exit normally).
  int Exit() {
    int status = 0;
    const pid_t p = pid_;
    pid_ = -1;
    if (p <= 0 || waitpid(p, &status, 0) != p) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
};

// ---- CopyExtents ------------------------------------------------------------

// Copies `c` with CopyExtents on `stream` and compares the whole destination
// pool (its bytes outside the extents must stay as they were) with RefCopy.
void ExpectExactCopy(const SliceCase& c, uint64_t seed, cudaStream_t stream) {
  DeviceBuffer src(c.src_pool_bytes), dst(c.dst_pool_bytes);
  ASSERT_NE(src.p, nullptr);
  ASSERT_NE(dst.p, nullptr);
  const std::vector<uint8_t> host_src = Pattern(c.src_pool_bytes, seed);
  std::vector<uint8_t> want = Pattern(c.dst_pool_bytes, seed + 1000);
  ASSERT_EQ(cudaMemcpy(src.p, host_src.data(), host_src.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dst.p, want.data(), want.size(), cudaMemcpyHostToDevice), cudaSuccess);
  const Status st = CopyExtents(src.p, c.src, dst.p, c.dst, stream);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  RefCopy(host_src, c.src, &want, c.dst);
  EXPECT_EQ(FirstDiff(ToHost(dst.p, c.dst_pool_bytes), want), -1);
}

TEST(CopyExtents, MovesAPagedSliceExactly) {
  SKIP_WITHOUT_DEVICE();
  ExpectExactCopy(MakeSliceCase(1), 1, nullptr);
}

TEST(CopyExtents, MovesTwoThousandExtentsInOneCall) {
  SKIP_WITHOUT_DEVICE();
  // 16K tokens of 256-byte rows on 1,024 random blocks a side: 2,048 extents.
  const SliceCase c = MakeSliceCase(2, 16384);
  EXPECT_GE(c.src.size(), 1900u);
  ExpectExactCopy(c, 2, nullptr);
}

TEST(CopyExtents, MovesRandomUnalignedExtentsExactly) {
  SKIP_WITHOUT_DEVICE();
  std::mt19937_64 rng(3);
  for (int round = 0; round < 20; ++round) {
    // Random lengths at random (odd) offsets: heads, tails, and pairs whose
    // alignment differs, which go byte by byte.
    SliceCase c;
    auto cut = [&](uint64_t total, uint64_t* pool) {
      std::vector<Extent> out;
      uint64_t at = rng() % 64;
      for (uint64_t left = total; left > 0;) {
        const uint64_t n = std::min<uint64_t>(left, 1 + rng() % 5000);
        out.push_back({at, n});
        at += n + rng() % 100;
        left -= n;
      }
      std::shuffle(out.begin(), out.end(), rng);
      *pool = at + 64;
      return out;
    };
    const uint64_t total = 1 + rng() % 300000;
    c.src = cut(total, &c.src_pool_bytes);
    c.dst = cut(total, &c.dst_pool_bytes);
    ExpectExactCopy(c, 100 + round, nullptr);
    if (HasFatalFailure()) return;
  }
}

TEST(CopyExtents, ReusesItsTablesAcrossStreams) {
  SKIP_WITHOUT_DEVICE();
  cudaStream_t a = nullptr, b = nullptr;
  ASSERT_EQ(cudaStreamCreate(&a), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&b), cudaSuccess);
  for (int i = 0; i < 12; ++i) {
    ExpectExactCopy(MakeSliceCase(10 + i, 200 + 97 * i), 10 + i, i % 2 ? a : b);
  }
  (void)cudaStreamDestroy(a);
  (void)cudaStreamDestroy(b);
}

TEST(CopyExtents, RefusesListsOfDifferentTotals) {
  SKIP_WITHOUT_DEVICE();
  DeviceBuffer buf(1024);
  const std::vector<Extent> src = {{0, 100}}, dst = {{512, 99}};
  EXPECT_EQ(CopyExtents(buf.p, src, buf.p, dst, nullptr).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(CopyExtents(buf.p, {}, buf.p, {}, nullptr).ok());
}

// ---- cuda_ipc ---------------------------------------------------------------

TEST(CudaIpcHandle, RefusesMalformedHandles) {
  // No device needed: the handle is parsed before any CUDA call.
  const std::string good =
      "kdn-cuda-ipc:1:1234:0:" + std::string(32, 'a') + ":256:4096:" + std::string(128, '0');
  EXPECT_TRUE(ParseDeviceRegionHandle(good).ok());
  for (const std::string& bad :
       {std::string(""), std::string("kdn-cuda-ipc:1"), good.substr(0, good.size() - 1),
        "kdn-cuda-ipc:2" + good.substr(14), "other:1" + good.substr(14),
        "kdn-cuda-ipc:1:0:0:" + std::string(32, 'a') + ":256:4096:" + std::string(128, '0'),
        "kdn-cuda-ipc:1:1234:0:" + std::string(32, 'a') + ":256:0:" + std::string(128, '0'),
        "kdn-cuda-ipc:1:1234:0:" + std::string(32, 'g') + ":256:4096:" + std::string(128, '0'),
        "kdn-cuda-ipc:1:1234:x:" + std::string(32, 'a') + ":256:4096:" + std::string(128, '0')}) {
    EXPECT_EQ(ParseDeviceRegionHandle(bad).status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_EQ(ImportedDeviceRegion::Open(bad, 0).status().code(), StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(CudaIpc, RefusesHostMemoryAndItsOwnHandle) {
  SKIP_WITHOUT_DEVICE();
  std::vector<uint8_t> host(4096);
  EXPECT_EQ(ExportDeviceRegion(host.data(), host.size(), 0).status().code(),
            StatusCode::kFailedPrecondition);
  DeviceBuffer buf(1 << 20);
  ASSERT_NE(buf.p, nullptr);
  EXPECT_EQ(ExportDeviceRegion(buf.p + 4096, 64 << 20, 0).status().code(),
            StatusCode::kFailedPrecondition);  // leaves the allocation
  Result<std::string> h = ExportDeviceRegion(buf.p + 4096, 8192, 0);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  Result<DeviceRegionHandle> parsed = ParseDeviceRegionHandle(*h);
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->offset, 4096u);
  EXPECT_EQ(parsed->bytes, 8192u);
  EXPECT_EQ(ImportedDeviceRegion::Open(*h, 0).status().code(), StatusCode::kFailedPrecondition);
}

TEST(CudaIpc, TwoProcessesOnOneGpuMoveASliceExactly) {
  SKIP_WITHOUT_DEVICE();
  const uint64_t seed = 42;
  const SliceCase c = MakeSliceCase(seed);
  Child child("ipc-export", seed);
  ASSERT_TRUE(child.ok());
  const std::string line = child.Read();
  ASSERT_EQ(line.rfind("HANDLE ", 0), 0u) << line;
  {
    Result<std::unique_ptr<ImportedDeviceRegion>> region =
        ImportedDeviceRegion::Open(line.substr(7), 0);
    ASSERT_TRUE(region.ok()) << region.status().ToString();
    ASSERT_EQ((*region)->bytes(), c.dst_pool_bytes);
    DeviceBuffer src(c.src_pool_bytes);
    ASSERT_NE(src.p, nullptr);
    const std::vector<uint8_t> host_src = Pattern(c.src_pool_bytes, seed);
    ASSERT_EQ(cudaMemcpy(src.p, host_src.data(), host_src.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    // A destination past the exported range is refused before a byte moves.
    const std::vector<Extent> past = {{c.dst_pool_bytes - 8, 16}};
    const std::vector<Extent> sixteen = {{0, 16}};
    EXPECT_EQ((*region)->WriteExtents(src.p, sixteen, past, nullptr).code(),
              StatusCode::kInvalidArgument);
    const Status st = (*region)->WriteExtents(src.p, c.src, c.dst, nullptr);
    ASSERT_TRUE(st.ok()) << st.ToString();
  }  // closed before the owner is told, as the transport does
  child.Write("WRITTEN");
  EXPECT_EQ(child.Read(), "OK");
  EXPECT_EQ(child.Exit(), 0);
}

// ---- The CUDA DeviceOps backend (kvbus's cuda_ipc plane) --------------------

TEST(CudaDeviceOps, UploadsAndChecksumsExtentsAsTheHostBackendDoes) {
  SKIP_WITHOUT_DEVICE();
  const uint64_t seed = 7;
  const SliceCase c = MakeSliceCase(seed);
  Result<DeviceOps*> ops = CudaDeviceOps(0);
  ASSERT_TRUE(ops.ok()) << ops.status().ToString();
  EXPECT_EQ((*ops)->memory_kind(), MemoryKind::kDevice);
  Result<std::unique_ptr<DeviceMemory>> pool = (*ops)->Allocate(c.dst_pool_bytes);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  const std::vector<uint8_t> payload = Gathered(c, seed);
  const Status st = (*ops)->Upload(payload.data(), (*pool)->data(), c.dst);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(CheckPool((*pool)->data(), c, seed), "OK");
  Result<uint64_t> sum = (*ops)->Checksum((*pool)->data(), c.dst);
  ASSERT_TRUE(sum.ok()) << sum.status().ToString();
  const Extent whole{0, payload.size()};
  EXPECT_EQ(*sum, PayloadChecksum(payload.data(), {&whole, 1}));
  EXPECT_EQ((*ops)->Allocate(0).status().code(), StatusCode::kInvalidArgument);
  // Its own handle is not opened (the runtime maps an allocation once).
  EXPECT_EQ((*ops)->Open((*pool)->handle(), c.dst_pool_bytes).status().code(),
            StatusCode::kFailedPrecondition);
  EXPECT_EQ(CudaDeviceOps(CudaDevices()).status().code(), StatusCode::kFailedPrecondition);
}

TEST(CudaDeviceOps, APeerProcessOpensTheHandleAndWritesASliceIntoIt) {
  SKIP_WITHOUT_DEVICE();
  const uint64_t seed = 43;
  const SliceCase c = MakeSliceCase(seed);
  Child child("ops-export", seed);
  ASSERT_TRUE(child.ok());
  const std::string line = child.Read();
  ASSERT_EQ(line.rfind("HANDLE ", 0), 0u) << line;
  Result<DeviceOps*> ops = CudaDeviceOps(0);
  ASSERT_TRUE(ops.ok()) << ops.status().ToString();
  {
    EXPECT_EQ((*ops)->Open(line.substr(7), c.dst_pool_bytes + 1).status().code(),
              StatusCode::kInvalidArgument);
    Result<std::unique_ptr<DeviceMemory>> peer = (*ops)->Open(line.substr(7), c.dst_pool_bytes);
    ASSERT_TRUE(peer.ok()) << peer.status().ToString();
    const std::vector<uint8_t> payload = Gathered(c, seed);
    const Status st = (*ops)->Upload(payload.data(), (*peer)->data(), c.dst);
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  child.Write("WRITTEN");
  EXPECT_EQ(child.Read(), "OK");
  EXPECT_EQ(child.Exit(), 0);
}

// ---- nccl -------------------------------------------------------------------

#define SKIP_WITHOUT_NCCL() \
  if (!KDN_HAVE_NCCL || NcclLink::Version() == 0) GTEST_SKIP() << "no NCCL in this build"

TEST(NcclLink, SendsToItselfInOneRankExactly) {
  SKIP_WITHOUT_DEVICE();
  SKIP_WITHOUT_NCCL();
  Result<std::unique_ptr<NcclLink>> link = NcclLink::OpenSelf(0);
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  for (uint64_t seed : {5, 6}) {
    const SliceCase c = MakeSliceCase(seed, seed == 5 ? 1000 : 4099);
    DeviceBuffer src(c.src_pool_bytes), dst(c.dst_pool_bytes);
    const std::vector<uint8_t> host_src = Pattern(c.src_pool_bytes, seed);
    std::vector<uint8_t> want(c.dst_pool_bytes, 0);
    ASSERT_EQ(cudaMemcpy(src.p, host_src.data(), host_src.size(), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemset(dst.p, 0, c.dst_pool_bytes), cudaSuccess);
    Status st = (*link)->SendRecvSelf(src.p, c.src, dst.p, c.dst, nullptr);
    ASSERT_TRUE(st.ok()) << st.ToString();
    st = (*link)->Wait(nullptr, std::chrono::seconds(30));
    ASSERT_TRUE(st.ok()) << st.ToString();
    RefCopy(host_src, c.src, &want, c.dst);
    EXPECT_EQ(FirstDiff(ToHost(dst.p, c.dst_pool_bytes), want), -1);
  }
}

TEST(NcclLink, ConnectGivesUpWhenThePeerNeverComes) {
  SKIP_WITHOUT_DEVICE();
  SKIP_WITHOUT_NCCL();
  Result<std::string> id = NcclLink::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  EXPECT_EQ(id->size(), 256u);
  Result<std::unique_ptr<NcclLink>> link = NcclLink::Connect(*id, 0, 0, std::chrono::seconds(3));
  EXPECT_EQ(link.status().code(), StatusCode::kDeadlineExceeded) << link.status().ToString();
  EXPECT_EQ(NcclLink::Connect("zz", 0, 0).status().code(), StatusCode::kInvalidArgument);
}

// Two NCCL ranks on one GPU (this process and a child): a device, and NCCL
// 2.30 or newer with NCCL_MULTI_RANK_GPU_ENABLE=1 (set here, and passed to
// the child by the test).
#define SKIP_WITHOUT_TWO_RANKS_ON_ONE_GPU()                                         \
  SKIP_WITHOUT_DEVICE();                                                            \
  SKIP_WITHOUT_NCCL();                                                              \
  if (NcclLink::Version() < 23000) {                                                \
    GTEST_SKIP() << "NCCL " << NcclLink::Version()                                  \
                 << " (version code): two ranks on one GPU need NCCL >= 2.30 with " \
                 << "NCCL_MULTI_RANK_GPU_ENABLE=1";                                 \
  }                                                                                 \
  setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1)

// Rank 0 here on device 0, rank 1 in a child on `child_device`.
void SendToChild(int child_device, const std::vector<std::string>& env) {
  const uint64_t seed = 77;
  const SliceCase c = MakeSliceCase(seed);
  Result<std::string> id = NcclLink::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  Child child("nccl-recv-" + std::to_string(child_device), seed, env);
  ASSERT_TRUE(child.ok());
  child.Write("ID " + *id);
  Result<std::unique_ptr<NcclLink>> link = NcclLink::Connect(*id, 0, 0, std::chrono::seconds(60));
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  DeviceBuffer src(c.src_pool_bytes);
  const std::vector<uint8_t> host_src = Pattern(c.src_pool_bytes, seed);
  ASSERT_EQ(cudaMemcpy(src.p, host_src.data(), host_src.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  Status st = (*link)->Send(src.p, c.src, nullptr);
  ASSERT_TRUE(st.ok()) << st.ToString();
  st = (*link)->Wait(nullptr, std::chrono::seconds(60));
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(child.Read(), "OK");
  EXPECT_EQ(child.Exit(), 0);
}

TEST(NcclLink, TwoProcessesOnOneGpuMoveASliceExactly) {
  SKIP_WITHOUT_TWO_RANKS_ON_ONE_GPU();
  SendToChild(0, {"NCCL_MULTI_RANK_GPU_ENABLE=1"});
}

// The nccl plane's link through the CUDA backend (DeviceOps::JoinLink):
// the slice sent from extents of a pool the backend allocated here,
// received onto extents of one the child's backend allocated.
TEST(CudaDeviceOps, ALinkBetweenTwoProcessesOnOneGpuMovesASliceExactly) {
  SKIP_WITHOUT_TWO_RANKS_ON_ONE_GPU();
  const uint64_t seed = 78;
  const SliceCase c = MakeSliceCase(seed);
  Result<DeviceOps*> ops = CudaDeviceOps(0);
  ASSERT_TRUE(ops.ok()) << ops.status().ToString();
  Result<std::string> id = (*ops)->NewLinkId();
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  Child child("ops-link-recv", seed, {"NCCL_MULTI_RANK_GPU_ENABLE=1"});
  ASSERT_TRUE(child.ok());
  child.Write("ID " + *id);
  Result<std::unique_ptr<DeviceLink>> link = (*ops)->JoinLink(*id, 0, std::chrono::seconds(60));
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  Result<std::unique_ptr<DeviceMemory>> src = (*ops)->Allocate(c.src_pool_bytes);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  const std::vector<uint8_t> host_src = Pattern(c.src_pool_bytes, seed);
  const Extent whole{0, host_src.size()};
  ASSERT_TRUE((*ops)->Upload(host_src.data(), (*src)->data(), {&whole, 1}).ok());
  const Status st = (*link)->Send((*src)->data(), c.src);
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(child.Read(), "OK");
  EXPECT_EQ(child.Exit(), 0);
  // Rank 0 only sends.
  EXPECT_EQ((*link)->Recv((*src)->data(), c.src).code(), StatusCode::kFailedPrecondition);
}

TEST(CudaDeviceOps, ALinkWhosePeerNeverJoinsGivesUpAtItsDeadline) {
  SKIP_WITHOUT_DEVICE();
  SKIP_WITHOUT_NCCL();
  Result<DeviceOps*> ops = CudaDeviceOps(0);
  ASSERT_TRUE(ops.ok()) << ops.status().ToString();
  Result<std::string> id = (*ops)->NewLinkId();
  ASSERT_TRUE(id.ok()) << id.status().ToString();
  Result<std::unique_ptr<DeviceLink>> link = (*ops)->JoinLink(*id, 0, std::chrono::seconds(2));
  ASSERT_TRUE(link.ok()) << link.status().ToString();
  Result<std::unique_ptr<DeviceMemory>> src = (*ops)->Allocate(4096);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  const Extent one{0, 4096};
  EXPECT_FALSE((*link)->Send((*src)->data(), {&one, 1}).ok());
  EXPECT_TRUE((*link)->aborted());
  EXPECT_EQ((*ops)->JoinLink(*id, 2, std::chrono::seconds(1)).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(NcclLinkMultiGpu, TwoProcessesOnTwoGpusMoveASliceExactly) {
  SKIP_WITHOUT_DEVICE();
  SKIP_WITHOUT_NCCL();
  if (CudaDevices() < 2) GTEST_SKIP() << "needs two GPUs, this machine has " << CudaDevices();
  SendToChild(1, {});
}

}  // namespace
}  // namespace kdn::kvbus::cuda

int main(int argc, char** argv) {
  // A peer that died must fail a test, not kill the binary on a write.
  signal(SIGPIPE, SIG_IGN);
  if (const char* role = std::getenv("KDN_KVBUS_CHILD")) {
    return kdn::kvbus::cuda::RunChild(role);
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
