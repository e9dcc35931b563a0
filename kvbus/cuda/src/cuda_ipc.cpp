#include "kdn/kvbus/cuda/cuda_ipc.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "kdn/kvbus/copy_plan.h"
#include "kdn/kvbus/cuda/copy_extents.h"
#include "kdn/common/cuda_status.h"
#include "src/hex.h"

namespace kdn::kvbus::cuda {

namespace {

using internal::Hex;
using internal::Unhex;

constexpr const char* kPrefix = "kdn-cuda-ipc";
constexpr const char* kVersion = "1";

bool ParseU64(const std::string& s, uint64_t* v) {
  if (s.empty() || s.size() > 20) return false;
  uint64_t x = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (x > (~uint64_t{0} - d) / 10) return false;
    x = x * 10 + d;
  }
  *v = x;
  return true;
}

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out(1);
  for (char c : s) {
    if (c == sep) {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  return out;
}

Status NeedDevice(int device) {
  const int count = CudaDevices();
  if (count == 0) return FailedPrecondition("cuda_ipc: no CUDA device in this process");
  if (device < 0 || device >= count) {
    return FailedPrecondition("cuda_ipc: device " + std::to_string(device) + " of " +
                              std::to_string(count));
  }
  return Status::Ok();
}

Result<std::string> DeviceUuid(int device) {
  cudaDeviceProp prop{};
  KDN_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  return Hex(prop.uuid.bytes, sizeof(prop.uuid.bytes));
}

// The allocation that holds `p`: its base and size (cuMemGetAddressRange,
// reached through the runtime so that nothing links libcuda directly).
Status AllocationRange(const void* p, uintptr_t* alloc_base, size_t* alloc_bytes) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  KDN_CUDA_RETURN_IF_ERROR(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                            cudaEnableDefault, &found));
  if (fn == nullptr || found != cudaDriverEntryPointSuccess) {
    return Internal("cuda_ipc: the driver has no cuMemGetAddressRange");
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult r = reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(fn)(
      &base, &size, reinterpret_cast<CUdeviceptr>(p));
  if (r != CUDA_SUCCESS) {
    return FailedPrecondition("cuda_ipc: cuMemGetAddressRange failed (CUresult " +
                              std::to_string(static_cast<int>(r)) +
                              "): not memory of a device allocation");
  }
  *alloc_base = static_cast<uintptr_t>(base);
  *alloc_bytes = size;
  return Status::Ok();
}

}  // namespace

Result<std::string> ExportDeviceRegion(const void* base, uint64_t bytes, int device) {
  if (base == nullptr || bytes == 0) {
    return InvalidArgument("ExportDeviceRegion: a null base or zero bytes");
  }
  KDN_RETURN_IF_ERROR(NeedDevice(device));
  KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaPointerAttributes attr{};
  KDN_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attr, base));
  if (attr.type != cudaMemoryTypeDevice) {
    return FailedPrecondition("ExportDeviceRegion: not device memory (cudaMemoryType " +
                              std::to_string(static_cast<int>(attr.type)) + ")");
  }
  if (attr.device != device) {
    return FailedPrecondition("ExportDeviceRegion: memory of device " +
                              std::to_string(attr.device) + ", not " + std::to_string(device));
  }
  uintptr_t alloc_base = 0;
  size_t alloc_bytes = 0;
  KDN_RETURN_IF_ERROR(AllocationRange(base, &alloc_base, &alloc_bytes));
  const uint64_t offset = reinterpret_cast<uintptr_t>(base) - alloc_base;
  if (bytes > alloc_bytes - offset) {
    return FailedPrecondition("ExportDeviceRegion: " + std::to_string(bytes) + " bytes at offset " +
                              std::to_string(offset) + " leave the allocation of " +
                              std::to_string(alloc_bytes) + " bytes");
  }
  cudaIpcMemHandle_t handle{};
  KDN_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(alloc_base)));
  KDN_ASSIGN_OR_RETURN(const std::string uuid, DeviceUuid(device));
  return std::string(kPrefix) + ":" + kVersion + ":" + std::to_string(::getpid()) + ":" +
         std::to_string(device) + ":" + uuid + ":" + std::to_string(offset) + ":" +
         std::to_string(bytes) + ":" + Hex(&handle, sizeof(handle));
}

