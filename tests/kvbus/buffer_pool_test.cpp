#include "kdn/kvbus/buffer_pool.h"

#include <gtest/gtest.h>

#include <cstring>

#include "kdn/kvbus/chunk.h"

namespace kdn::kvbus {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(BufferPool, RoundsSizesUpToAClassAtMostAQuarterLarger) {
  for (size_t bytes : {size_t{1}, size_t{4096}, size_t{70000}, kMiB, kMiB + 1, 3 * kMiB + 17,
                       8 * kMiB + 128, 1000 * kMiB + 5}) {
    const size_t cls = BufferPool::ClassBytes(bytes);
    EXPECT_GE(cls, bytes) << bytes;
    EXPECT_LE(cls, bytes + bytes / 4 + 4096) << bytes;
    EXPECT_EQ(BufferPool::ClassBytes(cls), cls) << "a class is its own class: " << bytes;
  }
}

TEST(BufferPool, HandsAReturnedBufferToTheNextAcquireOfItsClass) {
  BufferPool pool;
  void* first = nullptr;
  {
    auto a = pool.Acquire(2 * kMiB + 100);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    first = a->get();
    std::memset(a->get(), 7, 2 * kMiB + 100);  // writable, all of it
    EXPECT_EQ(pool.Stats().outstanding, 1u);
  }
  EXPECT_EQ(pool.Stats().outstanding, 0u);
  auto b = pool.Acquire(2 * kMiB + 50);  // same class
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->get(), first);
  const BufferPoolStats s = pool.Stats();
  EXPECT_EQ(s.mapped, 1u);
  EXPECT_EQ(s.reused, 1u);
  EXPECT_EQ(s.acquired, 2u);
}

TEST(BufferPool, KeepsNoMoreIdleBytesThanItsBudget) {
  BufferPool pool(3 * kMiB);
  {
    std::vector<std::shared_ptr<uint8_t>> held;
    for (int i = 0; i < 4; ++i) held.push_back(pool.Acquire(kMiB).value());
  }
  const BufferPoolStats s = pool.Stats();
  EXPECT_EQ(s.idle_bytes, 3 * kMiB);
  EXPECT_EQ(s.unmapped, 1u);
  EXPECT_EQ(s.outstanding, 0u);
  EXPECT_EQ(s.outstanding_bytes, 0u);
}

TEST(BufferPool, ReservesPrefaultedBuffersThatAcquireThenReuses) {
  BufferPool pool;
  ASSERT_TRUE(pool.Reserve(4 * kMiB, 3).ok());
  EXPECT_EQ(pool.Stats().idle_bytes, 3 * BufferPool::ClassBytes(4 * kMiB));
  auto a = pool.Acquire(4 * kMiB);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(pool.Stats().reused, 1u);
  EXPECT_EQ(pool.Stats().mapped, 3u);
}

TEST(BufferPool, LetsABufferOutliveItsPool) {
  std::shared_ptr<uint8_t> kept;
  {
    BufferPool pool;
    kept = pool.Acquire(kMiB).value();
  }
  kept.get()[kMiB - 1] = 1;  // still mapped; returned to the gone pool's state on release
  kept.reset();
}

TEST(BufferPool, ServesChunksBuiltAndParsedFromPooledBytes) {
  ChunkInfo info{.key = ChunkKey{1, 2},
                 .layers = 2,
                 .kv_heads = 2,
                 .head_dim = 64,
                 .tokens = 256,
                 .dtype = DType::kF32};
  auto built = Chunk::Build(info, [&](uint8_t* p) { std::memset(p, 3, info.payload_bytes()); });
  ASSERT_TRUE(built.ok());
  auto copy = BufferPool::Default().Acquire((*built)->size()).value();
  std::memcpy(copy.get(), (*built)->bytes().data(), (*built)->size());
  auto parsed = Chunk::Parse(std::shared_ptr<const uint8_t>(copy), (*built)->size());
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ((*parsed)->key(), info.key);
  auto damaged = BufferPool::Default().Acquire((*built)->size()).value();
  std::memcpy(damaged.get(), (*built)->bytes().data(), (*built)->size());
  damaged.get()[Chunk::kHeaderBytes + 5] ^= 1;
  EXPECT_EQ(Chunk::Parse(std::shared_ptr<const uint8_t>(damaged), (*built)->size()).status().code(),
            StatusCode::kCorruption);
}

TEST(BufferPool, MapHooksPinWhatIsMappedAndUnpinItBeforeUnmapping) {
  BufferPool pool(/*max_idle_bytes=*/0);  // every returned buffer is unmapped
  auto early = pool.Acquire(kMiB);
  ASSERT_TRUE(early.ok());
  std::vector<std::pair<void*, size_t>> pinned;
  std::vector<void*> unpinned;
  bool refuse = false;
  pool.SetMapHooks({[&](void* p, size_t bytes) {
                      if (refuse) return false;
                      pinned.emplace_back(p, bytes);
                      return true;
                    },
                    [&](void* p) { unpinned.push_back(p); }});
  void* at = nullptr;
  {
    auto a = pool.Acquire(3 * kMiB);
    ASSERT_TRUE(a.ok());
    at = a->get();
    ASSERT_EQ(pinned.size(), 1u);
    EXPECT_EQ(pinned[0].first, at);
    EXPECT_EQ(pinned[0].second, BufferPool::ClassBytes(3 * kMiB));
    EXPECT_EQ(pool.Stats().pinned, 1u);
    EXPECT_TRUE(unpinned.empty());
  }
  EXPECT_EQ(unpinned, std::vector<void*>{at});  // unpinned, then unmapped
  EXPECT_EQ(pool.Stats().pinned, 0u);
  early->reset();  // mapped before the hooks: never pinned, so never unpinned
  EXPECT_EQ(unpinned.size(), 1u);
  // A buffer the hook could not pin is not unpinned either.
  refuse = true;
  pool.Acquire(kMiB).value().reset();
  EXPECT_EQ(unpinned.size(), 1u);
  // Small pieces come from the heap: no hook.
  auto small = pool.Acquire(1000);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(pinned.size(), 1u);
}

TEST(BufferPool, NewHooksDropTheIdleBuffersMappedBefore) {
  BufferPool pool;
  void* first = pool.Acquire(2 * kMiB).value().get();  // returned at once: idle
  EXPECT_EQ(pool.Stats().idle_bytes, BufferPool::ClassBytes(2 * kMiB));
  int maps = 0;
  pool.SetMapHooks({[&](void*, size_t) { return ++maps, true; }, [](void*) {}});
  EXPECT_EQ(pool.Stats().idle_bytes, 0u);
  auto again = pool.Acquire(2 * kMiB);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(maps, 1);  // a fresh buffer, through the hook
  (void)first;
}

}  // namespace
}  // namespace kdn::kvbus
