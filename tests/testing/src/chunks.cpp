#include "kdn/testing/chunks.h"

#include <gtest/gtest.h>

namespace kdn::testing {

std::shared_ptr<const kvbus::Chunk> MakeChunk(const kvbus::ChunkKey& key, uint64_t seed,
                                              const ChunkShape& shape) {
  kvbus::ChunkInfo info;
  info.key = key;
  info.model_fingerprint = shape.model;
  info.layers = shape.layers;
  info.kv_heads = shape.kv_heads;
  info.head_dim = shape.head_dim;
  info.tokens = shape.tokens;
  info.dtype = shape.dtype;
  info.position = shape.position;
  auto chunk = kvbus::Chunk::Build(info, [&](uint8_t* p) {
    for (uint64_t i = 0; i < info.payload_bytes(); ++i) {
      p[i] = static_cast<uint8_t>(seed * 31 + i * 7 + (i >> 8));
    }
  });
  EXPECT_TRUE(chunk.ok()) << chunk.status().ToString();
  return chunk.ok() ? *std::move(chunk) : nullptr;
}

std::vector<std::shared_ptr<const kvbus::Chunk>> MakeChunks(uint64_t key_high, uint64_t first_id,
                                                            int count, const ChunkShape& shape) {
  std::vector<std::shared_ptr<const kvbus::Chunk>> chunks;
  for (int i = 0; i < count; ++i) {
    const uint64_t id = first_id + static_cast<uint64_t>(i);
    chunks.push_back(MakeChunk(kvbus::ChunkKey{key_high, id}, id, shape));
  }
  return chunks;
}

}  // namespace kdn::testing
