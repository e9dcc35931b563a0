// KV events (kdn/kvbus/kv_events.h): which events a HostTier's changes
// make, and the publisher's sockets (sequence numbers, replay). The payload
// is decoded by references nobody here wrote in tests/deploy/test_kv_events.py
// (msgpack) and scripts/test-vllm.sh (vLLM's own event classes).

#include "kdn/kvbus/kv_events.h"

#include <gtest/gtest.h>
#include <zmq.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/tiered_store.h"
#include "kdn/testing/chunks.h"

namespace kdn::kvbus {
namespace {

using namespace std::chrono_literals;

constexpr int kChunkTokens = 4;

std::shared_ptr<const Chunk> ChunkUnder(const ChunkKey& key, uint64_t seed) {
  return kdn::testing::MakeChunk(
      key, seed,
      {.layers = 1, .kv_heads = 1, .head_dim = 4, .tokens = kChunkTokens, .model = ChunkKey{7, 7}});
}

// The events a HostTierEvents hands out, with a host tier of `chunks`
// chunks.
struct Rig {
  explicit Rig(int chunks)
      : host(static_cast<uint64_t>(chunks) * ChunkUnder({1, 1}, 1)->size()),
        events(host, kChunkTokens, [this](KvEvent e) { seen.push_back(std::move(e)); }) {}
  HostTier host;
  std::vector<KvEvent> seen;
  HostTierEvents events;
};

std::vector<int32_t> Tokens(int n, int32_t first) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = first + i;
  return t;
}

TEST(HostTierEvents, AnnouncesDescribedPrefixChunksAsTheyComeAndGo) {
  Rig rig(2);
  const std::vector<int32_t> tokens = Tokens(3 * kChunkTokens + 2, 100);  // 3 chunks and a tail
  const std::vector<ChunkKey> keys = PrefixKeys({ChunkKey{7, 7}, "", kChunkTokens}, tokens);
  ASSERT_EQ(keys.size(), 3u);
  rig.events.Describe(tokens, keys);

  ASSERT_TRUE(rig.host.Put(ChunkUnder(keys[0], 1)).ok());
  ASSERT_TRUE(rig.host.Put(ChunkUnder(keys[1], 2)).ok());
  ASSERT_EQ(rig.seen.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    const KvEvent& e = rig.seen[i];
    EXPECT_EQ(e.kind, KvEvent::Kind::kStored);
    ASSERT_EQ(e.keys.size(), 1u);
    EXPECT_EQ(e.keys[0], keys[i]);
    EXPECT_EQ(e.block_size, kChunkTokens);
    EXPECT_EQ(e.tokens, std::vector<int32_t>(tokens.begin() + i * kChunkTokens,
                                             tokens.begin() + (i + 1) * kChunkTokens));
    EXPECT_EQ(e.medium, KvMedium::kCpu);
  }
  EXPECT_FALSE(rig.seen[0].parent.has_value()) << "the first chunk starts the prompt";
  ASSERT_TRUE(rig.seen[1].parent.has_value());
  EXPECT_EQ(*rig.seen[1].parent, keys[0]);

  // A chunk already held, put again: nothing new.
  ASSERT_TRUE(rig.host.Put(ChunkUnder(keys[1], 2)).ok());
  EXPECT_EQ(rig.seen.size(), 2u);

  // The third evicts the least recently used (the first): its removal
  // comes before the third's arrival, as the tier changed.
  ASSERT_TRUE(rig.host.Put(ChunkUnder(keys[2], 3)).ok());
  ASSERT_EQ(rig.seen.size(), 4u);
  EXPECT_EQ(rig.seen[2].kind, KvEvent::Kind::kRemoved);
  EXPECT_EQ(rig.seen[2].keys, std::vector<ChunkKey>{keys[0]});
  EXPECT_EQ(rig.seen[3].kind, KvEvent::Kind::kStored);
  EXPECT_EQ(rig.seen[3].keys, std::vector<ChunkKey>{keys[2]});
  EXPECT_EQ(rig.events.announced(), 2u);

  // Erased: removed.
  ASSERT_TRUE(rig.host.Erase(keys[2]));
  ASSERT_EQ(rig.seen.size(), 5u);
  EXPECT_EQ(rig.seen[4].kind, KvEvent::Kind::kRemoved);
  EXPECT_EQ(rig.seen[4].keys, std::vector<ChunkKey>{keys[2]});
}

// What a worker writes through to its shared tier is announced once as
// stored there (medium STORAGE), by a TieredStore's put listener as a
// worker wires it (worker::StartKvEvents).
TEST(HostTierEvents, AnnouncesWhatTheWorkerWroteToItsSharedTier) {
  const uint64_t chunk = ChunkUnder({1, 1}, 1)->size();
  std::vector<std::unique_ptr<ChunkStore>> tiers;
  tiers.push_back(std::make_unique<HostTier>(8 * chunk));
  tiers.push_back(std::make_unique<HostTier>(0));  // stands for kdn-store
  TieredStore store(std::move(tiers), {.write_through = true});
  std::vector<KvEvent> seen;
  auto events = std::make_shared<HostTierEvents>(*store.host(), kChunkTokens,
                                                 [&](KvEvent e) { seen.push_back(std::move(e)); });
  store.SetPutListener([&](size_t tier, const ChunkKey& key) {
    EXPECT_EQ(tier, 1u);
    events->WroteShared(key);
  });
  const std::vector<int32_t> tokens = Tokens(2 * kChunkTokens, 300);
  const std::vector<ChunkKey> keys = PrefixKeys({ChunkKey{7, 7}, "", kChunkTokens}, tokens);
  events->Describe(tokens, keys);
  ASSERT_TRUE(store.Put(ChunkUnder(keys[0], 1)).ok());
  ASSERT_TRUE(store.Put(ChunkUnder(keys[1], 2)).ok());
  ASSERT_TRUE(store.Put(ChunkUnder(keys[1], 2)).ok());         // again: nothing new
  ASSERT_TRUE(store.Put(ChunkUnder(ChunkKey{9, 9}, 3)).ok());  // never described
  std::vector<std::pair<ChunkKey, KvMedium>> stored;
  for (const KvEvent& e : seen) {
    ASSERT_EQ(e.kind, KvEvent::Kind::kStored);
    stored.emplace_back(e.keys.at(0), e.medium);
  }
  EXPECT_EQ(stored, (std::vector<std::pair<ChunkKey, KvMedium>>{{keys[0], KvMedium::kCpu},
                                                                {keys[0], KvMedium::kStorage},
                                                                {keys[1], KvMedium::kCpu},
                                                                {keys[1], KvMedium::kStorage}}));
  EXPECT_EQ(seen[3].tokens, std::vector<int32_t>(tokens.begin() + kChunkTokens, tokens.end()));
  ASSERT_TRUE(seen[3].parent.has_value());
  EXPECT_EQ(*seen[3].parent, keys[0]);
  store.SetPutListener(nullptr);
}

TEST(HostTierEvents, ChunksNeverDescribedAreNeitherAnnouncedNorRemoved) {
  Rig rig(1);
  // A segment or tail piece: its key names no described prefix chunk.
  ASSERT_TRUE(rig.host.Put(ChunkUnder({5, 5}, 1)).ok());
  EXPECT_TRUE(rig.seen.empty());
  // A described one evicts it: its own arrival alone is announced.
  const std::vector<int32_t> tokens = Tokens(kChunkTokens, 1);
  const std::vector<ChunkKey> keys = PrefixKeys({ChunkKey{7, 7}, "", kChunkTokens}, tokens);
  rig.events.Describe(tokens, keys);
  ASSERT_TRUE(rig.host.Put(ChunkUnder(keys[0], 2)).ok());
  ASSERT_EQ(rig.seen.size(), 1u);
  EXPECT_EQ(rig.seen[0].kind, KvEvent::Kind::kStored);
  // A prompt shorter than a chunk describes nothing.
  rig.events.Describe(Tokens(kChunkTokens - 1, 9), {});
  EXPECT_EQ(rig.events.announced(), 1u);
}

TEST(HostTierEvents, KeepsTheTokensOfTheChunksDescribedMostRecently) {
  HostTier host(0);
  std::vector<KvEvent> seen;
  HostTierEvents events(
      host, kChunkTokens, [&](KvEvent e) { seen.push_back(std::move(e)); },
      /*max_described=*/2);
  std::vector<std::vector<ChunkKey>> keys;
  for (int32_t p = 0; p < 3; ++p) {
    const std::vector<int32_t> tokens = Tokens(kChunkTokens, 10 * p);
    keys.push_back(PrefixKeys({ChunkKey{7, 7}, "", kChunkTokens}, tokens));
    events.Describe(tokens, keys.back());
  }
  // The oldest description was let go: its chunk is not announced.
  for (int p = 0; p < 3; ++p) ASSERT_TRUE(host.Put(ChunkUnder(keys[p][0], p)).ok());
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].keys[0], keys[1][0]);
  EXPECT_EQ(seen[1].keys[0], keys[2][0]);
}

