#pragma once
// BufferPool: recycled, pre-faulted memory for chunk bytes (docs/kvbus.md,
// "Chunk buffers"). A fresh allocation of a few MiB costs a page fault per
// 4 KiB on first touch, which made building a chunk into the host tier run
// at about an eighth of memcpy. The pool hands out buffers whose pages are
// already resident (mmap with MAP_POPULATE) and takes them back when their
// last owner lets go, keeping up to `max_idle_bytes` of them for reuse.
//
// Sizes are rounded up to a class (2^k, 1.25, 1.5 or 1.75 times 2^k, at
// least a page), so that chunks and tail pieces of many sizes share a few
// free lists and at most a fifth of a buffer is slack. Requests under
// kMinPooledBytes are ordinary heap allocations.
//
// A process whose engine runs on a GPU pins the pool's buffers (SetMapHooks),
// so that chunks built from device KV, and the KV loaded back from them, are
// copied by DMA at the link's rate rather than through the driver's staging.
//
// Thread-safe. A buffer may outlive its pool (the pool's state is shared
// with every buffer it handed out). Chunk::Build and the transports'
// receivers take their buffers from BufferPool::Default().

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "kdn/common/status.h"

namespace kdn::kvbus {

struct BufferPoolStats {
  uint64_t acquired = 0;     // Acquire calls served
  uint64_t reused = 0;       // of those, served from an idle buffer
  uint64_t mapped = 0;       // buffers mapped (pre-faulted) so far
  uint64_t unmapped = 0;     // buffers given back to the OS
  uint64_t outstanding = 0;  // buffers handed out and not yet returned, now
  uint64_t outstanding_bytes = 0;
  uint64_t idle_bytes = 0;  // kept for reuse, now
  uint64_t pinned = 0;      // buffers the map hook pinned, now mapped
};

// Called on every buffer the pool maps, and before it unmaps one that
// on_map said it pinned. Each must be safe to call from any thread.
struct BufferMapHooks {
  std::function<bool(void* p, size_t bytes)> on_map;  // true: pinned
  std::function<void(void* p)> on_unmap;
};

class BufferPool {
 public:
  static constexpr size_t kMinPooledBytes = size_t{64} << 10;

  explicit BufferPool(uint64_t max_idle_bytes = uint64_t{1} << 30);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // The process's pool (1 GiB of idle buffers at most; never destroyed).
  static BufferPool& Default();

  // A writable buffer of at least `bytes` bytes, its pages resident. The
  // returned pointer's deleter gives it back. RESOURCE_EXHAUSTED when the
  // memory cannot be mapped.
  Result<std::shared_ptr<uint8_t>> Acquire(size_t bytes);

  // Maps `count` buffers of the class of `bytes` into the idle list ahead
  // of use (within max_idle_bytes), so that the first chunks of a run do not
  // fault either.
  Status Reserve(size_t bytes, int count);

  BufferPoolStats Stats() const;

  // Installs (or, with empty hooks, removes) the map hooks for the buffers
  // mapped from now on; those mapped before stay as they were. Idle buffers
  // mapped before are dropped, so that new ones get the hooks.
  void SetMapHooks(BufferMapHooks hooks);

  // The class `bytes` rounds up to (what Acquire maps for it).
  static size_t ClassBytes(size_t bytes);

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace kdn::kvbus
