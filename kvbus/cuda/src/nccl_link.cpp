#include "kdn/kvbus/cuda/nccl_link.h"

#include <string>
#include <thread>
#include <vector>

#include "kdn/kvbus/copy_plan.h"
#include "kdn/kvbus/cuda/copy_extents.h"
#include "kdn/common/cuda_status.h"

#if KDN_HAVE_NCCL
#include <nccl.h>

#include "src/hex.h"
#endif

namespace kdn::kvbus::cuda {

#if KDN_HAVE_NCCL

namespace {

using Clock = std::chrono::steady_clock;

// The Status of a failed NCCL call: INVALID_ARGUMENT for the caller's
// mistakes, UNAVAILABLE for the system's and the peer's (network, remote
// process), INTERNAL for the rest; with NCCL's last error text.
Status NcclStatus(ncclResult_t r, const char* expr, ncclComm_t comm, const char* file, int line) {
  std::string msg = std::string(expr) + " failed at " + file + ":" + std::to_string(line) + ": " +
                    ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') msg += std::string(" (") + last + ")";
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage: return InvalidArgument(std::move(msg));
    case ncclSystemError:
    case ncclRemoteError: return Unavailable(std::move(msg));
    default: return Internal(std::move(msg));
  }
}

#define KDN_NCCL_RETURN_IF_ERROR(expr, comm)                             \
  do {                                                                   \
    const ncclResult_t _kdn_nccl_r = (expr);                             \
    if (_kdn_nccl_r != ncclSuccess && _kdn_nccl_r != ncclInProgress) {   \
      return NcclStatus(_kdn_nccl_r, #expr, (comm), __FILE__, __LINE__); \
    }                                                                    \
  } while (0)

// Polls a non-blocking communicator until it leaves ncclInProgress or the
// deadline passes (then it is aborted).
Status PollComm(ncclComm_t comm, Clock::time_point deadline, const char* what) {
  for (int spins = 0;; ++spins) {
    ncclResult_t async = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &async);
    if (r != ncclSuccess) return NcclStatus(r, "ncclCommGetAsyncError", comm, __FILE__, __LINE__);
    if (async == ncclSuccess) return Status::Ok();
    if (async != ncclInProgress) return NcclStatus(async, what, comm, __FILE__, __LINE__);
    if (Clock::now() >= deadline) {
      (void)ncclCommAbort(comm);
      return {StatusCode::kDeadlineExceeded, std::string("nccl: ") + what +
                                                 " did not finish before its deadline (the peer "
                                                 "never came or stopped); communicator aborted"};
    }
    if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Makes `device` current on this thread, once it is known to exist, and
// the extent copier a link on it uses (Connect and OpenSelf).
Result<std::unique_ptr<ExtentCopier>> OpenDevice(int device) {
  const int count = CudaDevices();
  if (device < 0 || device >= count) {
    return FailedPrecondition("nccl: device " + std::to_string(device) + " of " +
                              std::to_string(count));
  }
  KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  return ExtentCopier::Create(device);
}

}  // namespace

int NcclLink::Version() {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}

Result<std::string> NcclLink::NewUniqueId() {
  ncclUniqueId id{};
  KDN_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id), nullptr);
  return internal::Hex(&id, sizeof(id));
}

NcclLink::NcclLink(ncclComm* comm, int rank, int peer, int device)
    : rank_(rank), peer_(peer), device_(device), comm_(comm) {}

Result<std::unique_ptr<NcclLink>> NcclLink::Connect(const std::string& unique_id, int rank,
                                                    int device, std::chrono::milliseconds timeout) {
  ncclUniqueId id{};
  if (!internal::Unhex(unique_id, &id, sizeof(id))) {
    return InvalidArgument("nccl: the unique id is not " + std::to_string(2 * sizeof(id)) +
                           " hex digits");
  }
  if (rank != 0 && rank != 1) return InvalidArgument("nccl: rank " + std::to_string(rank));
  KDN_ASSIGN_OR_RETURN(std::unique_ptr<ExtentCopier> copier, OpenDevice(device));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, 2, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm != nullptr) (void)ncclCommAbort(comm);
    return NcclStatus(r, "ncclCommInitRankConfig", nullptr, __FILE__, __LINE__);
  }
  if (Status st = PollComm(comm, Clock::now() + timeout, "ncclCommInitRankConfig"); !st.ok()) {
    if (st.code() != StatusCode::kDeadlineExceeded) (void)ncclCommAbort(comm);
    return st;
  }
  std::unique_ptr<NcclLink> link(new NcclLink(comm, rank, 1 - rank, device));
  link->settle_timeout_ = timeout;
  link->copier_ = std::move(copier);
  KDN_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&link->last_, cudaEventDisableTiming));
  return link;
}

Result<std::unique_ptr<NcclLink>> NcclLink::OpenSelf(int device) {
  KDN_ASSIGN_OR_RETURN(std::unique_ptr<ExtentCopier> copier, OpenDevice(device));
  ncclComm_t comm = nullptr;
  KDN_NCCL_RETURN_IF_ERROR(ncclCommInitAll(&comm, 1, &device), nullptr);
  std::unique_ptr<NcclLink> link(new NcclLink(comm, 0, 0, device));
  link->copier_ = std::move(copier);
  KDN_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&link->last_, cudaEventDisableTiming));
  return link;
}

