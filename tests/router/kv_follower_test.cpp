// The router's side of the KV events (kdn/router/kv_follower.h): an index fed
// batches in order, and a follower of a real publisher's stream
// (kdn/kvbus/kv_events.h) that joins late and catches up by replay.
#include "kdn/router/kv_follower.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include <nlohmann/json.hpp>

#include "kdn/kvbus/kv_events.h"

namespace kdn::router {
namespace {

using kvbus::ChunkKey;
using kvbus::KvEvent;
using Take = WorkerKvIndex::Take;

std::string Batch(std::vector<KvEvent> events) { return kvbus::EncodeKvEventBatch(1.0, events); }
KvEvent Stored(std::vector<ChunkKey> keys) {
  return {.kind = KvEvent::Kind::kStored,
          .keys = keys,
          .tokens = std::vector<int32_t>(keys.size() * 4, 7),
          .block_size = 4};
}
KvEvent Removed(std::vector<ChunkKey> keys) {
  return {.kind = KvEvent::Kind::kRemoved, .keys = keys};
}

const ChunkKey kA{11, 1}, kB{12, 2}, kC{13, 3};

TEST(WorkerKvIndex, AppliesBatchesInOrderAndRefusesToGuessAcrossAGap) {
  WorkerKvIndex index;
  const std::vector<ChunkKey> prompt = {kA, kB, kC};
  EXPECT_FALSE(index.Prefix(prompt).has_value());  // nothing followed yet
  // A stream joined after its start is not trusted.
  EXPECT_EQ(index.Offer(4, Batch({Stored({kA})})), Take::kGap);
  EXPECT_FALSE(index.synced());
  EXPECT_EQ(index.Offer(0, Batch({{.kind = KvEvent::Kind::kCleared}})), Take::kApplied);
  EXPECT_EQ(index.Prefix(prompt), 0u);
  EXPECT_EQ(index.Offer(1, Batch({Stored({kA, kB}), Stored({kC})})), Take::kApplied);
  EXPECT_EQ(index.Prefix(prompt), 3u);
  EXPECT_EQ(index.Offer(3, Batch({Removed({kA})})), Take::kGap);  // batch 2 is missing
  EXPECT_EQ(index.Prefix(prompt), 3u);
  EXPECT_EQ(index.Offer(2, Batch({Removed({kB})})), Take::kApplied);
  EXPECT_EQ(index.Prefix(prompt), 1u);  // C is held, but past a block that is not
  EXPECT_EQ(index.Offer(1, Batch({Stored({kB})})), Take::kOld);
  EXPECT_EQ(index.Offer(3, Batch({Removed({kA})})), Take::kApplied);
  EXPECT_EQ(index.Prefix(prompt), 0u);
  EXPECT_EQ(index.blocks(), 1u);
  EXPECT_EQ(index.next(), 4u);
  // Damaged, the index is lost until the stream starts again.
  EXPECT_EQ(index.Offer(4, "\xc1 not msgpack"), Take::kBad);
  EXPECT_FALSE(index.Prefix(prompt).has_value());
  EXPECT_EQ(index.Offer(5, Batch({})), Take::kGap);
  // A worker that restarts starts at 0 again, holding nothing.
  EXPECT_EQ(index.Offer(0, Batch({Stored({kA})})), Take::kApplied);
  EXPECT_EQ(index.Prefix(prompt), 1u);
  EXPECT_EQ(index.blocks(), 1u);
}

// vLLM's own encodings: events as arrays (array_like), hashes as bytes; a
// type the index does not know changes nothing; a malformed event refuses
// the whole batch.
TEST(WorkerKvIndex, ReadsVllmsArrayFormAndByteHashes) {
  using nlohmann::json;
  WorkerKvIndex index;
  auto bytes_of = [](uint64_t hash) {
    std::vector<uint8_t> b(32, 0xee);  // a SHA-256 digest's length
    for (int i = 0; i < 8; ++i) b[i] = static_cast<uint8_t>(hash >> (56 - 8 * i));
    return json::binary(b);
  };
  auto pack = [](const json& batch) {
    const std::vector<uint8_t> v = json::to_msgpack(batch);
    return std::string(v.begin(), v.end());
  };
  ASSERT_EQ(
      index.Offer(0, pack(json::array({1.5, json::array({json::array({"AllBlocksCleared"})}), 0}))),
      Take::kApplied);
  const json stored = json::array({"BlockStored", json::array({11, bytes_of(12)}), nullptr,
                                   json::array({1, 2}), 1, nullptr, "GPU"});
  const json other = json::array({"SomethingNew", json::array({13})});
  ASSERT_EQ(index.Offer(1, pack(json::array({1.5, json::array({stored, other}), 0}))),
            Take::kApplied);
  const std::vector<ChunkKey> prompt = {kA, kB, kC};
  EXPECT_EQ(index.Prefix(prompt), 2u);
  const json bad = json::array({"BlockRemoved", json::array({"eleven"})});
  EXPECT_EQ(index.Offer(2, pack(json::array({1.5, json::array({bad}), 0}))), Take::kBad);
}

TEST(ReachableEndpoint, AWildcardHostBecomesThePeersHost) {
  EXPECT_EQ(ReachableEndpoint("tcp://0.0.0.0:5557", "tcp://10.0.0.7:7001"), "tcp://10.0.0.7:5557");
  EXPECT_EQ(ReachableEndpoint("tcp://*:5557", "tcp://node3:7001"), "tcp://node3:5557");
  EXPECT_EQ(ReachableEndpoint("tcp://127.0.0.1:5557", "tcp://10.0.0.7:7001"),
            "tcp://127.0.0.1:5557");
  EXPECT_EQ(ReachableEndpoint("ipc:///tmp/kv", "tcp://10.0.0.7:7001"), "ipc:///tmp/kv");
}

// Waits until `done` holds, at most 30 s; true when it did.
template <typename Fn>
bool WaitFor(Fn&& done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

TEST(KvFollower, JoinsAStreamLateAndCatchesUpByReplay) {
  auto pub = kvbus::KvEventPublisher::Start({.endpoint = "tcp://127.0.0.1:0",
                                             .replay_endpoint = "tcp://127.0.0.1:0",
                                             .topic = "kv",
                                             .batch_window = std::chrono::milliseconds(1)});
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  // What the worker holds before any router follows it.
  (*pub)->Publish(Stored({kA, kB}));
  ASSERT_TRUE(WaitFor([&] { return (*pub)->Stats().events >= 2; }));  // and the first clear
  KvFollower follower;
  const std::vector<ChunkKey> prompt = {kA, kB, kC};
  EXPECT_FALSE(follower.Prefix(0, prompt).has_value());
  follower.Follow(0, (*pub)->endpoint(), (*pub)->replay_endpoint(), "kv", "s1");
  ASSERT_TRUE(WaitFor([&] { return follower.Prefix(0, prompt) == 2u; }))
      << "the replay never brought the blocks stored before the router followed";
  EXPECT_GE(follower.Stats().replays, 1u);
  // Then live.
  (*pub)->Publish(Stored({kC}));
  ASSERT_TRUE(WaitFor([&] { return follower.Prefix(0, prompt) == 3u; }));
  (*pub)->Publish(Removed({kA}));
  ASSERT_TRUE(WaitFor([&] { return follower.Prefix(0, prompt) == 0u; }));
  EXPECT_FALSE(follower.Prefix(1, prompt).has_value());  // a worker not followed
  follower.Forget(0);
  ASSERT_TRUE(WaitFor([&] { return !follower.Prefix(0, prompt).has_value(); }));
}

// A worker that restarts on the same endpoints: its new stream's batch 0
// goes out before the router's sockets reconnect, and its numbers may run
// past the old stream's; the new stream's name (the worker's next report)
// starts the index over, and until the new stream is followed the index
// answers nothing.
TEST(KvFollower, FollowsAWorkerThatRestartedFromItsNewStart) {
  kvbus::KvEventsOptions options{.endpoint = "tcp://127.0.0.1:0",
                                 .replay_endpoint = "tcp://127.0.0.1:0",
                                 .topic = "kv",
                                 .batch_window = std::chrono::milliseconds(1)};
  auto pub = kvbus::KvEventPublisher::Start(options);
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  KvFollower follower;
  follower.Follow(0, (*pub)->endpoint(), (*pub)->replay_endpoint(), "kv", "s1");
  const std::vector<ChunkKey> old_prompt = {kA, kB}, new_prompt = {kC};
  for (int i = 0; i < 5; ++i) (*pub)->Publish(Stored({kA, kB}));
  ASSERT_TRUE(WaitFor([&] { return follower.Prefix(0, old_prompt) == 2u; }));
  // Batches past the new stream's first few, so that they number below.
  ASSERT_TRUE(WaitFor([&] {
    (*pub)->Publish(Stored({kA, kB}));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return follower.Status(0).has_value() && follower.Status(0)->next >= 5;
  }));
  options.endpoint = (*pub)->endpoint();
  options.replay_endpoint = (*pub)->replay_endpoint();
  pub->reset();
  auto restarted = kvbus::KvEventPublisher::Start(options);
  ASSERT_TRUE(restarted.ok()) << restarted.status().ToString();
  // The new stream runs past the old one's numbers before the router hears
  // of it.
  ASSERT_TRUE(WaitFor([&] {
    (*restarted)->Publish(Stored({kC}));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return (*restarted)->Stats().batches > follower.Status(0)->next + 5;
  }));
  follower.Follow(0, options.endpoint, options.replay_endpoint, "kv", "s2");
  EXPECT_FALSE(follower.Prefix(0, old_prompt).has_value());
  ASSERT_TRUE(WaitFor([&] {
    (*restarted)->Publish(Stored({kC}));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    return follower.Prefix(0, new_prompt) == 1u;
  })) << "the follower kept the old stream's index";
  EXPECT_EQ(follower.Prefix(0, old_prompt), 0u);
}

// Without a replay socket, a stream joined after its first batch never
// answers: what came before is not known.
TEST(KvFollower, AStreamMissedFromItsStartWithoutReplayNeverAnswers) {
  auto pub = kvbus::KvEventPublisher::Start({.endpoint = "tcp://127.0.0.1:0",
                                             .topic = "kv",
                                             .batch_window = std::chrono::milliseconds(1)});
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return (*pub)->Stats().batches >= 1; }));
  KvFollower follower;
  follower.Follow(0, (*pub)->endpoint(), "", "kv", "s1");
  // Batches flow (the follower applies none of them: each is past a gap).
  for (int i = 0; i < 50; ++i) {
    (*pub)->Publish(Stored({kA}));
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_TRUE(WaitFor([&] { return (*pub)->Stats().batches >= 20; }));
  const std::vector<ChunkKey> prompt = {kA};
  EXPECT_FALSE(follower.Prefix(0, prompt).has_value());
  EXPECT_EQ(follower.Stats().batches, 0u);
}

}  // namespace
}  // namespace kdn::router
