// A worker's KDN view (worker::MakeWorkerStore) over a kdn-store with the
// KV codec: what one worker puts coded, another reads back decoded.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kdn/worker/worker_setup.h"
#include "kdn/kvbus/codec.h"
#include "kdn/kvbus/host_tier.h"
#include "kdn/kvbus/prefix_io.h"
#include "kdn/kvbus/store_service.h"

namespace kdn::worker {
namespace {

std::shared_ptr<const kvbus::Chunk> MakeChunk() {
  const kvbus::ChunkInfo info{{5, 6}, {7, 8}, 4, 2, 16, 64, kdn::DType::kF32, 0};
  return kvbus::Chunk::Build(info,
                             [&](uint8_t* out) {
                               for (size_t i = 0; i < info.payload_bytes() / 4; ++i) {
                                 const float v = std::sin(0.37f * static_cast<float>(i % 977));
                                 std::memcpy(out + 4 * i, &v, 4);
                               }
                             })
      .value();
}

TEST(WorkerStore, ChunksGoToTheStoreCodedAndComeBackDecoded) {
  kvbus::HostTier shared(64 << 20);  // the kdn-store's memory
  auto server = kvbus::StoreServer::Start(shared, "tcp://127.0.0.1:0").value();
  auto writer = MakeWorkerStore(1 << 20, server->endpoint(), *kvbus::ParseCodecLevel("q8")).value();
  auto reader = MakeWorkerStore(1 << 20, server->endpoint(), {}).value();
  const auto raw = MakeChunk();
  ASSERT_TRUE(writer->Put(raw).ok());  // written through to the store

  auto held = shared.Get(raw->key());
  ASSERT_TRUE(held.ok());
  EXPECT_TRUE((*held)->encoded());
  EXPECT_LT((*held)->size(), raw->size() / 3);

  // Another worker, whose own tier lacks it, reads it from the store.
  auto got = reader->Get(raw->key());
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_FALSE((*got)->encoded());
  ASSERT_EQ((*got)->size(), raw->size());
  const kvbus::ChunkKey fp = raw->info().model_fingerprint;
  EXPECT_TRUE(kvbus::ChunkFits(**got, fp, 64, kdn::DType::kF32));
  EXPECT_FALSE(kvbus::ChunkFits(**held, fp, 64, kdn::DType::kF32));  // coded: not usable as is
  // Another engine's element type (a GPU's bf16) is recomputed, not converted.
  EXPECT_FALSE(kvbus::ChunkFits(**got, fp, 64, kdn::DType::kBF16));
  EXPECT_FALSE(kvbus::ChunkFits(**got, fp, 63, kdn::DType::kF32));
  for (size_t i = 0; i < raw->payload().size() / 4; ++i) {
    float a, b;
    std::memcpy(&a, raw->payload().data() + 4 * i, 4);
    std::memcpy(&b, (*got)->payload().data() + 4 * i, 4);
    ASSERT_NEAR(a, b, 2.0 / 255) << i;  // values in [-1, 1] at 8 bits
  }
  server->Stop();
}

TEST(WorkerStore, AStreamThatDoesNotDecodeIsAMissNotAnError) {
  kvbus::HostTier shared(64 << 20);
  auto server = kvbus::StoreServer::Start(shared, "tcp://127.0.0.1:0").value();
  const auto raw = MakeChunk();
  const auto enc = kvbus::EncodeChunk(raw, *kvbus::ParseCodecLevel("q4")).value();
  // Checksums good, stream cut in half: only the decoder can tell.
  std::vector<uint8_t> bytes(kvbus::Chunk::kHeaderBytes);
  bytes.insert(bytes.end(), enc->payload().begin(),
               enc->payload().begin() + enc->payload().size() / 2);
  ASSERT_TRUE(shared.Put(kvbus::Chunk::FromEncoded(enc->info(), std::move(bytes)).value()).ok());
  auto reader = MakeWorkerStore(1 << 20, server->endpoint(), {}).value();
  auto got = reader->Get(raw->key());
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kNotFound) << got.status().ToString();
  EXPECT_EQ(reader->Stats().corrupt, 1u);
  server->Stop();
}

}  // namespace
}  // namespace kdn::worker
