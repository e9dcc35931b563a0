#pragma once
// The CUDA backend of kvbus's device operations (kdn/kvbus/device_ops.h;
// docs/kvbus.md, "Device planes"): memory from cudaMalloc exported with CUDA
// IPC (cuda_ipc.h), a peer's handle opened with ImportedDeviceRegion, host
// bytes written onto extents with one upload and one scatter kernel
// (copy_extents.h), and the XXH3 of extents gathered on the device and read
// back (no device-side hash yet: docs/kvbus.md says what it costs).
//
// One backend per device per process; its calls set the device on the
// calling thread first and run on a non-blocking stream of the backend's
// own, each waiting for its work before it returns. Thread-safe: one mutex
// serializes the calls (one stream, one staging buffer).

#include "kdn/common/status.h"
#include "kdn/kvbus/device_ops.h"

namespace kdn::kvbus::cuda {

// The backend of `device` (created on first use, kept for the process).
// FAILED_PRECONDITION without that device.
Result<DeviceOps*> CudaDeviceOps(int device);

}  // namespace kdn::kvbus::cuda
