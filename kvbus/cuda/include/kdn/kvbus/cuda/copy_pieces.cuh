#pragma once
// The kernel of CopyExtents (copy_extents.h): copies a device table of
// pieces, each `bytes` bytes from src_base + src_offset to dst_base +
// dst_offset. C++17 (nvcc's dialect here), hence its own piece type:
// PieceRecord has CopyPiece's layout (copy_extents.cpp checks).

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kdn/common/status.h"

namespace kdn::kvbus::cuda {

struct PieceRecord {
  uint64_t src_offset;
  uint64_t dst_offset;
  uint64_t bytes;
};

// Launches one kernel on `stream` over the n pieces of `pieces` (device
// memory, readable until the kernel ends). One CTA copies a piece, with
// 16-byte vectors where source and destination share their alignment
// modulo 16. n > 0. The launch's Status (the copy's own errors surface at
// the stream's next synchronization).
Status LaunchCopyPieces(const uint8_t* src_base, uint8_t* dst_base, const PieceRecord* pieces,
                        uint32_t n, cudaStream_t stream);

}  // namespace kdn::kvbus::cuda
