// The CUDA backend of kvbus's device operations (cuda_device_ops.h).

#include "kdn/kvbus/cuda/cuda_device_ops.h"

#include <cuda_runtime_api.h>

#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/cuda/copy_extents.h"
#include "kdn/kvbus/cuda/cuda_ipc.h"
#include "kdn/common/cuda_status.h"
#include "kdn/kvbus/cuda/nccl_link.h"

namespace kdn::kvbus::cuda {

namespace {

uint64_t Total(std::span<const Extent> extents) {
  uint64_t n = 0;
  for (const Extent& x : extents) n += x.bytes;
  return n;
}

// Memory this process allocated and exported.
class OwnMemory final : public DeviceMemory {
 public:
  OwnMemory(uint8_t* p, uint64_t bytes, DeviceOps& ops) : p_(p), bytes_(bytes), ops_(ops) {}
  void set_handle(std::string handle) { handle_ = std::move(handle); }
  ~OwnMemory() override {
    (void)cudaSetDevice(ops_.device());
    (void)cudaFree(p_);
  }
  uint8_t* data() const override { return p_; }
  uint64_t bytes() const override { return bytes_; }
  const std::string& handle() const override { return handle_; }
  DeviceOps& ops() const override { return ops_; }

 private:
  uint8_t* p_;
  uint64_t bytes_;
  std::string handle_;
  DeviceOps& ops_;
};

// A peer's memory, opened by its handle.
class PeerMemory final : public DeviceMemory {
 public:
  PeerMemory(std::unique_ptr<ImportedDeviceRegion> region, std::string handle, DeviceOps& ops)
      : region_(std::move(region)), handle_(std::move(handle)), ops_(ops) {}
  uint8_t* data() const override { return region_->data(); }
  uint64_t bytes() const override { return region_->bytes(); }
  const std::string& handle() const override { return handle_; }
  DeviceOps& ops() const override { return ops_; }

 private:
  std::unique_ptr<ImportedDeviceRegion> region_;
  std::string handle_;
  DeviceOps& ops_;
};

// The nccl plane's link: a two-rank NcclLink, joined on a thread of its
// own (ncclCommInitRank waits for both ranks: a transport's I/O thread
// must not), each message on a non-blocking stream of the link's and
// waited for with the link's deadline. Rank 1 starts joining at once (the
// receiver joins when an offer names the link, and the first linked chunk
// follows); rank 0 at its first message, so that the join's deadline runs
// from there, as the host link's does (a sender may be idle long after
// it made its link). A join still under way when the link goes is left to
// finish, and aborted, on a thread of its own.
class CudaLink final : public DeviceLink {
 public:
  CudaLink(std::string id, int rank, int device, std::chrono::milliseconds timeout)
      : id_(std::move(id)), rank_(rank), device_(device), timeout_(timeout) {
    if (rank_ == 1) StartJoin();
  }
  ~CudaLink() override {
    Abort();
    if (stream_ != nullptr) {
      (void)cudaSetDevice(device_);
      (void)cudaStreamDestroy(stream_);
    }
  }

  Status Send(const uint8_t* base, std::span<const Extent> extents) override {
    if (rank_ != 0) return FailedPrecondition("kvbus nccl link: rank 1 receives, it does not send");
    KDN_RETURN_IF_ERROR(Joined());
    return Settle(link_->Send(base, extents, stream_));
  }
  Status Recv(uint8_t* base, std::span<const Extent> extents) override {
    if (rank_ != 1) return FailedPrecondition("kvbus nccl link: rank 0 sends, it does not receive");
    KDN_RETURN_IF_ERROR(Joined());
    return Settle(link_->Recv(base, extents, stream_));
  }
  void Abort() override {
    if (joining_.valid()) {
      std::thread([joining = std::move(joining_)]() mutable {
        Result<std::unique_ptr<NcclLink>> joined = joining.get();  // bounded by its timeout
        if (joined.ok()) (void)(*joined)->Abort();
      }).detach();
    }
    if (link_) (void)link_->Abort();
    aborted_ = true;
  }
  bool aborted() const override { return aborted_; }

