// libFuzzer harness for the KV codec's decoder (kdn/kvbus/codec.h).
//
// The first byte picks what the rest is:
// - even: an encoded chunk's stream, under a shape and level read from the
//   next bytes, sealed with good checksums so that only the decoder stands
//   between it and a reader. Decoding must refuse it (CORRUPTION) or give a
//   raw chunk of exactly the shape's size.
// - odd: a raw payload (shape from the next bytes, the rest repeated to fill
//   it), encoded at the level named, then decoded: that must succeed, and at
//   "lossless" give back every byte.
//
// Built with clang's -fsanitize=fuzzer,address,undefined (tests/fuzz); the
// test `kvc_fuzz` (label fuzz) runs it over tests/fuzz/corpus/kvc.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kdn/kvbus/codec.h"

using namespace kdn::kvbus;
using kdn::DType;

namespace {

struct Shape {
  ChunkInfo info;
  CodecLevel level;
};

// Shape and level from 6 bytes: layers 1..4, kv_heads 1..2, head_dim 1..16,
// tokens 1..64, dtype, level (lossless, q2 ... q8).
bool ReadShape(const uint8_t*& p, size_t& n, Shape* s) {
  if (n < 6) return false;
  s->info.key = ChunkKey{1, 2};
  s->info.model_fingerprint = ChunkKey{3, 4};
  s->info.layers = 1 + p[0] % 4;
  s->info.kv_heads = 1 + p[1] % 2;
  s->info.head_dim = 1 + p[2] % 16;
  s->info.tokens = 1 + p[3] % 64;
  s->info.dtype = static_cast<DType>(p[4] % 3);
  const uint32_t l = p[5] % 8;  // 0 lossless, 1..7: q2..q8
  s->level = {KvCodec::kKvc, l == 0 ? 0u : l + 1};
  p += 6;
  n -= 6;
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool round_trip = data[0] & 1;
  const uint8_t* p = data + 1;
  size_t n = size - 1;
  Shape s;
  if (!ReadShape(p, n, &s)) return 0;
  if (!round_trip) {
    ChunkInfo info = s.info;
    info.codec = s.level.codec;
    info.codec_level = s.level.level;
    std::vector<uint8_t> bytes(Chunk::kHeaderBytes);
    bytes.insert(bytes.end(), p, p + n);
    auto chunk = Chunk::FromEncoded(info, std::move(bytes));
    if (!chunk.ok()) abort();
    auto raw = DecodeChunk(*chunk);
    if (raw.ok() && (*raw)->payload().size() != info.payload_bytes()) abort();
    if (!raw.ok() && raw.status().code() != kdn::StatusCode::kCorruption) abort();
    return 0;
  }
  if (n == 0) return 0;
  std::vector<uint8_t> payload(s.info.payload_bytes());
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = p[i % n];
  auto raw = Chunk::Make(s.info, payload);
  if (!raw.ok()) abort();
  auto enc = EncodeChunk(*raw, s.level);
  if (!enc.ok()) abort();
  auto dec = DecodeChunk(*enc);
  if (!dec.ok()) abort();
  if ((*dec)->payload().size() != payload.size()) abort();
  if (s.level.level == 0 &&
      std::memcmp((*dec)->payload().data(), payload.data(), payload.size()) != 0) {
    abort();
  }
  return 0;
}
