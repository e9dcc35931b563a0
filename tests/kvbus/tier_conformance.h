#pragma once
// The contract every KDN tier keeps (kdn/kvbus/chunk_store.h), as one
// value-parameterized suite: a tier joins the KDN by passing it. Each test
// gets a fresh harness from the TierMaker; keys carry a random salt per
// test, so a harness may share one server (a Redis Cluster) across tests.
//
//   INSTANTIATE_TEST_SUITE_P(Local, TierConformance,
//                            ::testing::Values(TierMaker{"host", ...}), TierName);

#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/chunk_store.h"
#include "kdn/kvbus/key.h"
#include "kdn/testing/temp_dir.h"
#include "kdn/testing/chunks.h"

namespace kdn::kvbus::testing {

// The model fingerprint of every chunk the suite writes.
inline constexpr ChunkKey kConformanceModel{0x6b646e2d74696572ull, 1};

// One tier under test and whatever it needs alive (a server, a folder).
class TierHarness {
 public:
  virtual ~TierHarness() = default;
  virtual ChunkStore& store() = 0;
};

struct TierMaker {
  std::string name;
  // Null: the tier cannot run here (a missing program); the test skips.
  std::function<std::unique_ptr<TierHarness>(const std::filesystem::path& dir)> make;
};

inline std::string TierName(const ::testing::TestParamInfo<TierMaker>& info) {
  return info.param.name;
}

// A harness over a store it owns, plus anything else kept alive.
template <class Keep = int>
class OwnedTier : public TierHarness {
 public:
  OwnedTier(std::unique_ptr<ChunkStore> store, std::unique_ptr<Keep> keep = nullptr)
      : keep_(std::move(keep)), store_(std::move(store)) {}
  ChunkStore& store() override { return *store_; }

 private:
  std::unique_ptr<Keep> keep_;  // destroyed after the store
  std::unique_ptr<ChunkStore> store_;
};

// The chunks the suite writes: keys salted per test, payloads by id.
class ConformanceChunks {
 protected:
  ConformanceChunks()
      : salt_(std::random_device{}() * 0x9e3779b97f4a7c15ull + std::random_device{}()) {}

  ChunkKey Key(uint64_t id) const { return ChunkKey{salt_ ^ (id * 0xff51afd7ed558ccdull), id}; }

  // An f32 chunk whose payload depends on `id`: 4 tokens (640 bytes), or
  // with `big`, 64 tokens of 4 layers x 8 heads x 64 dims (1 MiB of KV).
  std::shared_ptr<const Chunk> Make(uint64_t id, bool big = false) const {
    return MakeWithKey(Key(id), id, big);
  }
  std::shared_ptr<const Chunk> MakeWithKey(const ChunkKey& key, uint64_t id,
                                           bool big = false) const {
    return kdn::testing::MakeChunk(key, id,
                                   {.layers = big ? 4u : 1u,
                                    .kv_heads = big ? 8u : 1u,
                                    .head_dim = big ? 64u : 4u,
                                    .tokens = big ? 64u : 4u,
                                    .model = kConformanceModel});
  }

  // The same chunk (key, header fields, payload) as `want`.
  static void ExpectSame(const Chunk& got, const Chunk& want) {
    EXPECT_EQ(got.key(), want.key());
    EXPECT_EQ(got.info().tokens, want.info().tokens);
    EXPECT_EQ(got.info().model_fingerprint, want.info().model_fingerprint);
    ASSERT_EQ(got.payload().size(), want.payload().size());
    EXPECT_TRUE(std::equal(got.payload().begin(), got.payload().end(), want.payload().begin()));
  }

  const uint64_t salt_;
};

class TierConformance : public ::testing::TestWithParam<TierMaker>, protected ConformanceChunks {
 protected:
  void SetUp() override {
    harness_ = GetParam().make(dir_.path());
    if (harness_ == nullptr) GTEST_SKIP() << GetParam().name << " cannot run on this machine";
  }
  ChunkStore& store() { return harness_->store(); }

  kdn::testing::TempDir dir_;
  std::unique_ptr<TierHarness> harness_;
};

TEST_P(TierConformance, AMissIsNotFoundAndNotHeld) {
  auto got = store().Get(Key(1));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kNotFound) << got.status().ToString();
  EXPECT_FALSE(store().Contains(Key(1)));
  EXPECT_EQ(store().ContainsMany(std::vector<ChunkKey>{Key(1), Key(2)}),
            std::vector<bool>({false, false}));
  EXPECT_TRUE(store().ContainsMany({}).empty());
}

TEST_P(TierConformance, PutThenGetGivesTheSameChunk) {
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(store().Put(Make(id)).ok());
  for (uint64_t id = 1; id <= 3; ++id) {
    auto got = store().Get(Key(id));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ExpectSame(**got, *Make(id));
  }
}

TEST_P(TierConformance, PresenceInOrderWithoutCountingAHit) {
  ASSERT_TRUE(store().Put(Make(1)).ok());
  ASSERT_TRUE(store().Put(Make(3)).ok());
  const uint64_t hits = store().Stats().hits;
  EXPECT_TRUE(store().Contains(Key(1)));
  EXPECT_FALSE(store().Contains(Key(2)));
  EXPECT_EQ(store().ContainsMany(std::vector<ChunkKey>{Key(1), Key(2), Key(3), Key(4), Key(1)}),
            std::vector<bool>({true, false, true, false, true}));
  EXPECT_EQ(store().Stats().hits, hits);
}

TEST_P(TierConformance, ARepeatedPutKeepsTheChunk) {
  ASSERT_TRUE(store().Put(Make(5)).ok());
  ASSERT_TRUE(store().Put(Make(5)).ok());
  auto got = store().Get(Key(5));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ExpectSame(**got, *Make(5));
}

TEST_P(TierConformance, StatsCountHitsMissesAndPuts) {
  const TierStats before = store().Stats();
  ASSERT_TRUE(store().Put(Make(6)).ok());
  ASSERT_TRUE(store().Get(Key(6)).ok());
  ASSERT_FALSE(store().Get(Key(7)).ok());
  const TierStats after = store().Stats();
  EXPECT_GE(after.puts, before.puts + 1);
  EXPECT_GE(after.hits, before.hits + 1);
  EXPECT_GE(after.misses, before.misses + 1);
  EXPECT_EQ(after.corrupt, before.corrupt);
  EXPECT_EQ(after.unreachable, before.unreachable);
}

TEST_P(TierConformance, AChunkOfAMegabyteRoundTrips) {
  auto big = Make(8, /*big=*/true);
  ASSERT_GE(big->payload().size(), size_t{1} << 20);
  ASSERT_TRUE(store().Put(big).ok());
  auto got = store().Get(Key(8));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ExpectSame(**got, *big);
}

TEST_P(TierConformance, ANullPutIsRefused) { EXPECT_FALSE(store().Put(nullptr).ok()); }

TEST_P(TierConformance, ThreadsPutAndGetAtOnce) {
  constexpr int kThreads = 4, kEach = 20;
  std::vector<std::thread> threads;
  std::vector<int> good(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const uint64_t id = 100 + static_cast<uint64_t>(t * kEach + i);
        if (!store().Put(Make(id)).ok()) continue;
        auto got = store().Get(Key(id));
        if (got.ok() && (*got)->key() == Key(id) &&
            std::equal((*got)->payload().begin(), (*got)->payload().end(),
                       Make(id)->payload().begin())) {
          ++good[static_cast<size_t>(t)];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t)
    EXPECT_EQ(good[static_cast<size_t>(t)], kEach) << "thread " << t;
}

}  // namespace kdn::kvbus::testing
