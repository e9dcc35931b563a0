#pragma once
// A ChunkStore for tests: a thread-safe map that records the order of Puts.

#include <mutex>
#include <unordered_map>
#include <vector>

#include "kdn/kvbus/chunk_store.h"

namespace kdn::testing {

// A thread-safe in-memory sink that records the order of its Puts.
class RecordingStore final : public kvbus::ChunkStore {
 public:
  std::string name() const override { return "recording"; }
  Result<std::shared_ptr<const kvbus::Chunk>> Get(const kvbus::ChunkKey& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = chunks_.find(key);
    if (it == chunks_.end()) return NotFound(key.ToHex());
    return it->second;
  }
  bool Contains(const kvbus::ChunkKey& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    return chunks_.count(key) != 0;
  }
  Status Put(std::shared_ptr<const kvbus::Chunk> chunk) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++puts_;
    if (chunks_.emplace(chunk->key(), chunk).second) order_.push_back(chunk->key());
    return Status::Ok();
  }
  kvbus::TierStats Stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    kvbus::TierStats s;
    s.chunks = chunks_.size();
    s.puts = puts_;
    return s;
  }
  std::vector<kvbus::ChunkKey> PutOrder() const {
    std::lock_guard<std::mutex> lock(mu_);
    return order_;
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return chunks_.size();
  }

 private:
  mutable std::mutex mu_;
  std::unordered_map<kvbus::ChunkKey, std::shared_ptr<const kvbus::Chunk>, kvbus::ChunkKeyHash>
      chunks_;
  std::vector<kvbus::ChunkKey> order_;
  uint64_t puts_ = 0;
};

}  // namespace kdn::testing
