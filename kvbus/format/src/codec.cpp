// kvc, kdn's KV codec (kdn/kvbus/codec.h; the stream's layout is in
// docs/kvbus.md, "KV codec").
#include "kdn/kvbus/codec.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "kdn/common/half.h"
#include "rans.h"

namespace kdn::kvbus {

namespace {

using namespace rans;

constexpr uint32_t kGroup = 16;  // every kGroup-th token of a kDelta plane is an anchor

enum PlaneMode : uint8_t { kBytes = 0, kDirect = 1, kDelta = 2, kPacked = 3 };
// A quantized plane is entropy coded only where that saves at least this
// share of the bits over packing the values at their width: rANS decodes
// far slower than unpacking, so a small saving does not pay for it.
constexpr double kEntropyMinSaving = 0.10;

// ---- elements -------------------------------------------------------------------

float LoadF(DType dtype, const uint8_t* p) {
  uint32_t u = 0;
  switch (dtype) {
    case DType::kF32: std::memcpy(&u, p, 4); return std::bit_cast<float>(u);
    case DType::kBF16: return Bf16ToF32(static_cast<uint16_t>(p[0] | p[1] << 8));
    case DType::kF16: return F16ToF32(static_cast<uint16_t>(p[0] | p[1] << 8));
  }
  return 0;
}

// `n` floats to `out` in `dtype` (little-endian).
void StoreRow(DType dtype, const float* row, size_t n, uint8_t* out) {
  if (dtype == DType::kF32) {
    std::memcpy(out, row, n * 4);
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const uint16_t h = dtype == DType::kBF16 ? F32ToBf16(row[i]) : F32ToF16(row[i]);
    out[2 * i] = static_cast<uint8_t>(h);
    out[2 * i + 1] = static_cast<uint8_t>(h >> 8);
  }
}

uint32_t ZigZag(int32_t d) {
  return (static_cast<uint32_t>(d) << 1) ^ static_cast<uint32_t>(d >> 31);
}
int32_t UnZigZag(uint32_t z) { return static_cast<int32_t>(z >> 1) ^ -static_cast<int32_t>(z & 1); }

// A residual z (a zigzagged difference, under 2^9) as a bucket symbol and
// raw bits: z < 8 is its own symbol; above, the symbol names the power of
// two z falls in and the two bits after its leading one, and the bits
// below those follow raw. 32 symbols cover every z below 2^9, so a table
// costs a few dozen bytes however many bits the level has.
constexpr uint32_t kBuckets = 32;
struct Bucket {
  uint16_t sym;
  int extra_bits;
  uint16_t extra;
};
Bucket ToBucket(uint32_t z) {
  if (z < 8) return {static_cast<uint16_t>(z), 0, 0};
  const int e = std::bit_width(z) - 1;  // 3..8
  const uint32_t m = (z >> (e - 2)) & 3;
  return {static_cast<uint16_t>(8 + (e - 3) * 4 + m), e - 2,
          static_cast<uint16_t>(z & ((1u << (e - 2)) - 1))};
}
// Each bucket's lowest z and how many raw bits follow it.
struct BucketBase {
  uint32_t base[kBuckets];
  int extra_bits[kBuckets];
  BucketBase() {
    for (uint32_t sym = 0; sym < kBuckets; ++sym) {
      const int e = sym < 8 ? 0 : 3 + static_cast<int>(sym - 8) / 4;
      base[sym] = sym < 8 ? sym : (4u | ((sym - 8) & 3)) << (e - 2);
      extra_bits[sym] = sym < 8 ? 0 : e - 2;
    }
  }
};
const BucketBase kBucketBase;

// Estimated bits to code `counts` with a table fitted to them, the table
// included (about 12 bits a symbol).
double CostBits(const std::vector<uint64_t>& counts) {
  const double total =
      static_cast<double>(std::accumulate(counts.begin(), counts.end(), uint64_t{0}));
  double bits = 0;
  for (uint64_t n : counts) {
    if (n > 0) bits += static_cast<double>(n) * std::log2(total / static_cast<double>(n)) + 12;
  }
  return bits;
}

// One (layer, K|V) plane: `tokens` rows of `channels` elements at `data`.
struct Plane {
  const uint8_t* data;
  uint32_t tokens, channels;
  DType dtype;
};

// ---- lossless planes ---------------------------------------------------------------
//
// Each element's bytes are split into byte planes. A byte plane whose
// histogram promises a saving is coded with a table of its own (element i
// with state i & 1); one that would not (the low bytes of a mantissa are
// noise) is stored verbatim after the stream, and costs nothing to decode.

void EncodeBytesPlane(const Plane& p, std::vector<uint8_t>& out) {
  const int esize = DTypeSize(p.dtype);
  const size_t n = size_t{p.tokens} * p.channels;
  std::vector<std::vector<uint64_t>> counts(esize, std::vector<uint64_t>(256, 0));
  for (size_t i = 0; i < n; ++i) {
    for (int b = 0; b < esize; ++b) ++counts[b][p.data[i * esize + b]];
  }
  std::vector<EncTable> tables(esize);
  std::vector<const EncTable*> ptrs;
  std::vector<bool> verbatim(esize);
  out.push_back(kBytes);
  for (int b = 0; b < esize; ++b) {
    verbatim[b] = CostBits(counts[b]) >= 8.0 * static_cast<double>(n);
    if (!verbatim[b]) tables[b] = Normalize(counts[b]);
    WriteTable(out, tables[b], verbatim[b]);
    ptrs.push_back(&tables[b]);
  }
  RansEncoder enc;
  for (size_t i = 0; i < n; ++i) {
    for (int b = 0; b < esize; ++b) {
      if (!verbatim[b])
        enc.Add(static_cast<int>(i & 1), static_cast<uint8_t>(b), p.data[i * esize + b]);
    }
  }
  PutStream(out, enc.Finish(ptrs));
  for (int b = 0; b < esize; ++b) {
    if (!verbatim[b]) continue;
    for (size_t i = 0; i < n; ++i) out.push_back(p.data[i * esize + b]);
  }
}

Status DecodeBytesPlane(Reader& in, const Plane& p, uint8_t* out) {
  const int esize = DTypeSize(p.dtype);
  const size_t n = size_t{p.tokens} * p.channels;
  std::vector<DecTable> tables(esize);
  std::vector<int> coded;  // byte planes in the stream
  for (int b = 0; b < esize; ++b) {
    KDN_ASSIGN_OR_RETURN(tables[b], ReadTable(in, 256, /*verbatim_ok=*/true));
    if (!tables[b].empty()) coded.push_back(b);
  }
  KDN_ASSIGN_OR_RETURN(RansStream s, OpenStream(in));
  uint32_t x0 = s.State(), x1 = s.State();
  for (size_t i = 0; i < n && !coded.empty(); i += 2) {
    for (int b : coded) out[i * esize + b] = static_cast<uint8_t>(s.Get(x0, tables[b].data()));
    if (i + 1 == n) break;
    for (int b : coded)
      out[(i + 1) * esize + b] = static_cast<uint8_t>(s.Get(x1, tables[b].data()));
  }
  if (!s.Done(x0, x1)) return Corruption("kvc: a byte plane's stream does not decode");
  for (int b = 0; b < esize; ++b) {
    if (!tables[b].empty()) continue;
    if (in.left() < n) return Corruption("kvc: a verbatim byte plane is cut short");
    const uint8_t* v = in.pos();
    for (size_t i = 0; i < n; ++i) out[i * esize + b] = v[i];
    in.Skip(n);
  }
  return Status::Ok();
}

// ---- quantized planes --------------------------------------------------------------
//
// q = round((x - lo) / step) per channel. Anchors (every 16th token, or
// every token in a kDirect plane) are coded as q - pred, pred being the
// channel's mean q; in a kDelta plane the other tokens as q minus the
// previous token's q. Each residual is a bucket symbol and raw bits, channel
// c with state c & 1. A plane whose rANS coding would not save
// kEntropyMinSaving is packed instead (kPacked).

// False (and nothing written) when the plane holds a NaN or an infinity, or
// a channel whose range overflows a float.
bool EncodeQuantizedPlane(const Plane& p, int bits, std::vector<uint8_t>& out) {
  const int esize = DTypeSize(p.dtype);
  const uint32_t T = p.tokens, C = p.channels;
  const uint32_t levels = (1u << bits) - 1;
  // Loops run over rows, then channels, so that they vectorize.
  std::vector<float> x(size_t{T} * C);
  if (p.dtype == DType::kF32) {
    std::memcpy(x.data(), p.data, x.size() * 4);
  } else {
    for (size_t i = 0; i < x.size(); ++i) x[i] = LoadF(p.dtype, p.data + i * esize);
  }
  std::vector<float> lo(x.begin(), x.begin() + C), hi(lo);
  bool finite = true;
  for (uint32_t t = 0; t < T; ++t) {
    const float* row = &x[size_t{t} * C];
    for (uint32_t c = 0; c < C; ++c) {
      finite &= std::isfinite(row[c]);
      lo[c] = std::min(lo[c], row[c]);
      hi[c] = std::max(hi[c], row[c]);
    }
  }
  if (!finite) return false;
  std::vector<float> step(C), inv(C);
  for (uint32_t c = 0; c < C; ++c) {
    // A range past the largest float cannot be quantized: the plane is kept
    // losslessly, as one holding a NaN is.
    if (!std::isfinite(hi[c] - lo[c])) return false;
    step[c] = (hi[c] - lo[c]) / static_cast<float>(levels);
    // A constant channel has step 0 (every q is 0); a subnormal step has no
    // finite inverse, so its channel divides instead (inv -1).
    inv[c] = step[c] > 0 ? 1.0f / step[c] : 0.0f;
    if (!std::isfinite(inv[c])) inv[c] = -1;
  }
  std::vector<uint16_t> q(x.size());
  std::vector<uint32_t> sum(C, 0);
  const float top = static_cast<float>(levels);
  for (uint32_t t = 0; t < T; ++t) {
    const float* row = &x[size_t{t} * C];
    uint16_t* qrow = &q[size_t{t} * C];
    for (uint32_t c = 0; c < C; ++c) {
      // (x - lo) / step >= 0: adding a half and truncating rounds it.
      const float scaled = inv[c] >= 0 ? (row[c] - lo[c]) * inv[c] : (row[c] - lo[c]) / step[c];
      const float v = std::min(scaled + 0.5f, top);
      qrow[c] = static_cast<uint16_t>(v);
      sum[c] += qrow[c];
    }
  }
  std::vector<uint8_t> pred(C);
  for (uint32_t c = 0; c < C; ++c) pred[c] = static_cast<uint8_t>((sum[c] + T / 2) / T);
  // The residual of each element in either mode; keep the cheaper mode.
  auto residual = [&](bool delta, uint32_t t, uint32_t c) {
    const int32_t base = delta && t % kGroup != 0 ? q[size_t{t - 1} * C + c] : pred[c];
    return ZigZag(static_cast<int32_t>(q[size_t{t} * C + c]) - base);
  };
  std::vector<uint64_t> direct(kBuckets, 0), anchors(kBuckets, 0), deltas(kBuckets, 0);
  uint64_t extra_direct = 0, extra_delta = 0;
  for (uint32_t t = 0; t < T; ++t) {
    const uint16_t* qrow = &q[size_t{t} * C];
    const uint16_t* prev = t % kGroup != 0 ? qrow - C : nullptr;
    std::vector<uint64_t>& second = prev ? deltas : anchors;
    for (uint32_t c = 0; c < C; ++c) {
      const Bucket d = ToBucket(ZigZag(static_cast<int32_t>(qrow[c]) - pred[c]));
      const Bucket r = prev ? ToBucket(ZigZag(static_cast<int32_t>(qrow[c]) - prev[c])) : d;
      ++direct[d.sym];
      ++second[r.sym];
      extra_direct += d.extra_bits;
      extra_delta += r.extra_bits;
    }
  }
  const double direct_bits = CostBits(direct) + static_cast<double>(extra_direct);
  const double delta_bits = CostBits(anchors) + CostBits(deltas) + static_cast<double>(extra_delta);
  const bool delta = delta_bits < direct_bits;
  const double packed_bits = static_cast<double>(x.size()) * bits;
  if (std::min(direct_bits, delta_bits) > (1 - kEntropyMinSaving) * packed_bits) {
    out.push_back(kPacked);
    out.push_back(static_cast<uint8_t>(bits));
    for (uint32_t c = 0; c < C; ++c) {
      PutF32(out, lo[c]);
      PutF32(out, step[c]);
    }
    // LSB first: value i holds bits [i * bits, (i + 1) * bits).
    uint64_t acc = 0;
    int have = 0;
    for (uint16_t v : q) {
      acc |= static_cast<uint64_t>(v) << have;
      have += bits;
      while (have >= 8) {
        out.push_back(static_cast<uint8_t>(acc));
        acc >>= 8;
        have -= 8;
      }
    }
    if (have > 0) out.push_back(static_cast<uint8_t>(acc));
    return true;
  }
  out.push_back(delta ? kDelta : kDirect);
  out.push_back(static_cast<uint8_t>(bits));
  for (uint32_t c = 0; c < C; ++c) {
    PutF32(out, lo[c]);
    PutF32(out, step[c]);
    out.push_back(pred[c]);
  }
  const EncTable ta = Normalize(delta ? anchors : direct);
  const EncTable td = delta ? Normalize(deltas) : EncTable{};
  WriteTable(out, ta);
  if (delta) WriteTable(out, td);
  RansEncoder enc;
  for (uint32_t t = 0; t < T; ++t) {
    const uint8_t table = delta && t % kGroup != 0 ? 1 : 0;
    for (uint32_t c = 0; c < C; ++c) {
      const Bucket b = ToBucket(residual(delta, t, c));
      enc.Add(static_cast<int>(c & 1), table, b.sym);
      enc.AddBits(static_cast<int>(c & 1), b.extra_bits, b.extra);
    }
  }
  PutStream(out, enc.Finish({&ta, &td}));
  return true;
}

// What an encoder writes: finite offsets and finite, non-negative steps.
bool ScalesValid(const std::vector<float>& lo, const std::vector<float>& step) {
  for (size_t c = 0; c < lo.size(); ++c) {
    if (!std::isfinite(lo[c]) || !std::isfinite(step[c]) || step[c] < 0) return false;
  }
  return true;
}

Status DecodePackedPlane(Reader& in, const Plane& p, uint8_t* out) {
  const int esize = DTypeSize(p.dtype);
  const uint32_t T = p.tokens, C = p.channels;
  const int bits = in.U8();
  if (!in.ok() || bits < 1 || bits > 8)
    return Corruption("kvc: a plane of " + std::to_string(bits) + " bits");
  std::vector<float> lo(C), step(C);
  for (uint32_t c = 0; c < C; ++c) {
    lo[c] = in.F32();
    step[c] = in.F32();
  }
  const size_t bytes = (size_t{T} * C * bits + 7) / 8;
  if (!in.ok() || in.left() < bytes) return Corruption("kvc: a packed plane is cut short");
  if (!ScalesValid(lo, step)) return Corruption("kvc: a plane's scales are not finite");
  const uint8_t* src = in.pos();
  const uint8_t* src_end = src + bytes;
  in.Skip(bytes);
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  std::vector<float> row(C);
  uint64_t acc = 0;
  int have = 0;
  for (uint32_t t = 0; t < T; ++t) {
    for (uint32_t c = 0; c < C; ++c) {
      if (have < bits) {  // refill whole bytes, up to 56 bits held
        while (have <= 48 && src < src_end) {
          acc |= static_cast<uint64_t>(*src++) << have;
          have += 8;
        }
      }
      row[c] = lo[c] + static_cast<float>(acc & mask) * step[c];
      acc >>= bits;
      have -= bits;
    }
    StoreRow(p.dtype, row.data(), C, out + size_t{t} * C * esize);
  }
  return Status::Ok();
}

Status DecodeQuantizedPlane(Reader& in, const Plane& p, bool delta, uint8_t* out) {
  const int esize = DTypeSize(p.dtype);
  const uint32_t T = p.tokens, C = p.channels;
  const int bits = in.U8();
  if (!in.ok() || bits < 1 || bits > 8)
    return Corruption("kvc: a plane of " + std::to_string(bits) + " bits");
  const int32_t levels = (1 << bits) - 1;
  std::vector<float> lo(C), step(C);
  std::vector<int32_t> pred(C);
  for (uint32_t c = 0; c < C; ++c) {
    lo[c] = in.F32();
    step[c] = in.F32();
    pred[c] = in.U8();
  }
  if (!in.ok()) return Corruption("kvc: a plane's scales are cut short");
  if (!ScalesValid(lo, step)) return Corruption("kvc: a plane's scales are not finite");
  KDN_ASSIGN_OR_RETURN(DecTable ta, ReadTable(in, kBuckets));
  DecTable td;
  if (delta) {
    KDN_ASSIGN_OR_RETURN(td, ReadTable(in, kBuckets));
  }
  KDN_ASSIGN_OR_RETURN(RansStream s, OpenStream(in));
  uint32_t x0 = s.State(), x1 = s.State();
  std::vector<int32_t> prev(C, 0);  // the previous token's q
  std::vector<float> row(C);
  // Out-of-range values are OR-ed into `bad` (a negative q sets the sign
  // bit, one past `levels` a bit above it) and checked once at the end.
  uint32_t bad = 0;
  auto value = [&](uint32_t& st, const DecSlot* table) {
    const uint32_t sym = s.Get(st, table);
    return UnZigZag(kBucketBase.base[sym] + s.GetBits(st, kBucketBase.extra_bits[sym]));
  };
  for (uint32_t t = 0; t < T; ++t) {
    const bool is_anchor = !delta || t % kGroup == 0;
    const DecSlot* table = is_anchor ? ta.data() : td.data();
    const int32_t* base = is_anchor ? pred.data() : prev.data();
    uint32_t c = 0;
    for (; c + 1 < C; c += 2) {
      const int32_t q0 = base[c] + value(x0, table);
      const int32_t q1 = base[c + 1] + value(x1, table);
      bad |= static_cast<uint32_t>(q0) | static_cast<uint32_t>(levels - q0) |
             static_cast<uint32_t>(q1) | static_cast<uint32_t>(levels - q1);
      row[c] = lo[c] + static_cast<float>(q0) * step[c];
      row[c + 1] = lo[c + 1] + static_cast<float>(q1) * step[c + 1];
      prev[c] = q0;
      prev[c + 1] = q1;
    }
    if (c < C) {
      const int32_t q0 = base[c] + value(x0, table);
      bad |= static_cast<uint32_t>(q0) | static_cast<uint32_t>(levels - q0);
      row[c] = lo[c] + static_cast<float>(q0) * step[c];
      prev[c] = q0;
    }
    StoreRow(p.dtype, row.data(), C, out + size_t{t} * C * esize);
  }
  if (!s.Done(x0, x1) || (bad & 0x80000000u)) {
    return Corruption("kvc: a quantized plane's stream does not decode");
  }
  return Status::Ok();
}

}  // namespace

Result<CodecLevel> ParseCodecLevel(std::string_view name) {
  if (name == "raw") return CodecLevel{};
  if (name == "lossless") return CodecLevel{KvCodec::kKvc, 0};
  if (name.size() == 2 && name[0] == 'q' && name[1] >= '2' && name[1] <= '8') {
    return CodecLevel{KvCodec::kKvc, static_cast<uint32_t>(name[1] - '0')};
  }
  return InvalidArgument("KV codec level \"" + std::string(name) +
                         "\": expected raw, lossless, or q2 ... q8");
}

std::string CodecLevelName(CodecLevel level) {
  if (level.raw()) return "raw";
  if (level.level == 0) return "lossless";
  std::string name = "q";  // (not "q" + to_string: GCC 12's -Wrestrict false positive)
  name += std::to_string(level.level);
  return name;
}

bool ValidCodecLevel(CodecLevel level) {
  return level.raw() || (level.codec == KvCodec::kKvc &&
                         (level.level == 0 || (level.level >= 2 && level.level <= 8)));
}

int LayerBits(uint32_t level, uint32_t layer, uint32_t layers) {
  if (level == 0) return 0;
  const uint32_t extra = 3 * layer < layers ? 2 : 3 * layer < 2 * layers ? 1 : 0;
  return static_cast<int>(std::min<uint32_t>(8, level + extra));
}

Result<std::shared_ptr<const Chunk>> EncodeChunk(std::shared_ptr<const Chunk> chunk,
                                                 CodecLevel level) {
  // Pruned and steering chunks stay raw (the codec's format has no kept
  // positions and no description).
  if (level.raw() || chunk->encoded() || chunk->info().pruned() || chunk->info().is_steering()) {
    return chunk;
  }
  if (!ValidCodecLevel(level)) {
    return InvalidArgument("unknown KV codec level " + std::to_string(level.level));
  }
  const ChunkInfo& info = chunk->info();
  const uint32_t C = info.kv_heads * info.head_dim;
  const size_t plane_bytes = size_t{info.tokens} * C * DTypeSize(info.dtype);
  std::vector<uint8_t> out(Chunk::kHeaderBytes);
  out.reserve(Chunk::kHeaderBytes + chunk->payload().size() / 2);
  for (uint32_t l = 0; l < info.layers; ++l) {
    const int bits = LayerBits(level.level, l, info.layers);
    for (uint32_t kv = 0; kv < 2; ++kv) {
      const Plane p{chunk->payload().data() + (size_t{l} * 2 + kv) * plane_bytes, info.tokens, C,
                    info.dtype};
      if (bits == 0 || !EncodeQuantizedPlane(p, bits, out)) EncodeBytesPlane(p, out);
    }
  }
  ChunkInfo encoded = info;
  encoded.codec = level.codec;
  encoded.codec_level = level.level;
  return Chunk::FromEncoded(encoded, std::move(out));
}

Result<std::shared_ptr<const Chunk>> DecodeChunk(std::shared_ptr<const Chunk> chunk) {
  if (!chunk->encoded()) return chunk;
  const ChunkInfo& info = chunk->info();
  const std::string what = "chunk " + info.key.ToHex();
  if (!ValidCodecLevel({info.codec, info.codec_level})) {
    return Corruption(what + ": unknown KV codec level " + std::to_string(info.codec_level));
  }
  // A stream can code a constant plane of any length in a few bytes, so the
  // header's shape alone would let a damaged or forged chunk ask for any
  // amount of memory.
  if (info.payload_bytes() > kMaxDecodedBytes) {
    return Corruption(what + ": decodes to " + std::to_string(info.payload_bytes()) +
                      " bytes, over the " + std::to_string(kMaxDecodedBytes >> 20) +
                      " MiB a chunk may hold");
  }
  ChunkInfo raw = info;
  raw.codec = KvCodec::kRaw;
  raw.codec_level = 0;
  const uint32_t C = info.kv_heads * info.head_dim;
  const size_t plane_bytes = size_t{info.tokens} * C * DTypeSize(info.dtype);
  Status status = Status::Ok();
  auto made = Chunk::Build(raw, [&](uint8_t* out) {
    Reader in(chunk->payload().data(), chunk->payload().data() + chunk->payload().size());
    for (size_t i = 0; i < size_t{info.layers} * 2 && status.ok(); ++i) {
      const Plane p{nullptr, info.tokens, C, info.dtype};
      const uint8_t mode = in.U8();
      if (!in.ok()) {
        status = Corruption("kvc: the stream ends before plane " + std::to_string(i));
      } else if (mode == kBytes) {
        status = DecodeBytesPlane(in, p, out + i * plane_bytes);
      } else if (mode == kDirect || mode == kDelta) {
        status = DecodeQuantizedPlane(in, p, mode == kDelta, out + i * plane_bytes);
      } else if (mode == kPacked) {
        status = DecodePackedPlane(in, p, out + i * plane_bytes);
      } else {
        status = Corruption("kvc: plane " + std::to_string(i) + " has unknown mode " +
                            std::to_string(mode));
      }
    }
    if (status.ok() && in.left() != 0) {
      status = Corruption("kvc: " + std::to_string(in.left()) + " bytes after the last plane");
    }
  });
  if (!made.ok()) return made.status();
  if (!status.ok()) return Corruption(what + ": " + status.message());
  return made;
}

// ---- CodecTier ------------------------------------------------------------------

namespace {
uint64_t NanosSince(std::chrono::steady_clock::time_point t0) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count());
}
}  // namespace

