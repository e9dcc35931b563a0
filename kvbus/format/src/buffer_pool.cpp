#include "kdn/kvbus/buffer_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "kdn/common/mutex.h"

namespace kdn::kvbus {

struct BufferPool::State {
  explicit State(uint64_t max_idle) : max_idle_bytes(max_idle) {}
  ~State() {
    for (auto& [bytes, list] : idle) {
      for (void* p : list) Unmap(p, bytes);
    }
  }

  // A fresh buffer, pre-faulted, through the map hook.
  Result<void*> Map(size_t bytes);
  // Through the unmap hook if the buffer was pinned.
  void Unmap(void* p, size_t bytes) {
    std::function<void(void*)> unpin;
    {
      MutexLock lock(mu);
      if (pinned.erase(p) > 0) {
        unpin = hooks.on_unmap;
        --stats.pinned;
      }
    }
    if (unpin) unpin(p);
    ::munmap(p, bytes);
  }

  // Takes back a buffer of class `bytes`: kept while the idle budget lasts.
  void Return(void* p, size_t bytes) {
    {
      MutexLock lock(mu);
      --stats.outstanding;
      stats.outstanding_bytes -= bytes;
      if (stats.idle_bytes + bytes <= max_idle_bytes) {
        idle[bytes].push_back(p);
        stats.idle_bytes += bytes;
        return;
      }
      ++stats.unmapped;
    }
    Unmap(p, bytes);
  }

  const uint64_t max_idle_bytes;
  mutable Mutex mu;
  std::map<size_t, std::vector<void*>> idle KDN_GUARDED_BY(mu);  // by class bytes
  BufferPoolStats stats KDN_GUARDED_BY(mu);
  BufferMapHooks hooks KDN_GUARDED_BY(mu);
  std::set<void*> pinned KDN_GUARDED_BY(mu);
};

namespace {

Result<void*> MapPrefaulted(size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) {
    return ResourceExhausted("chunk buffer pool: mmap of " + std::to_string(bytes) +
                             " bytes: " + std::strerror(errno));
  }
  return p;
}

}  // namespace

Result<void*> BufferPool::State::Map(size_t bytes) {
  KDN_ASSIGN_OR_RETURN(void* p, MapPrefaulted(bytes));
  std::function<bool(void*, size_t)> pin;
  {
    MutexLock lock(mu);
    ++stats.mapped;
    pin = hooks.on_map;
  }
  if (pin && pin(p, bytes)) {
    MutexLock lock(mu);
    pinned.insert(p);
    ++stats.pinned;
  }
  return p;
}

BufferPool::BufferPool(uint64_t max_idle_bytes) : state_(std::make_shared<State>(max_idle_bytes)) {}

BufferPool::~BufferPool() = default;

BufferPool& BufferPool::Default() {
  static BufferPool* pool = new BufferPool();  // outlives every static that holds a chunk
  return *pool;
}

size_t BufferPool::ClassBytes(size_t bytes) {
  static const size_t kPage = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  if (bytes <= kPage) return kPage;
  // The largest power of two not above bytes - 1, then quarters of it.
  const size_t top = std::bit_floor(bytes - 1);
  const size_t quarter = std::max(top / 4, kPage);
  const size_t rounded = (bytes + quarter - 1) / quarter * quarter;
  return (rounded + kPage - 1) / kPage * kPage;
}

Result<std::shared_ptr<uint8_t>> BufferPool::Acquire(size_t bytes) {
  if (bytes < kMinPooledBytes) {
    // Small pieces: the heap's own free lists serve them without faults.
    MutexLock lock(state_->mu);
    ++state_->stats.acquired;
    return std::shared_ptr<uint8_t>(new uint8_t[bytes == 0 ? 1 : bytes],
                                    std::default_delete<uint8_t[]>());
  }
  const size_t cls = ClassBytes(bytes);
  void* p = nullptr;
  {
    MutexLock lock(state_->mu);
    ++state_->stats.acquired;
    auto it = state_->idle.find(cls);
    if (it != state_->idle.end() && !it->second.empty()) {
      p = it->second.back();
      it->second.pop_back();
      state_->stats.idle_bytes -= cls;
      ++state_->stats.reused;
    }
  }
  if (p == nullptr) {
    KDN_ASSIGN_OR_RETURN(p, state_->Map(cls));
  }
  {
    MutexLock lock(state_->mu);
    ++state_->stats.outstanding;
    state_->stats.outstanding_bytes += cls;
  }
  std::shared_ptr<State> state = state_;
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(p),
                                  [state, cls](uint8_t* q) { state->Return(q, cls); });
}

Status BufferPool::Reserve(size_t bytes, int count) {
  if (bytes < kMinPooledBytes) return Status::Ok();
  const size_t cls = ClassBytes(bytes);
  for (int i = 0; i < count; ++i) {
    {
      MutexLock lock(state_->mu);
      if (state_->stats.idle_bytes + cls > state_->max_idle_bytes) return Status::Ok();
    }
    KDN_ASSIGN_OR_RETURN(void* p, state_->Map(cls));
    MutexLock lock(state_->mu);
    state_->idle[cls].push_back(p);
    state_->stats.idle_bytes += cls;
  }
  return Status::Ok();
}

void BufferPool::SetMapHooks(BufferMapHooks hooks) {
  std::map<size_t, std::vector<void*>> dropped;
  {
    MutexLock lock(state_->mu);
    state_->hooks = std::move(hooks);
    dropped.swap(state_->idle);
    state_->stats.idle_bytes = 0;
    for (auto& [bytes, list] : dropped) state_->stats.unmapped += list.size();
  }
  for (auto& [bytes, list] : dropped) {
    for (void* p : list) state_->Unmap(p, bytes);
  }
}

BufferPoolStats BufferPool::Stats() const {
  MutexLock lock(state_->mu);
  return state_->stats;
}

}  // namespace kdn::kvbus