NcclLink::~NcclLink() {
  (void)cudaSetDevice(device_);
  if (comm_ != nullptr) {
    // Finalize waits for the link's enqueued operations (non-blocking: poll
    // it, 10 s at most; PollComm aborts the communicator at the deadline), then
    // Destroy frees it. A dead peer is better aborted first (Wait does).
    const ncclResult_t r = ncclCommFinalize(comm_);
    Status st = r == ncclSuccess || r == ncclInProgress
                    ? PollComm(comm_, Clock::now() + std::chrono::seconds(10), "ncclCommFinalize")
                    : Internal("ncclCommFinalize failed");
    if (st.ok()) {
      (void)ncclCommDestroy(comm_);
    } else if (st.code() != StatusCode::kDeadlineExceeded) {
      (void)ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }
  if (last_ != nullptr) {
    (void)cudaEventSynchronize(last_);
    (void)cudaEventDestroy(last_);
  }
  if (send_stage_ != nullptr) (void)cudaFree(send_stage_);
  if (recv_stage_ != nullptr) (void)cudaFree(recv_stage_);
}

Status NcclLink::Usable() const {
  if (comm_ == nullptr) return FailedPrecondition("nccl: the link was aborted");
  return Status::Ok();
}

Status NcclLink::Begin(cudaStream_t stream) {
  KDN_RETURN_IF_ERROR(Usable());
  KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  // The previous operation (maybe on another stream) may still read or
  // write the staging buffers this one reuses.
  KDN_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream, last_, 0));
  return Status::Ok();
}

Status NcclLink::End(cudaStream_t stream) {
  KDN_CUDA_RETURN_IF_ERROR(cudaEventRecord(last_, stream));
  return Status::Ok();
}

Status NcclLink::Reserve(uint8_t** buf, uint64_t* cap, uint64_t bytes) {
  if (*cap >= bytes) return Status::Ok();
  // Nothing in flight may still use the old buffer.
  KDN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(last_));
  if (*buf != nullptr) (void)cudaFree(*buf), *buf = nullptr, *cap = 0;
  KDN_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(buf), bytes));
  *cap = bytes;
  return Status::Ok();
}

Status NcclLink::Settle(int nccl_result, const char* what) {
  const auto r = static_cast<ncclResult_t>(nccl_result);
  if (r == ncclSuccess) return Status::Ok();
  if (r != ncclInProgress) {
    Status st = NcclStatus(r, what, comm_, __FILE__, __LINE__);
    (void)Abort();
    return st;
  }
  Status st = PollComm(comm_, Clock::now() + settle_timeout_, what);
  if (st.code() == StatusCode::kDeadlineExceeded) comm_ = nullptr;  // PollComm aborted it
  if (!st.ok()) (void)Abort();
  return st;
}

Status NcclLink::Send(const uint8_t* base, std::span<const Extent> extents, cudaStream_t stream) {
  if (rank_ != 0 || peer_ == rank_) return FailedPrecondition("nccl: Send on a link not rank 0");
  KDN_ASSIGN_OR_RETURN(const uint64_t total, ExtentBytes(extents));
  if (total == 0) return Status::Ok();
  KDN_RETURN_IF_ERROR(Begin(stream));
  const uint8_t* from = nullptr;
  std::vector<Extent> nonempty;
  for (const Extent& e : extents)
    if (e.bytes > 0) nonempty.push_back(e);
  if (nonempty.size() == 1) {
    from = base + nonempty[0].offset;
  } else {
    KDN_RETURN_IF_ERROR(Reserve(&send_stage_, &send_cap_, total));
    const Extent whole{0, total};
    KDN_RETURN_IF_ERROR(copier_->Copy(base, extents, send_stage_, {&whole, 1}, stream));
    from = send_stage_;
  }
  KDN_NCCL_RETURN_IF_ERROR(ncclGroupStart(), comm_);
  (void)ncclSend(from, total, ncclUint8, peer_, comm_, stream);  // its error comes with GroupEnd
  KDN_RETURN_IF_ERROR(Settle(ncclGroupEnd(), "ncclSend"));
  return End(stream);
}

Status NcclLink::Recv(uint8_t* base, std::span<const Extent> extents, cudaStream_t stream) {
  if (rank_ != 1) return FailedPrecondition("nccl: Recv on a link not rank 1");
  KDN_ASSIGN_OR_RETURN(const uint64_t total, ExtentBytes(extents));
  if (total == 0) return Status::Ok();
  KDN_RETURN_IF_ERROR(Begin(stream));
  std::vector<Extent> nonempty;
  for (const Extent& e : extents)
    if (e.bytes > 0) nonempty.push_back(e);
  uint8_t* into = nullptr;
  if (nonempty.size() == 1) {
    into = base + nonempty[0].offset;
  } else {
    KDN_RETURN_IF_ERROR(Reserve(&recv_stage_, &recv_cap_, total));
    into = recv_stage_;
  }
  KDN_NCCL_RETURN_IF_ERROR(ncclGroupStart(), comm_);
  (void)ncclRecv(into, total, ncclUint8, peer_, comm_, stream);
  KDN_RETURN_IF_ERROR(Settle(ncclGroupEnd(), "ncclRecv"));
  if (into == recv_stage_) {
    const Extent whole{0, total};
    KDN_RETURN_IF_ERROR(copier_->Copy(recv_stage_, {&whole, 1}, base, extents, stream));
  }
  return End(stream);
}