TEST(KvEvents, EncodesTheClearedEventAsMsgpackSpellsIt) {
  // msgpack: fixarray of 3, float64 ts, fixarray of 1, fixmap of 1,
  // fixstr "type", fixstr "AllBlocksCleared", positive fixint 0 (the rank).
  const KvEvent cleared{.kind = KvEvent::Kind::kCleared};
  const std::string b = EncodeKvEventBatch(1.5, std::span(&cleared, 1));
  const std::string want = std::string("\x93\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\x91\x81", 12) +
                           "\xa4type" + "\xb0" + "AllBlocksCleared" + std::string(1, '\0');
  EXPECT_EQ(b, want);
  EXPECT_EQ(BlockHash(ChunkKey{0x0102030405060708ull, 9}), 0x0102030405060708ull);
}

// The sequence number of a message's second frame (8 bytes, big-endian).
int64_t Seq(const zmq::message_t& m) {
  EXPECT_EQ(m.size(), 8u);
  uint64_t v = 0;
  for (size_t i = 0; i < m.size(); ++i) v = (v << 8) | m.data<uint8_t>()[i];
  return static_cast<int64_t>(v);
}

std::vector<zmq::message_t> ReceiveAll(zmq::socket_t& s) {
  std::vector<zmq::message_t> frames;
  do {
    zmq::message_t f;
    if (!s.recv(f)) break;
    frames.push_back(std::move(f));
  } while (frames.back().more());
  return frames;
}

