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
  ChunkInfo info{.key = ChunkKey{1, 2}, .layers = 2, .kv_heads = 2, .head_dim = 64,
                 .tokens = 256, .dtype = KvDType::kF32};
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

}  // namespace
}  // namespace kdn::kvbus
