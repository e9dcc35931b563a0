// Per-head kept tokens in a chunk (docs/kvbus.md, "Per-head kept tokens"):
// the header's flag, kept kind and raw size, the counts and positions
// under the payload checksum, what Make and Parse refuse.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <vector>

#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/codec.h"

namespace kdn::kvbus {
namespace {

constexpr ChunkKey kKey{0x0011223344556677ull, 0x8899aabbccddeeffull};
constexpr ChunkKey kFingerprint{0x0123456789abcdefull, 0xfedcba9876543210ull};

uint32_t Get32(const uint8_t* p) { return p[0] | p[1] << 8 | p[2] << 16 | uint32_t{p[3]} << 24; }

// 2 layers x 2 KV heads x head_dim 2, f32, standing for 8 tokens of text:
// the heads keep {0, 3}, {5}, {} and {1, 7}: 5 (head, token) pairs.
ChunkInfo HeadInfo() {
  ChunkInfo info{kKey, kFingerprint, 2, 2, 2, 0, DType::kF32, 0};
  info.logical_tokens = 8;
  info.SetHeadKept({2, 1, 0, 2}, {0, 3, 5, 1, 7});
  return info;
}
std::vector<uint8_t> HeadKv() {
  std::vector<uint8_t> kv(HeadInfo().payload_bytes());
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<uint8_t>(i * 13 + 1);
  return kv;
}
std::vector<uint8_t> BytesOf(const ChunkInfo& info, const std::vector<uint8_t>& kv) {
  auto c = Chunk::Make(info, kv);
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  return c.ok() ? std::vector<uint8_t>((*c)->bytes().begin(), (*c)->bytes().end())
                : std::vector<uint8_t>{};
}
void Reseal(std::vector<uint8_t>& b) {
  const uint64_t sum = XXH3_64bits(b.data(), 120);
  for (int i = 0; i < 8; ++i) b[120 + i] = static_cast<uint8_t>(sum >> (8 * i));
}
void ResealPayload(std::vector<uint8_t>& b) {
  const uint64_t sum = XXH3_64bits(b.data() + Chunk::kHeaderBytes, b.size() - Chunk::kHeaderBytes);
  for (int i = 0; i < 8; ++i) b[80 + i] = static_cast<uint8_t>(sum >> (8 * i));
  Reseal(b);
}

TEST(ChunkHeadKept, HoldsEachHeadsCountPositionsAndKvOnly) {
  const ChunkInfo info = HeadInfo();
  EXPECT_EQ(info.tokens, 2u);  // the most any head keeps
  EXPECT_EQ(info.head_slots, 5u);
  EXPECT_EQ(info.payload_bytes(), 5u * 2 * 2 * 4);
  const std::vector<uint8_t> b = BytesOf(info, HeadKv());
  ASSERT_EQ(b.size(), Chunk::kHeaderBytes + 4 * (4 + 5) + 80);
  EXPECT_EQ(Get32(&b[112]), 2u | 8u);  // flags: pruned, per head
  EXPECT_EQ(Get32(&b[108]), 2u);       // kept_kind: per head
  EXPECT_EQ(Get32(&b[104]), 8u);       // logical_tokens
  EXPECT_EQ(Get32(&b[60]), 2u);        // tokens
  EXPECT_EQ(Get32(&b[96]), 80u);       // raw_bytes: the KV's
  const std::vector<uint32_t> annex = {2, 1, 0, 2, 0, 3, 5, 1, 7};
  for (size_t i = 0; i < annex.size(); ++i) EXPECT_EQ(Get32(&b[128 + 4 * i]), annex[i]) << i;
  auto back = Chunk::Parse(b);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  const ChunkInfo& got = (*back)->info();
  EXPECT_TRUE(got.per_head());
  EXPECT_EQ(got.head_counts, info.head_counts);
  EXPECT_EQ(got.kept, info.kept);
  EXPECT_EQ(got.head_slots, 5u);
  const std::vector<uint8_t> kv = HeadKv();
  EXPECT_TRUE(
      std::equal((*back)->payload().begin(), (*back)->payload().end(), kv.begin(), kv.end()));
  // The header alone knows the sizes, not the counts.
  auto header = Chunk::ParseHeader(std::span(b).first(Chunk::kHeaderBytes));
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  EXPECT_EQ(header->info.head_slots, 5u);
  EXPECT_EQ(header->payload_bytes, b.size() - Chunk::kHeaderBytes);
  // It is not landed in place, encoded or sealed as raw KV.
  EXPECT_EQ(Chunk::SealedHeader(info, 0).status().code(), StatusCode::kInvalidArgument);
  auto chunk = *back;
  auto encoded = EncodeChunk(chunk, {KvCodec::kKvc, 8});
  ASSERT_TRUE(encoded.ok());
  EXPECT_FALSE((*encoded)->encoded());
}

TEST(ChunkHeadKept, EveryByteFlipAndEveryCutIsCorruption) {
  const std::vector<uint8_t> good = BytesOf(HeadInfo(), HeadKv());
  for (size_t i = 0; i < good.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80}) {
      std::vector<uint8_t> bad = good;
      bad[i] ^= mask;
      const Status st = Chunk::Parse(std::move(bad)).status();
      EXPECT_EQ(st.code(), StatusCode::kCorruption)
          << "byte " << i << " ^ " << int{mask} << ": " << st.ToString();
    }
  }
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_EQ(Chunk::Parse(std::vector<uint8_t>(good.begin(), good.begin() + n)).status().code(),
              StatusCode::kCorruption)
        << n;
  }
}

