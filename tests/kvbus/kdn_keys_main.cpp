// Test-only: prints chunk keys for tests/parity/test_chunk_keys.py, which
// recomputes them from docs/kvbus.md with Python's xxhash.
//   kdn_keys prefix  FINGERPRINT_HEX NAMESPACE CHUNK_TOKENS IDS_CSV
//   kdn_keys segment FINGERPRINT_HEX NAMESPACE IDS_CSV
//   kdn_keys tail    FINGERPRINT_HEX NAMESPACE CHUNK_TOKENS IDS_CSV
// prefix prints one hex key per full chunk, one a line; segment prints one;
// tail prints one line per tail piece (TailSpans), "FIRST COUNT KEYHEX",
// nothing when the tokens end on a chunk boundary.
// IDS_CSV is comma-separated token ids in [0, 2^31 - 1] (may be empty), or
// "-" to read them from stdin. NAMESPACE is taken as raw bytes.
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "kdn/kvbus/key.h"

namespace {

std::optional<std::vector<int32_t>> ParseIds(std::string csv) {
  if (csv == "-") csv.assign(std::istreambuf_iterator<char>(std::cin), {});
  while (!csv.empty() && (csv.back() == '\n' || csv.back() == '\r')) csv.pop_back();
  std::vector<int32_t> ids;
  if (csv.empty()) return ids;
  size_t pos = 0;
  while (true) {
    const size_t comma = csv.find(',', pos);
    const std::string item =
        csv.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || errno != 0 || v < 0 || v > 0x7fffffff) return std::nullopt;
    ids.push_back(static_cast<int32_t>(v));
    if (comma == std::string::npos) return ids;
    pos = comma + 1;
  }
}

int Usage() {
  std::fprintf(stderr,
               "usage: kdn_keys prefix FINGERPRINT_HEX NAMESPACE CHUNK_TOKENS IDS_CSV\n"
               "       kdn_keys segment FINGERPRINT_HEX NAMESPACE IDS_CSV\n"
               "       kdn_keys tail FINGERPRINT_HEX NAMESPACE CHUNK_TOKENS IDS_CSV\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kdn::kvbus;
  if (argc < 2) return Usage();
  const std::string mode = argv[1];
  const bool tail = mode == "tail";
  const bool chunked = mode == "prefix" || tail;  // takes CHUNK_TOKENS
  if (!(chunked && argc == 6) && !(mode == "segment" && argc == 5)) return Usage();

  auto fp = ChunkKey::FromHex(argv[2]);
  if (!fp.ok()) {
    std::fprintf(stderr, "kdn_keys: %s\n", fp.status().ToString().c_str());
    return 2;
  }
  KeyContext ctx{*fp, argv[3], kDefaultChunkTokens};
  if (chunked) {
    char* end = nullptr;
    const long n = std::strtol(argv[4], &end, 10);
    if (*argv[4] == '\0' || *end != '\0' || n <= 0 || n > (1 << 24)) {
      std::fprintf(stderr, "kdn_keys: bad CHUNK_TOKENS \"%s\"\n", argv[4]);
      return 2;
    }
    ctx.chunk_tokens = static_cast<int>(n);
  }
  const auto ids = ParseIds(argv[chunked ? 5 : 4]);
  if (!ids) {
    std::fprintf(stderr, "kdn_keys: IDS_CSV must be comma-separated ids in [0, 2^31 - 1]\n");
    return 2;
  }
  if (tail) {
    const std::vector<ChunkKey> prefix_keys = PrefixKeys(ctx, *ids);
    for (const KeyedSpan& s : TailSpans(ctx, *ids, prefix_keys)) {
      std::printf("%lld %lld %s\n", static_cast<long long>(s.first),
                  static_cast<long long>(s.count), s.key.ToHex().c_str());
    }
  } else if (chunked) {
    for (const ChunkKey& k : PrefixKeys(ctx, *ids)) std::printf("%s\n", k.ToHex().c_str());
  } else {
    std::printf("%s\n", SegmentKey(ctx, *ids).ToHex().c_str());
  }
  return 0;
}
