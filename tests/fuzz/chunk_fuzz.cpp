// libFuzzer harness for the KV chunk parser (Chunk::Parse, kdn/kvbus/chunk.h):
// the bytes every tier and transport reads from disk or a peer.
//
// The first byte's low bits say which checksums the harness writes over the
// rest before parsing (bit 0: the payload's, bit 1: the header's), so that
// mutated headers get past the checksums to the field checks (as a forged
// chunk would); the rest is the chunk. Parse must not crash or hit undefined
// behaviour, refuse with CORRUPTION (or UNIMPLEMENTED, only for a header whose
// format version, codec, flags or version 4 dtype this build does not know),
// and a chunk it accepts must be what it says: the header, a pruned chunk's
// kept positions (one per token, ascending, inside its logical length), then
// a payload of the size its shape implies (raw) or its stream (encoded);
// built again from its info and payload it must give the same fields, kept
// positions and payload.
//
// Built with clang's -fsanitize=fuzzer,address,undefined (tests/fuzz); the
// test `chunk_fuzz` (label fuzz) runs it over tests/fuzz/corpus/chunk.
#include <xxhash.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_util.h"
#include "kdn/kvbus/chunk.h"

using namespace kdn::kvbus;
using kdn::DType;
using kdn::fuzz::Check;