TEST(ChunkHeadKept, ParseRefusesCountsAndPositionsThatDisagreeUnderValidChecksums) {
  const std::vector<uint8_t> good = BytesOf(HeadInfo(), HeadKv());
  const auto edited = [&](size_t offset, uint8_t value, bool payload) {
    std::vector<uint8_t> b = good;
    b[offset] = value;
    payload ? ResealPayload(b) : Reseal(b);
    return Chunk::Parse(std::move(b)).status().code();
  };
  EXPECT_EQ(edited(108, 1, false), StatusCode::kCorruption);  // kept_kind of token pruning
  EXPECT_EQ(edited(112, 2 | 8 | 1, false), StatusCode::kUnimplemented);  // and encoded
  EXPECT_EQ(edited(96, 81, false), StatusCode::kCorruption);         // raw_bytes not whole pairs
  EXPECT_EQ(edited(96, 0, false), StatusCode::kCorruption);          // no KV
  EXPECT_EQ(edited(60, 3, false), StatusCode::kCorruption);          // tokens not the largest count
  EXPECT_EQ(edited(128, 1, true), StatusCode::kCorruption);          // counts no longer sum to 5
  EXPECT_EQ(edited(128 + 4 * 4, 3, true), StatusCode::kCorruption);  // head {3, 3}
  EXPECT_EQ(edited(128 + 4 * 8, 8, true), StatusCode::kCorruption);  // past the text
  EXPECT_EQ(edited(128 + 4 * 2, 1, true), StatusCode::kCorruption);  // sum 6, KV for 5
  // The reseal itself is right.
  EXPECT_EQ(edited(128 + 4 * 6, 6, true), StatusCode::kOk);  // head {6}: still in order
}

TEST(ChunkHeadKept, MakeRefusesCountsAndPositionsThatDoNotFit) {
  const std::vector<uint8_t> kv = HeadKv();
  const auto make = [&](std::vector<uint32_t> counts, std::vector<uint32_t> positions,
                        uint32_t logical = 8) {
    ChunkInfo info{kKey, kFingerprint, 2, 2, 2, 0, DType::kF32, 0};
    info.logical_tokens = logical;
    info.SetHeadKept(std::move(counts), std::move(positions));
    std::vector<uint8_t> payload(info.payload_bytes());
    return Chunk::Make(info, payload).status().code();
  };
  EXPECT_EQ(make({2, 1, 0, 2}, {0, 3, 5, 1, 7}), StatusCode::kOk);
  EXPECT_EQ(make({2, 1, 2}, {0, 3, 5, 1, 7}), StatusCode::kInvalidArgument);        // 3 heads
  EXPECT_EQ(make({2, 1, 0, 2}, {0, 3, 5, 1}), StatusCode::kInvalidArgument);        // 4 positions
  EXPECT_EQ(make({2, 1, 0, 2}, {3, 0, 5, 1, 7}), StatusCode::kInvalidArgument);     // descending
  EXPECT_EQ(make({2, 1, 0, 2}, {0, 3, 5, 1, 8}), StatusCode::kInvalidArgument);     // past the text
  EXPECT_EQ(make({2, 1, 0, 2}, {0, 3, 5, 1, 7}, 1), StatusCode::kInvalidArgument);  // text < slots
  ChunkInfo unpruned{kKey, kFingerprint, 2, 2, 2, 0, DType::kF32, 0};
  unpruned.SetHeadKept({1, 1, 1, 1}, {0, 0, 0, 0});
  EXPECT_EQ(Chunk::Make(unpruned, std::vector<uint8_t>(unpruned.payload_bytes())).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kdn::kvbus
