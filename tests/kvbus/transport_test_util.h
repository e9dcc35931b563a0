#pragma once
// What the kvbus transport tests share (transport_test.cpp,
// transport_failfast_test.cpp): status assertions, chunks of a small shape,
// waiting for a condition, the receiver options (ShortLease for expiry), and a
// receiver played by hand on the wire.

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <string>
#include <zmq.hpp>

#include "kdn/kvbus/wire.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/transport.h"
#include "kdn/testing/chunks.h"

#define KDN_ASSERT_OK(expr)                        \
  do {                                             \
    const ::kdn::Status _kdn_s = (expr);           \
    ASSERT_TRUE(_kdn_s.ok()) << _kdn_s.ToString(); \
  } while (0)
#define KDN_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  KDN_ASSERT_OK_AND_ASSIGN_IMPL_(KDN_CONCAT_(_kdn_r_, __LINE__), lhs, expr)
#define KDN_ASSERT_OK_AND_ASSIGN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString();    \
  lhs = std::move(tmp).value()

namespace kdn::kvbus::transport_test {

using ChunkPtr = std::shared_ptr<const Chunk>;

// Anything that must finish finishes well within this; it bounds hangs only.
inline constexpr auto kNoHang = std::chrono::seconds(20);

// An f32 chunk of `tokens` tokens, 2 layers x 2 KV heads x head_dim 8
// (256 payload bytes per token), whose key and payload depend on `id`.
inline ChunkPtr MakeChunk(uint64_t id, uint32_t tokens = 4, uint32_t layers = 2,
                          uint32_t kv_heads = 2, uint32_t head_dim = 8) {
  return kdn::testing::MakeChunk(
      ChunkKey{0x7e57 + (id >> 32), id}, id,
      {.layers = layers, .kv_heads = kv_heads, .head_dim = head_dim, .tokens = tokens});
}

// 16 MiB of payload: 16 layers x 8 KV heads x head_dim 64 x 256 tokens, f32.
inline ChunkPtr MakeLargeChunk(uint64_t id) { return MakeChunk(id, 256, 16, 8, 64); }

inline std::vector<ChunkPtr> MakeChunks(uint64_t first_id, int count, uint32_t tokens = 4) {
  std::vector<ChunkPtr> chunks;
  for (int i = 0; i < count; ++i) chunks.push_back(MakeChunk(first_id + i, tokens));
  return chunks;
}

inline bool Eventually(const std::function<bool()>& done,
                       std::chrono::milliseconds limit = kNoHang) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// A lease no grant runs out of on a loaded machine: a grant that expires
// between the receiver's answer and the sender's bytes fails the chunk, and
// CI's two cores, shared with a sanitizer build, have stalled a sender past
// 300 ms. A test about expiry sets its lease with ShortLease.
inline constexpr auto kTestLease = std::chrono::seconds(10);
inline constexpr auto kShortLease = std::chrono::milliseconds(300);

inline ReceiverOptions TestReceiverOptions() {
  ReceiverOptions o;
  o.lease = kTestLease;
  o.heartbeat_interval = std::chrono::milliseconds(100);
  return o;
}

// `o` with a lease that runs out within the test (for the tests of expiry).
inline ReceiverOptions ShortLease(ReceiverOptions o = TestReceiverOptions()) {
  o.lease = kShortLease;
  return o;
}

// A receiver played by the test: a ROUTER socket that reads a sender's
// frames and answers the last sender heard from.
struct StandInReceiver {
  zmq::context_t ctx;
  zmq::socket_t router{ctx, zmq::socket_type::router};
  zmq::message_t peer;
  std::string endpoint;

  StandInReceiver() {
    router.set(zmq::sockopt::linger, 0);
    router.set(zmq::sockopt::rcvtimeo, 5000);
    router.bind("tcp://127.0.0.1:*");
    endpoint = router.get(zmq::sockopt::last_endpoint);
  }
  // The next message from a sender (UNAVAILABLE after 5 s of none); the
  // bytes that follow a chunk's header are read from `router` itself.
  Result<WireMessage> Next() {
    zmq::message_t frame;
    if (!router.recv(peer) || !router.recv(frame)) return Unavailable("no frame in 5 s");
    return DecodeWire(frame.data(), frame.size());
  }
  void Reply(const WireMessage& w) {
    auto e = EncodeWire(w);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    router.send(zmq::buffer(peer.to_string()), zmq::send_flags::sndmore);
    router.send(*e, zmq::send_flags::none);
  }
};

}  // namespace kdn::kvbus::transport_test