CodecTier::CodecTier(std::unique_ptr<ChunkStore> inner, CodecTierOptions options)
    : inner_(std::move(inner)), options_(options) {}

Result<std::shared_ptr<const Chunk>> CodecTier::Get(const ChunkKey& key) {
  auto got = inner_->Get(key);
  if (!got.ok() || !(*got)->encoded() || !options_.decode_on_get) return got;
  const auto t0 = std::chrono::steady_clock::now();
  auto raw = DecodeChunk(*std::move(got));
  decode_ns_ += NanosSince(t0);
  if (!raw.ok()) {
    ++decode_errors_;
    return NotFound(key.ToHex() + " in " + inner_->name() + " does not decode (" +
                    raw.status().message() + ")");
  }
  ++decoded_;
  return raw;
}

Status CodecTier::Put(std::shared_ptr<const Chunk> chunk) {
  if (chunk == nullptr) return InvalidArgument("codec tier: Put of a null chunk");
  if (options_.level.raw() || chunk->encoded()) return inner_->Put(std::move(chunk));
  const auto t0 = std::chrono::steady_clock::now();
  auto encoded = EncodeChunk(chunk, options_.level);
  encode_ns_ += NanosSince(t0);
  // Out of memory, or a chunk so small that the scales outweigh the values
  // (a tail piece of a few tokens): stored raw.
  if (!encoded.ok() || (*encoded)->size() >= chunk->size()) return inner_->Put(std::move(chunk));
  ++encoded_;
  raw_bytes_ += chunk->payload().size();
  encoded_bytes_ += (*encoded)->payload().size();
  return inner_->Put(*std::move(encoded));
}

TierStats CodecTier::Stats() {
  // The inner tier counted a hit for each chunk that then failed to decode.
  TierStats s = inner_->Stats();
  const uint64_t errors = decode_errors_.load();
  s.corrupt += errors;
  s.misses += errors;
  s.hits -= std::min(s.hits, errors);
  return s;
}

CodecStats CodecTier::codec_stats() const {
  return {encoded_.load(),       raw_bytes_.load(),        encoded_bytes_.load(),   decoded_.load(),
          decode_errors_.load(), encode_ns_.load() * 1e-9, decode_ns_.load() * 1e-9};
}

}  // namespace kdn::kvbus