Result<DeviceRegionHandle> ParseDeviceRegionHandle(const std::string& text) {
  const std::vector<std::string> f = Split(text, ':');
  auto bad = [&](const std::string& why) {
    return InvalidArgument("cuda_ipc handle: " + why + " (" + text.substr(0, 64) +
                           (text.size() > 64 ? "..." : "") + ")");
  };
  if (f.size() != 8 || f[0] != kPrefix) return bad("not a kdn-cuda-ipc handle");
  if (f[1] != kVersion) return bad("version " + f[1] + ", this build reads " + kVersion);
  DeviceRegionHandle h;
  uint64_t pid = 0, device = 0;
  if (!ParseU64(f[2], &pid) || pid == 0 || pid > (uint64_t{1} << 31)) return bad("bad pid");
  if (!ParseU64(f[3], &device) || device > 1024) return bad("bad device");
  if (f[4].size() != 32 || !Unhex(f[4], std::vector<uint8_t>(16).data(), 16)) {
    return bad("bad GPU uuid");
  }
  if (!ParseU64(f[5], &h.offset)) return bad("bad offset");
  if (!ParseU64(f[6], &h.bytes) || h.bytes == 0) return bad("bad length");
  if (h.bytes > ~uint64_t{0} - h.offset) return bad("offset + length past 2^64");
  if (!Unhex(f[7], &h.handle, sizeof(h.handle))) return bad("bad cudaIpcMemHandle");
  h.pid = static_cast<int64_t>(pid);
  h.device = static_cast<int>(device);
  h.uuid = f[4];
  return h;
}

Result<std::unique_ptr<ImportedDeviceRegion>> ImportedDeviceRegion::Open(const std::string& handle,
                                                                         int device) {
  KDN_ASSIGN_OR_RETURN(const DeviceRegionHandle h, ParseDeviceRegionHandle(handle));
  KDN_RETURN_IF_ERROR(NeedDevice(device));
  KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  if (h.pid == static_cast<int64_t>(::getpid())) {
    return FailedPrecondition(
        "cuda_ipc: the handle was exported by this process (use its pointer, not IPC)");
  }
  KDN_ASSIGN_OR_RETURN(const std::string uuid, DeviceUuid(device));
  if (uuid != h.uuid) {
    return FailedPrecondition("cuda_ipc: the handle names GPU " + h.uuid + ", device " +
                              std::to_string(device) + " here is GPU " + uuid);
  }
  std::unique_ptr<ImportedDeviceRegion> r(new ImportedDeviceRegion());
  r->device_ = device;
  r->pid_ = h.pid;
  r->bytes_ = h.bytes;
  KDN_CUDA_RETURN_IF_ERROR(
      cudaIpcOpenMemHandle(&r->mapping_, h.handle, cudaIpcMemLazyEnablePeerAccess));
  r->data_ = static_cast<uint8_t*>(r->mapping_) + h.offset;
  KDN_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&r->done_, cudaEventDisableTiming));
  return r;
}

ImportedDeviceRegion::~ImportedDeviceRegion() {
  (void)cudaSetDevice(device_);
  if (done_ != nullptr) {
    (void)cudaEventSynchronize(done_);
    (void)cudaEventDestroy(done_);
  }
  if (mapping_ != nullptr) (void)cudaIpcCloseMemHandle(mapping_);
}

Status ImportedDeviceRegion::WriteExtents(const uint8_t* src_base, std::span<const Extent> src,
                                          std::span<const Extent> dst, cudaStream_t stream) {
  KDN_RETURN_IF_ERROR(CheckExtentsWithin(dst, bytes_, "cuda_ipc destination"));
  KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  KDN_RETURN_IF_ERROR(CopyExtents(src_base, src, data_, dst, stream));
  KDN_CUDA_RETURN_IF_ERROR(cudaEventRecord(done_, stream));
  KDN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(done_));
  return Status::Ok();
}

}  // namespace kdn::kvbus::cuda
