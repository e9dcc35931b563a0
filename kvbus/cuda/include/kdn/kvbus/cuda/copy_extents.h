#pragma once
// The device gather/scatter copy of a kvbus layer slice: the bytes of a list
// of source extents (offsets from src_base) onto a list of destination
// extents (offsets from dst_base) that covers the same bytes in the same
// order, cut elsewhere (docs/kvbus.md, "Device planes"). One small table upload
// and ONE kernel launch per call, whatever the number of extents (a 16K-token
// slice of the llama3-8b shape is ~2,000 extents per layer): the host cuts
// the two lists into matching pieces (kvbus/copy_plan.h, SplitExtents), each
// CTA of the kernel copies whole pieces with 16-byte loads and stores where
// the source and destination share their alignment.
//
// Both sides must be memory the device of the stream can address: its own
// device memory, a peer's memory opened with cuda_ipc (ImportedDeviceRegion),
// pinned host memory. The source and destination ranges must not overlap.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kdn/common/status.h"
#include "kdn/kvbus/copy_plan.h"
#include "kdn/kvbus/cuda/copy_pieces.cuh"
#include "kdn/kvbus/region.h"

namespace kdn::kvbus::cuda {

// The longest piece one CTA copies: longer runs are cut so that the CTAs'
// work is even (a 16-slot block of the llama3-8b shape is 32 KiB of K).
inline constexpr uint64_t kCopyPieceBytes = uint64_t{64} << 10;

// Reusable piece tables for CopyExtents on one device: a few slots, each a
// pinned host table, its device twin and an event recorded after the kernel
// that read it, so that a slot is rewritten only once its last copy is done
// and calls on different streams do not wait for each other until the
// slots wrap. Not thread-safe: one copier per thread (CopyExtents keeps one
// per thread and device).
class ExtentCopier {
 public:
  // Sets `device` on the calling thread and creates the slots' events
  // (tables are allocated on first use). UNAVAILABLE without a usable device.
  static Result<std::unique_ptr<ExtentCopier>> Create(int device);
  ~ExtentCopier();
  ExtentCopier(const ExtentCopier&) = delete;
  ExtentCopier& operator=(const ExtentCopier&) = delete;

  // Enqueues on `stream` (of this copier's device; nullptr: the legacy
  // default stream) the copy of `src` onto `dst`: one host-to-device copy of
  // the piece table and one kernel. Returns once enqueued: the bytes are in
  // place in stream order (record an event after it to know when).
  // INVALID_ARGUMENT when the lists' totals differ or a base is null with
  // bytes to move; nothing is launched then. No bytes: OK, nothing enqueued.
  Status Copy(const uint8_t* src_base, std::span<const Extent> src, uint8_t* dst_base,
              std::span<const Extent> dst, cudaStream_t stream);

  int device() const { return device_; }

 private:
  struct Slot {
    PieceRecord* host = nullptr;  // pinned
    PieceRecord* dev = nullptr;
    size_t capacity = 0;  // pieces
    cudaEvent_t done = nullptr;
    bool used = false;
  };
  static constexpr int kSlots = 4;

  explicit ExtentCopier(int device) : device_(device) {}
  Status Reserve(Slot& slot, size_t pieces);

  // Constant after construction.
  const int device_;
  // The copier's thread only.
  Slot slots_[kSlots];
  int next_slot_ = 0;
  std::vector<CopyPiece> plan_;
};

// ExtentCopier::Copy with a copier kept per calling thread and device. The
// device is the stream's (nullptr stream: the thread's current device); it
// is set on the calling thread first, so a transport I/O thread that never
// set one may call this.
Status CopyExtents(const uint8_t* src_base, std::span<const Extent> src, uint8_t* dst_base,
                   std::span<const Extent> dst, cudaStream_t stream);

}  // namespace kdn::kvbus::cuda