 private:
  // The link joined (the first call waits for it), the device current and
  // the stream made.
  void StartJoin() {
    joining_ = std::async(std::launch::async,
                          [id = id_, rank = rank_, device = device_, timeout = timeout_] {
                            return NcclLink::Connect(id, rank, device, timeout);
                          });
  }
  Status Joined() {
    if (aborted_) return FailedPrecondition("kvbus nccl link: aborted");
    if (!link_ && !joining_.valid()) StartJoin();
    if (joining_.valid()) {
      Result<std::unique_ptr<NcclLink>> joined = joining_.get();
      if (!joined.ok()) {
        aborted_ = true;
        return joined.status();
      }
      link_ = std::move(joined).value();
    }
    KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (stream_ == nullptr) {
      KDN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    }
    return Status::Ok();
  }
  // The message enqueued, then waited for; any failure aborts the link.
  Status Settle(Status enqueued) {
    Status st = enqueued.ok() ? link_->Wait(stream_, timeout_) : std::move(enqueued);
    if (!st.ok()) Abort();
    return st;
  }

  const std::string id_;
  const int rank_;
  const int device_;
  const std::chrono::milliseconds timeout_;
  std::future<Result<std::unique_ptr<NcclLink>>> joining_;
  std::unique_ptr<NcclLink> link_;
  cudaStream_t stream_ = nullptr;
  bool aborted_ = false;
};

class CudaOps final : public DeviceOps {
 public:
  explicit CudaOps(int device) : device_(device) {}
  ~CudaOps() override {
    (void)cudaSetDevice(device_);
    if (stage_ != nullptr) (void)cudaFree(stage_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }
  const char* name() const override { return "cuda"; }
  MemoryKind memory_kind() const override { return MemoryKind::kDevice; }
  int device() const override { return device_; }

  Result<std::unique_ptr<DeviceMemory>> Allocate(uint64_t bytes) override {
    if (bytes == 0) return InvalidArgument("kvbus cuda memory: cannot allocate 0 bytes");
    KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    void* p = nullptr;
    KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
    // Owned (freed on the way out of an error) before anything can fail.
    auto memory = std::make_unique<OwnMemory>(static_cast<uint8_t*>(p), bytes, *this);
    KDN_CUDA_RETURN_IF_ERROR(cudaMemset(p, 0, bytes));
    KDN_ASSIGN_OR_RETURN(std::string handle, ExportDeviceRegion(p, bytes, device_));
    memory->set_handle(std::move(handle));
    return std::unique_ptr<DeviceMemory>(std::move(memory));
  }

  Result<std::unique_ptr<DeviceMemory>> Open(const std::string& handle, uint64_t bytes) override {
    KDN_ASSIGN_OR_RETURN(std::unique_ptr<ImportedDeviceRegion> region,
                         ImportedDeviceRegion::Open(handle, device_));
    if (region->bytes() != bytes) {
      return InvalidArgument("kvbus cuda memory: region " + handle + " is " +
                             std::to_string(region->bytes()) + " bytes, not " +
                             std::to_string(bytes));
    }
    return std::unique_ptr<DeviceMemory>(
        std::make_unique<PeerMemory>(std::move(region), handle, *this));
  }

  Status Upload(const uint8_t* host, uint8_t* base, std::span<const Extent> extents) override {
    const uint64_t n = Total(extents);
    if (n == 0) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu_);
    KDN_RETURN_IF_ERROR(Begin());
    KDN_RETURN_IF_ERROR(Reserve(n));
    // One upload of the whole payload, then one scatter kernel.
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(stage_, host, n, cudaMemcpyHostToDevice, stream_));
    const Extent whole{0, n};
    KDN_RETURN_IF_ERROR(CopyExtents(stage_, {&whole, 1}, base, extents, stream_));
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

