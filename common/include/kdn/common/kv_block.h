#pragma once
// The paged KV cache's block: the tokens of KV one block holds. One constant
// for every process: the decode worker's cache allocates in these blocks
// (engine::KvCache) and the router counts a request's reservation in them
// (router/placement.h), so the two must agree.

#include <cstdint>

namespace kdn {

inline constexpr int kKvBlockTokens = 16;

// The blocks that hold `tokens` tokens of KV.
constexpr int64_t KvBlocksFor(int64_t tokens) {
  return (tokens + kKvBlockTokens - 1) / kKvBlockTokens;
}

}  // namespace kdn