TEST(KvEventPublisher, PublishesNumberedBatchesAndReplaysThemFromAnyNumber) {
  auto pub = KvEventPublisher::Start({.endpoint = "tcp://127.0.0.1:0",
                                      .replay_endpoint = "tcp://127.0.0.1:0",
                                      .topic = "kv",
                                      .batch_window = 1ms});
  ASSERT_TRUE(pub.ok()) << pub.status().ToString();
  zmq::context_t ctx;
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::rcvtimeo, 30000);
  sub.set(zmq::sockopt::subscribe, "kv");
  sub.connect((*pub)->endpoint());
  // A subscriber sees only what is sent after it joined: events go out
  // until one reaches it.
  std::vector<zmq::message_t> first;
  sub.set(zmq::sockopt::rcvtimeo, 20);
  for (int i = 0; i < 1500 && first.empty(); ++i) {
    (*pub)->Publish({.kind = KvEvent::Kind::kRemoved, .keys = {ChunkKey{1, 2}}});
    first = ReceiveAll(sub);
  }
  ASSERT_EQ(first.size(), 3u) << "no batch reached the subscriber";
  sub.set(zmq::sockopt::rcvtimeo, 30000);
  EXPECT_EQ(first[0].to_string(), "kv");
  int64_t seq = Seq(first[1]);  // 0 (the AllBlocksCleared sent at start) if it joined in time
  // Then every batch, numbered one after another (a batch that was
  // forming when the subscriber joined comes first).
  for (int i = 0; i < 3; ++i) {
    (*pub)->Publish({.kind = KvEvent::Kind::kCleared});
    std::vector<zmq::message_t> next = ReceiveAll(sub);
    ASSERT_EQ(next.size(), 3u);
    EXPECT_EQ(Seq(next[1]), ++seq);
  }

  // Replay from batch 0: every batch kept, in order, then the end marker.
  zmq::socket_t req(ctx, zmq::socket_type::dealer);
  req.set(zmq::sockopt::rcvtimeo, 30000);
  req.connect((*pub)->replay_endpoint());
  const auto ask = [&](int64_t from) {
    std::string start(8, '\0');
    for (int i = 0; i < 8; ++i)
      start[i] = static_cast<char>(static_cast<uint64_t>(from) >> (56 - 8 * i));
    req.send(zmq::buffer(std::string_view()), zmq::send_flags::sndmore);
    req.send(zmq::buffer(start), zmq::send_flags::none);
    std::vector<int64_t> got;
    for (;;) {
      std::vector<zmq::message_t> m = ReceiveAll(req);
      EXPECT_EQ(m.size(), 4u);  // "", topic, seq, payload
      if (m.size() != 4) return got;
      if (Seq(m[2]) == -1) {
        EXPECT_EQ(m[1].size(), 0u);
        return got;
      }
      EXPECT_EQ(m[1].to_string(), "kv");
      EXPECT_GT(m[3].size(), 0u);
      got.push_back(Seq(m[2]));
    }
  };
  // (A batch the subscriber has not read yet may be kept too.)
  const std::vector<int64_t> all = ask(0);
  ASSERT_GE(static_cast<int64_t>(all.size()), seq + 1);
  for (size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i], static_cast<int64_t>(i));
  EXPECT_EQ(ask(all.back()), std::vector<int64_t>{all.back()});
  EXPECT_TRUE(ask(int64_t{1} << 40).empty()) << "nothing kept from a number not sent yet";
  const KvEventsStats stats = (*pub)->Stats();
  EXPECT_GE(stats.batches, all.size());
  EXPECT_EQ(stats.replays, 3u);
}

TEST(KvEventPublisher, RefusesNoEndpointAndOneItCannotBind) {
  EXPECT_EQ(KvEventPublisher::Start({}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(KvEventPublisher::Start({.endpoint = "tcp://256.1.1.1:1"}).status().code(),
            StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kdn::kvbus