  Status Copy(const uint8_t* src_base, std::span<const Extent> src, uint8_t* dst_base,
              std::span<const Extent> dst) override {
    std::lock_guard<std::mutex> lock(mu_);
    KDN_RETURN_IF_ERROR(Begin());
    // One kernel, however many extents (copy_extents.h); then the wait that
    // makes the bytes the destination owner's.
    KDN_RETURN_IF_ERROR(CopyExtents(src_base, src, dst_base, dst, stream_));
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

  Status Download(const uint8_t* base, std::span<const Extent> extents, uint8_t* host) override {
    const uint64_t n = Total(extents);
    if (n == 0) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu_);
    KDN_RETURN_IF_ERROR(Begin());
    KDN_RETURN_IF_ERROR(Reserve(n));
    const Extent whole{0, n};
    KDN_RETURN_IF_ERROR(CopyExtents(base, extents, stage_, {&whole, 1}, stream_));
    KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host, stage_, n, cudaMemcpyDeviceToHost, stream_));
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

  Result<uint64_t> Checksum(const uint8_t* base, std::span<const Extent> extents) override {
    const uint64_t n = Total(extents);
    std::lock_guard<std::mutex> lock(mu_);
    KDN_RETURN_IF_ERROR(Begin());
    if (n == 0) return PayloadChecksum(nullptr, {});
    KDN_RETURN_IF_ERROR(Reserve(n));
    // Gathered on the device, read back, hashed here.
    const Extent whole{0, n};
    KDN_RETURN_IF_ERROR(CopyExtents(base, extents, stage_, {&whole, 1}, stream_));
    host_.resize(n);
    KDN_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host_.data(), stage_, n, cudaMemcpyDeviceToHost, stream_));
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return PayloadChecksum(host_.data(), {&whole, 1});
  }

  Result<std::string> NewLinkId() override {
    KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return NcclLink::NewUniqueId();
  }
  Result<std::unique_ptr<DeviceLink>> JoinLink(const std::string& id, int rank,
                                               std::chrono::milliseconds timeout) override {
    if (rank != 0 && rank != 1) {
      return InvalidArgument("kvbus nccl link: rank " + std::to_string(rank));
    }
    // NewLinkId's form (NcclLink::NewUniqueId): checked here, before a
    // receiver grants anything over it.
    if (id.size() != 256 || id.find_first_not_of("0123456789abcdef") != std::string::npos) {
      return InvalidArgument("kvbus nccl link: malformed link id");
    }
    if (timeout.count() <= 0) return InvalidArgument("kvbus nccl link: the timeout must be > 0");
    return std::unique_ptr<DeviceLink>(std::make_unique<CudaLink>(id, rank, device_, timeout));
  }

 private:
  // The device, current on this thread, and the backend's stream: one of
  // its own, non-blocking, so that its copies neither wait for an engine's
  // kernels on the legacy default stream nor hold them up (mu_ held).
  Status Begin() {
    KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (stream_ == nullptr) {
      KDN_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    }
    return Status::Ok();
  }
  Status Reserve(uint64_t bytes) {
    if (bytes <= stage_bytes_) return Status::Ok();
    if (stage_ != nullptr) KDN_CUDA_RETURN_IF_ERROR(cudaFree(stage_));
    stage_ = nullptr;
    stage_bytes_ = 0;
    void* p = nullptr;
    KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
    stage_ = static_cast<uint8_t*>(p);
    stage_bytes_ = bytes;
    return Status::Ok();
  }

  const int device_;
  std::mutex mu_;  // every call: one stream, one staging buffer
  cudaStream_t stream_ = nullptr;
  uint8_t* stage_ = nullptr;  // device staging, grown to the largest payload
  uint64_t stage_bytes_ = 0;
  std::vector<uint8_t> host_;  // Checksum's read-back
};

}  // namespace

Result<DeviceOps*> CudaDeviceOps(int device) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<CudaOps>> backends;
  const int count = CudaDevices();
  if (device < 0 || device >= count) {
    return FailedPrecondition("kvbus cuda backend: device " + std::to_string(device) + " of " +
                              std::to_string(count));
  }
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<CudaOps>& ops = backends[device];
  if (!ops) ops = std::make_unique<CudaOps>(device);
  return ops.get();
}

}  // namespace kdn::kvbus::cuda