Status NcclLink::SendRecvSelf(const uint8_t* src_base, std::span<const Extent> src,
                              uint8_t* dst_base, std::span<const Extent> dst, cudaStream_t stream) {
  if (peer_ != rank_) return FailedPrecondition("nccl: SendRecvSelf on a two-rank link");
  KDN_ASSIGN_OR_RETURN(const uint64_t total, ExtentBytes(src));
  KDN_ASSIGN_OR_RETURN(const uint64_t dst_total, ExtentBytes(dst));
  if (total != dst_total) {
    return InvalidArgument("nccl: source extents cover " + std::to_string(total) +
                           " bytes, destination extents " + std::to_string(dst_total));
  }
  if (total == 0) return Status::Ok();
  KDN_RETURN_IF_ERROR(Begin(stream));
  KDN_RETURN_IF_ERROR(Reserve(&send_stage_, &send_cap_, total));
  KDN_RETURN_IF_ERROR(Reserve(&recv_stage_, &recv_cap_, total));
  const Extent whole{0, total};
  KDN_RETURN_IF_ERROR(copier_->Copy(src_base, src, send_stage_, {&whole, 1}, stream));
  KDN_NCCL_RETURN_IF_ERROR(ncclGroupStart(), comm_);
  (void)ncclSend(send_stage_, total, ncclUint8, peer_, comm_, stream);
  (void)ncclRecv(recv_stage_, total, ncclUint8, peer_, comm_, stream);
  KDN_RETURN_IF_ERROR(Settle(ncclGroupEnd(), "ncclSend/ncclRecv to self"));
  KDN_RETURN_IF_ERROR(copier_->Copy(recv_stage_, {&whole, 1}, dst_base, dst, stream));
  return End(stream);
}

Status NcclLink::Wait(cudaStream_t stream, std::chrono::milliseconds timeout) {
  KDN_RETURN_IF_ERROR(Usable());
  KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  const Clock::time_point deadline = Clock::now() + timeout;
  for (int spins = 0;; ++spins) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return Status::Ok();
    if (q != cudaErrorNotReady) {
      const Status st = CudaStatus(q, "cudaStreamQuery(stream)", __FILE__, __LINE__);
      (void)Abort();
      return st;
    }
    ncclResult_t async = ncclSuccess;
    (void)ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      const Status st = NcclStatus(async, "nccl operation", comm_, __FILE__, __LINE__);
      (void)Abort();
      return st;
    }
    if (Clock::now() >= deadline) {
      (void)Abort();
      return {StatusCode::kDeadlineExceeded,
              "nccl: the link's operations did not finish before the deadline (dead peer?); "
              "communicator aborted"};
    }
    if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

Status NcclLink::Abort() {
  if (comm_ == nullptr) return Status::Ok();
  (void)cudaSetDevice(device_);
  const ncclResult_t r = ncclCommAbort(comm_);
  comm_ = nullptr;
  if (r != ncclSuccess) return NcclStatus(r, "ncclCommAbort", nullptr, __FILE__, __LINE__);
  return Status::Ok();
}

#else  // !KDN_HAVE_NCCL

namespace {
Status NoNccl() { return Unimplemented("nccl: this build has no NCCL (KDN_HAVE_NCCL=0)"); }
}  // namespace

int NcclLink::Version() { return 0; }
Result<std::string> NcclLink::NewUniqueId() { return NoNccl(); }
Result<std::unique_ptr<NcclLink>> NcclLink::Connect(const std::string&, int, int,
                                                    std::chrono::milliseconds) {
  return NoNccl();
}
Result<std::unique_ptr<NcclLink>> NcclLink::OpenSelf(int) { return NoNccl(); }
NcclLink::NcclLink(ncclComm* comm, int rank, int peer, int device)
    : rank_(rank), peer_(peer), device_(device), comm_(comm) {}
NcclLink::~NcclLink() = default;
Status NcclLink::Send(const uint8_t*, std::span<const Extent>, cudaStream_t) { return NoNccl(); }
Status NcclLink::Recv(uint8_t*, std::span<const Extent>, cudaStream_t) { return NoNccl(); }
Status NcclLink::SendRecvSelf(const uint8_t*, std::span<const Extent>, uint8_t*,
                              std::span<const Extent>, cudaStream_t) {
  return NoNccl();
}
Status NcclLink::Wait(cudaStream_t, std::chrono::milliseconds) { return NoNccl(); }
Status NcclLink::Abort() { return Status::Ok(); }

#endif  // KDN_HAVE_NCCL

}  // namespace kdn::kvbus::cuda
