#include "kdn/kvbus/cuda/copy_pieces.cuh"

#include <algorithm>

#include "kdn/common/cuda_status.h"

namespace kdn::kvbus::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 8192;  // grid-stride beyond: pieces are short

// One CTA per piece (grid-stride over the table). Where source and
// destination share their offset modulo 16, the piece is a byte head, a
// body of 16-byte vectors (four in flight per thread) and a byte tail;
// otherwise it goes byte by byte (never for bf16 KV rows, whose extents are
// whole rows).
__global__ void CopyPiecesKernel(const uint8_t* src, uint8_t* dst, const PieceRecord* pieces,
                                 uint32_t n) {
  for (uint32_t p = blockIdx.x; p < n; p += gridDim.x) {
    const PieceRecord piece = pieces[p];
    const uint8_t* s = src + piece.src_offset;
    uint8_t* d = dst + piece.dst_offset;
    uint64_t len = piece.bytes;
    const uint64_t ms = reinterpret_cast<uintptr_t>(s) & 15;
    const uint64_t md = reinterpret_cast<uintptr_t>(d) & 15;
    if (ms != md) {
      for (uint64_t i = threadIdx.x; i < len; i += blockDim.x) d[i] = s[i];
      continue;
    }
    const uint64_t head = ms == 0 ? 0 : (16 - ms < len ? 16 - ms : len);
    for (uint64_t i = threadIdx.x; i < head; i += blockDim.x) d[i] = s[i];
    s += head, d += head, len -= head;
    const uint64_t nvec = len / 16;
    const uint4* vs = reinterpret_cast<const uint4*>(s);
    uint4* vd = reinterpret_cast<uint4*>(d);
    const uint64_t step = blockDim.x;
    uint64_t i = threadIdx.x;
    for (; i + 3 * step < nvec; i += 4 * step) {
      const uint4 a = vs[i], b = vs[i + step], c = vs[i + 2 * step], e = vs[i + 3 * step];
      vd[i] = a, vd[i + step] = b, vd[i + 2 * step] = c, vd[i + 3 * step] = e;
    }
    for (; i < nvec; i += step) vd[i] = vs[i];
    for (uint64_t t = nvec * 16 + threadIdx.x; t < len; t += blockDim.x) d[t] = s[t];
  }
}

}  // namespace

Status LaunchCopyPieces(const uint8_t* src_base, uint8_t* dst_base, const PieceRecord* pieces,
                        uint32_t n, cudaStream_t stream) {
  const uint32_t blocks = std::min<uint32_t>(n, kMaxBlocks);
  CopyPiecesKernel<<<blocks, kThreads, 0, stream>>>(src_base, dst_base, pieces, n);
  KDN_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return Status::Ok();
}

}  // namespace kdn::kvbus::cuda
