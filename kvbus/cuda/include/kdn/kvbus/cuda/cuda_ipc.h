#pragma once
// The cuda_ipc data plane's device half (docs/kvbus.md, "Device planes"): a
// process exports a range of its device memory (the decode worker, its KV
// pool) as a handle string; a peer process on the same GPU opens it and
// writes layer slices into it with the device copy (copy_extents.h).
//
// Handle string (ASCII, one line, carried over kdn's authenticated control
// channel, never trusted for more than it names):
//   kdn-cuda-ipc:1:<pid>:<device>:<uuid 32 hex>:<offset>:<bytes>:<handle 128 hex>
// pid: the exporter's process id; device: its ordinal in the exporter's
// process; uuid: the GPU's UUID (ordinals differ between processes under
// CUDA_VISIBLE_DEVICES; the UUID does not); offset: where the exported base
// lies in its allocation (cudaIpcGetMemHandle names the whole allocation);
// bytes: the length of the exported range; handle: cudaIpcMemHandle_t.
//
// Completion: the writer copies on its stream, records a CUDA event after
// the copy and synchronizes it (WriteExtents does both) before it tells the
// owner over the control channel; the owner then reads with no event of its
// own. No IPC event is exported: its lifetime across two processes would
// be one more thing to clean up after a dead peer, and the host round trip
// it saves is small beside a layer's copy.
//
// Every function sets its device on the calling thread first (a transport
// I/O thread may never have set one).

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kdn/common/status.h"
#include "kdn/kvbus/region.h"

namespace kdn::kvbus::cuda {

// The handle of [base, base + bytes), device memory of this process on
// `device` allocated with cudaMalloc (memory of cudaMallocAsync pools or
// cuMemCreate cannot be exported this way). The allocation stays the
// caller's: it must outlive every peer's import. FAILED_PRECONDITION without
// a device, for host memory, memory of another device or a range that leaves
// its allocation; INVALID_ARGUMENT for a null base or zero bytes.
Result<std::string> ExportDeviceRegion(const void* base, uint64_t bytes, int device);

// The fields of a handle string. INVALID_ARGUMENT for a malformed one.
struct DeviceRegionHandle {
  int64_t pid = 0;
  int device = 0;
  std::string uuid;  // 32 hex
  uint64_t offset = 0;
  uint64_t bytes = 0;
  cudaIpcMemHandle_t handle{};
};
Result<DeviceRegionHandle> ParseDeviceRegionHandle(const std::string& text);

// A peer's exported range mapped into this process. Closed (unmapped) in the
// destructor; the exporter's memory is not freed by it. Open a given
// allocation once per process and keep it (the runtime maps an allocation
// once). Not thread-safe for writes in flight; data() and bytes() are
// constant after Open.
class ImportedDeviceRegion {
 public:
  // Maps the handle's range on `device` (cudaIpcOpenMemHandle, with
  // cudaIpcMemLazyEnablePeerAccess). INVALID_ARGUMENT for a malformed
  // handle; FAILED_PRECONDITION without a device, when `device` is not the
  // GPU the handle names (its UUID) or the handle is this process's own.
  static Result<std::unique_ptr<ImportedDeviceRegion>> Open(const std::string& handle, int device);
  ~ImportedDeviceRegion();
  ImportedDeviceRegion(const ImportedDeviceRegion&) = delete;
  ImportedDeviceRegion& operator=(const ImportedDeviceRegion&) = delete;

  // The exported base, in this process's address space (device memory).
  uint8_t* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  int device() const { return device_; }
  int64_t exporter_pid() const { return pid_; }

  // Copies `src` (extents of src_base, memory of this process's device)
  // onto `dst` (extents of data()) on `stream`, records an event after it
  // and waits for it: when this returns OK the bytes are in the exporter's
  // memory and the owner may be told. INVALID_ARGUMENT, before any byte
  // moves, when a destination extent leaves [0, bytes()) or the totals differ.
  Status WriteExtents(const uint8_t* src_base, std::span<const Extent> src,
                      std::span<const Extent> dst, cudaStream_t stream);

 private:
  ImportedDeviceRegion() = default;

  // Constant after Open.
  void* mapping_ = nullptr;  // the allocation's base, as mapped here
  uint8_t* data_ = nullptr;
  uint64_t bytes_ = 0;
  int device_ = 0;
  int64_t pid_ = 0;
  cudaEvent_t done_ = nullptr;
};

}  // namespace kdn::kvbus::cuda
