#include "kdn/kvbus/cuda/copy_extents.h"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstring>
#include <string>

#include "kdn/kvbus/cuda/copy_pieces.cuh"
#include "kdn/common/cuda_status.h"

namespace kdn::kvbus::cuda {

static_assert(sizeof(PieceRecord) == sizeof(CopyPiece) &&
              offsetof(PieceRecord, src_offset) == offsetof(CopyPiece, src_offset) &&
              offsetof(PieceRecord, dst_offset) == offsetof(CopyPiece, dst_offset) &&
              offsetof(PieceRecord, bytes) == offsetof(CopyPiece, bytes));

Result<std::unique_ptr<ExtentCopier>> ExtentCopier::Create(int device) {
  KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  std::unique_ptr<ExtentCopier> c(new ExtentCopier(device));
  for (Slot& slot : c->slots_) {
    KDN_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
  }
  return c;
}

ExtentCopier::~ExtentCopier() {
  (void)cudaSetDevice(device_);
  for (Slot& slot : slots_) {
    if (slot.done != nullptr) {
      (void)cudaEventSynchronize(slot.done);
      (void)cudaEventDestroy(slot.done);
    }
    if (slot.host != nullptr) (void)cudaFreeHost(slot.host);
    if (slot.dev != nullptr) (void)cudaFree(slot.dev);
  }
}

Status ExtentCopier::Reserve(Slot& slot, size_t pieces) {
  if (slot.capacity >= pieces) return Status::Ok();
  const size_t cap = std::max<size_t>(4096, std::bit_ceil(pieces));
  if (slot.host != nullptr) (void)cudaFreeHost(slot.host), slot.host = nullptr;
  if (slot.dev != nullptr) (void)cudaFree(slot.dev), slot.dev = nullptr;
  slot.capacity = 0;
  KDN_CUDA_RETURN_IF_ERROR(
      cudaMallocHost(reinterpret_cast<void**>(&slot.host), cap * sizeof(CopyPiece)));
  KDN_CUDA_RETURN_IF_ERROR(
      cudaMalloc(reinterpret_cast<void**>(&slot.dev), cap * sizeof(CopyPiece)));
  slot.capacity = cap;
  return Status::Ok();
}

Status ExtentCopier::Copy(const uint8_t* src_base, std::span<const Extent> src, uint8_t* dst_base,
                          std::span<const Extent> dst, cudaStream_t stream) {
  KDN_RETURN_IF_ERROR(SplitExtents(src, dst, kCopyPieceBytes, &plan_));
  if (plan_.empty()) return Status::Ok();
  if (src_base == nullptr || dst_base == nullptr) {
    return InvalidArgument("CopyExtents: a null base with bytes to copy");
  }
  if (plan_.size() > (size_t{1} << 31)) {
    return InvalidArgument("CopyExtents: " + std::to_string(plan_.size()) + " pieces in one call");
  }
  KDN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  Slot& slot = slots_[next_slot_];
  next_slot_ = (next_slot_ + 1) % kSlots;
  // The slot's previous kernel (and the upload before it) must be done
  // reading its tables before they are rewritten.
  if (slot.used) KDN_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(slot.done));
  KDN_RETURN_IF_ERROR(Reserve(slot, plan_.size()));
  std::memcpy(slot.host, plan_.data(), plan_.size() * sizeof(CopyPiece));
  KDN_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(slot.dev, slot.host, plan_.size() * sizeof(CopyPiece),
                                           cudaMemcpyHostToDevice, stream));
  KDN_RETURN_IF_ERROR(
      LaunchCopyPieces(src_base, dst_base, slot.dev, static_cast<uint32_t>(plan_.size()), stream));
  KDN_CUDA_RETURN_IF_ERROR(cudaEventRecord(slot.done, stream));
  slot.used = true;
  return Status::Ok();
}

Status CopyExtents(const uint8_t* src_base, std::span<const Extent> src, uint8_t* dst_base,
                   std::span<const Extent> dst, cudaStream_t stream) {
  int device = 0;
  if (stream != nullptr) {
    KDN_CUDA_RETURN_IF_ERROR(cudaStreamGetDevice(stream, &device));
  } else {
    KDN_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  }
  thread_local std::vector<std::unique_ptr<ExtentCopier>> copiers;
  if (device < 0) return InvalidArgument("CopyExtents: device " + std::to_string(device));
  if (copiers.size() <= static_cast<size_t>(device)) copiers.resize(device + 1);
  if (copiers[device] == nullptr) {
    KDN_ASSIGN_OR_RETURN(copiers[device], ExtentCopier::Create(device));
  }
  return copiers[device]->Copy(src_base, src, dst_base, dst, stream);
}

}  // namespace kdn::kvbus::cuda
