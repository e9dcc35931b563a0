#pragma once
// Chunks for tests: a shape, a key, and a payload that depends on a seed, so
// that two chunks of one shape differ in their bytes and a copy that mixes
// them up shows.

#include <cstdint>
#include <memory>
#include <vector>

#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/key.h"

namespace kdn::testing {

struct ChunkShape {
  uint32_t layers = 2;
  uint32_t kv_heads = 2;
  uint32_t head_dim = 8;
  uint32_t tokens = 16;
  kdn::DType dtype = kdn::DType::kF32;
  int64_t position = 0;            // where the chunk's first token sits
  kvbus::ChunkKey model = {1, 2};  // the model fingerprint
};

// A chunk of `shape` under `key`, payload byte i = seed * 31 + i * 7 + i / 256
// (mod 256). A failure to build it is a test failure and null.
std::shared_ptr<const kvbus::Chunk> MakeChunk(const kvbus::ChunkKey& key, uint64_t seed,
                                              const ChunkShape& shape = {});

// `count` chunks of `shape`, keys {key_high, first_id + i}, seeded by id.
std::vector<std::shared_ptr<const kvbus::Chunk>> MakeChunks(uint64_t key_high, uint64_t first_id,
                                                            int count,
                                                            const ChunkShape& shape = {});

}  // namespace kdn::testing
