#pragma once
// The nccl data plane's device half (docs/kvbus.md, "Device planes"): one NCCL
// communicator of two ranks for one prefill/decode pair (rank 0 sends, rank 1
// receives), moving layer slices from the sender's paged KV pool to the
// receiver's. A slice is gathered on the sender into a device staging
// buffer with the extent copy (copy_extents.h), sent as one ncclSend, received
// whole into the receiver's staging buffer and scattered into its blocks; a
// slice of one extent goes without staging.
//
// The unique id (NewUniqueId: 256 hex digits of ncclUniqueId) is made by
// the sender and carried to the receiver over kdn's authenticated control
// channel; both then Connect within the timeout.
//
// Dead peers: the communicator is non-blocking (ncclConfig_t.blocking = 0).
// Connect gives up after its timeout and aborts the half-made communicator;
// Send/Recv enqueue on the caller's stream, and Wait polls that stream and
// the communicator's asynchronous error with a deadline, aborting on expiry.
// After Abort every call answers FAILED_PRECONDITION.
//
// Not thread-safe: one caller at a time (the transport's I/O thread of the
// pair). Calls may use different streams: each call waits (on the device)
// for the previous one, whose staging buffers it reuses.
//
// Built without NCCL (KDN_HAVE_NCCL=0), every function answers
// UNIMPLEMENTED and Version() is 0.

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kdn/common/status.h"
#include "kdn/kvbus/region.h"

struct ncclComm;  // nccl.h's communicator (ncclComm_t is ncclComm*)

namespace kdn::kvbus::cuda {

class ExtentCopier;

class NcclLink {
 public:
  // The NCCL library's version code (ncclGetVersion: 22809 for 2.28.9,
  // 23000 for 2.30.0); 0 without NCCL or when it cannot say.
  static int Version();

  // A fresh ncclUniqueId as 256 hex digits (ncclGetUniqueId: it opens the
  // bootstrap listener of this process, which rank 0 must then be).
  static Result<std::string> NewUniqueId();

  // Joins the two-rank communicator of `unique_id` as `rank` (0: sender,
  // 1: receiver) on `device`. INVALID_ARGUMENT for a malformed id or rank;
  // FAILED_PRECONDITION without the device; DEADLINE_EXCEEDED (the
  // communicator aborted) when the peer has not joined within `timeout`;
  // UNAVAILABLE for NCCL's own failures to connect.
  static Result<std::unique_ptr<NcclLink>> Connect(
      const std::string& unique_id, int rank, int device,
      std::chrono::milliseconds timeout = std::chrono::seconds(60));

  // A one-rank communicator on `device` (ncclCommInitAll), for SendRecvSelf:
  // the NCCL path checked in one process.
  static Result<std::unique_ptr<NcclLink>> OpenSelf(int device);

  ~NcclLink();
  NcclLink(const NcclLink&) = delete;
  NcclLink& operator=(const NcclLink&) = delete;

  // Rank 0: enqueues on `stream` the gather of `extents` (of base, device
  // memory of this link's device) and one ncclSend of their bytes to rank 1.
  Status Send(const uint8_t* base, std::span<const Extent> extents, cudaStream_t stream);
  // Rank 1: enqueues one ncclRecv of the slice and its scatter onto
  // `extents` of base. The extents must total the sender's bytes: the two
  // sides agree on each slice's size over the control channel first. NCCL
  // does not reliably report a size mismatch (the operation may never end:
  // Wait's deadline then aborts the link).
  Status Recv(uint8_t* base, std::span<const Extent> extents, cudaStream_t stream);
  // OpenSelf's link: gather, ncclSend and ncclRecv to itself in one group,
  // scatter. INVALID_ARGUMENT when the totals differ.
  Status SendRecvSelf(const uint8_t* src_base, std::span<const Extent> src, uint8_t* dst_base,
                      std::span<const Extent> dst, cudaStream_t stream);

  // Waits until `stream` is idle, polling it and the communicator's
  // asynchronous error. OK when done; the communicator's error (the link
  // aborted) when NCCL reports one; DEADLINE_EXCEEDED (the link aborted) at
  // the deadline: a dead peer leaves the NCCL kernel waiting forever.
  Status Wait(cudaStream_t stream, std::chrono::milliseconds timeout);

  // ncclCommAbort: ends every operation of the link, for a dead peer or a
  // timeout. Idempotent. Enqueued work on streams finishes (aborted).
  Status Abort();

  int rank() const { return rank_; }
  int device() const { return device_; }
  bool aborted() const { return comm_ == nullptr; }

 private:
  NcclLink(ncclComm* comm, int rank, int peer, int device);
  Status Usable() const;
  Status Begin(cudaStream_t stream);
  Status End(cudaStream_t stream);
  Status Reserve(uint8_t** buf, uint64_t* cap, uint64_t bytes);
  Status Settle(int nccl_result, const char* what);

  // Constant after construction.
  const int rank_;
  const int peer_;  // the rank sent to / received from (itself on OpenSelf's)
  const int device_;
  std::chrono::milliseconds settle_timeout_ = std::chrono::seconds(60);
  // The caller's thread only.
  ncclComm* comm_ = nullptr;
  std::unique_ptr<ExtentCopier> copier_;
  uint8_t* send_stage_ = nullptr;
  uint64_t send_cap_ = 0;
  uint8_t* recv_stage_ = nullptr;
  uint64_t recv_cap_ = 0;
  cudaEvent_t last_ = nullptr;  // recorded after each operation's last step
};

}  // namespace kdn::kvbus::cuda