namespace {

// Header offsets (docs/kvbus.md, "KV chunk object").
constexpr size_t kOffVersion = 8, kOffDType = 12, kOffPayloadBytes = 72, kOffPayloadSum = 80,
                 kOffCodec = 88, kOffLogical = 104, kOffFlags = 112, kOffHeaderSum = 120;

uint32_t Get32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void Put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// Whether `c` has the bytes of `bytes` up to header offset `fields` (the
// fields its kind of chunk has: a raw chunk's codec fields and the reserved
// bytes are zero when written and ignored when read), but for the version
// (a chunk of versions 1-3 is written again as version 4), and from the
// payload on.
bool SameChunk(const Chunk& c, const std::vector<uint8_t>& bytes, size_t fields) {
  const uint8_t* b = c.bytes().data();
  return c.size() == bytes.size() && std::memcmp(b, bytes.data(), kOffVersion) == 0 &&
         std::memcmp(b + kOffDType, bytes.data() + kOffDType, fields - kOffDType) == 0 &&
         std::memcmp(b + Chunk::kHeaderBytes, bytes.data() + Chunk::kHeaderBytes,
                     bytes.size() - Chunk::kHeaderBytes) == 0;
}

// Seeds: a raw chunk per dtype, a pruned one and an encoded one, as the tiers
// store them.
std::vector<std::string> Seeds() {
  std::vector<std::string> seeds;
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  for (int i = 0; i < 3; ++i) {
    ChunkInfo info{{0x1122, 0x3344}, {5, 6}, 2, 1, 4, 3, dtypes[i], 32};
    std::vector<uint8_t> payload(info.payload_bytes());
    for (size_t b = 0; b < payload.size(); ++b) payload[b] = static_cast<uint8_t>(b * 7 + i);
    auto c = Chunk::Make(info, payload);
    Check(c.ok(), "seed chunk");
    std::string s(1, '\0');
    s.append(reinterpret_cast<const char*>((*c)->bytes().data()), (*c)->size());
    seeds.push_back(s);
  }
  {
    ChunkInfo info{{0x5566, 0x7788}, {5, 6}, 2, 1, 4, 3, DType::kF16, 16};
    info.logical_tokens = 7;
    info.kept = {0, 3, 6};
    std::vector<uint8_t> payload(info.payload_bytes());
    for (size_t b = 0; b < payload.size(); ++b) payload[b] = static_cast<uint8_t>(b * 5);
    auto c = Chunk::Make(info, payload);
    Check(c.ok(), "seed pruned chunk");
    std::string s(1, '\0');
    s.append(reinterpret_cast<const char*>((*c)->bytes().data()), (*c)->size());
    seeds.push_back(s);
  }
  ChunkInfo info{{7, 8}, {5, 6}, 1, 1, 2, 2, DType::kF16, 0, KvCodec::kKvc, 8};
  std::vector<uint8_t> bytes(Chunk::kHeaderBytes, 0);
  for (int b = 0; b < 12; ++b) bytes.push_back(static_cast<uint8_t>(b));
  auto c = Chunk::FromEncoded(info, bytes);
  Check(c.ok(), "seed encoded chunk");
  std::string s(1, '\0');
  s.append(reinterpret_cast<const char*>((*c)->bytes().data()), (*c)->size());
  seeds.push_back(s);
  return seeds;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kdn::fuzz::WriteSeedsIfAsked(Seeds());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  std::vector<uint8_t> bytes(data + 1, data + size);
  if (bytes.size() >= Chunk::kHeaderBytes) {
    uint8_t* h = bytes.data();
    if (data[0] & 1) {
      const size_t payload = bytes.size() - Chunk::kHeaderBytes;
      Put64(h + kOffPayloadBytes, payload);
      Put64(h + kOffPayloadSum, XXH3_64bits(h + Chunk::kHeaderBytes, payload));
    }
    if (data[0] & 2) Put64(h + kOffHeaderSum, XXH3_64bits(h, kOffHeaderSum));
  }
  const std::vector<uint8_t> copy = bytes;
  auto chunk = Chunk::Parse(std::move(bytes));
  if (!chunk.ok()) {
    if (chunk.status().code() == kdn::StatusCode::kUnimplemented) {
      Check(copy.size() >= Chunk::kHeaderBytes, "UNIMPLEMENTED only for a whole header");
      const uint32_t version = Get32(copy.data() + kOffVersion);
      const uint32_t codec = Get32(copy.data() + kOffCodec);
      const uint32_t flags = Get32(copy.data() + kOffFlags);
      const bool v4_unknown =
          version == 4 && ((flags & ~3u) != 0 || flags == 3 ||
                           !kdn::DTypeFromValue(Get32(copy.data() + kOffDType)));
      Check(version < 1 || version > 4 || v4_unknown ||
                (codec != 0 && codec != static_cast<uint32_t>(KvCodec::kKvc)),
            "UNIMPLEMENTED is only for an unknown format version, codec, flags or dtype");
      return 0;
    }
    Check(chunk.status().code() == kdn::StatusCode::kCorruption, "a refusal is CORRUPTION");
    return 0;
  }
  const Chunk& c = **chunk;
  Check(c.size() == copy.size(), "the chunk is the bytes given");
  const ChunkInfo& info = c.info();
  Check(c.payload().size() == c.size() - Chunk::kHeaderBytes - info.annex_bytes(),
        "header, kept positions, then payload");
  if (info.pruned()) {
    Check(!c.encoded(), "a pruned chunk is raw");
    Check(info.kept.size() == info.tokens && info.logical_tokens >= info.tokens,
          "a kept position per token, within the text");
    for (size_t j = 0; j < info.kept.size(); ++j) {
      Check(info.kept[j] < info.logical_tokens && (j == 0 || info.kept[j] > info.kept[j - 1]),
            "kept positions ascend inside the text");
    }
  } else {
    Check(info.kept.empty(), "no kept positions unpruned");
  }
  if (!c.encoded()) {
    Check(c.payload().size() == info.payload_bytes(), "a raw payload of its shape's size");
    auto again = Chunk::Make(info, std::vector<uint8_t>(c.payload().begin(), c.payload().end()));
    Check(again.ok(), "a parsed raw chunk builds again");
    Check(SameChunk(**again, copy, kOffCodec), "and gives the same chunk");
  } else {
    std::vector<uint8_t> room(Chunk::kHeaderBytes);
    room.insert(room.end(), c.payload().begin(), c.payload().end());
    auto again = Chunk::FromEncoded(info, std::move(room));
    Check(again.ok(), "a parsed encoded chunk builds again");
    Check(SameChunk(**again, copy, kOffLogical), "and gives the same chunk");
  }
  return 0;
}
