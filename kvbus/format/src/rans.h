#pragma once
// The entropy coder under kvc (kdn/kvbus/codec.h), internal to kvbus: byte
// I/O for the stream, frequency tables, and rANS with 32-bit states kept in
// [2^16, 2^32), moving 16-bit words (so a symbol reads at most one word, and
// the decoder needs no loop), probabilities in 1/4096ths, two states
// interleaved. The stream's layout is in docs/kvbus.md, "KV codec".

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::kvbus::rans {

constexpr uint32_t kProbBits = 12;
constexpr uint32_t kProbScale = 1u << kProbBits;
constexpr uint32_t kRansLow = 1u << 16;

// ---- byte I/O ---------------------------------------------------------------

inline void PutU32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
inline void PutF32(std::vector<uint8_t>& out, float f) { PutU32(out, std::bit_cast<uint32_t>(f)); }
inline void PutVarint(std::vector<uint8_t>& out, uint32_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}

// Reads from [p, end); any read past the end fails the reader, and every
// later read returns 0, so a caller checks ok() once after a run of reads.
class Reader {
 public:
  Reader(const uint8_t* p, const uint8_t* end) : p_(p), end_(end) {}
  bool ok() const { return ok_; }
  const uint8_t* pos() const { return p_; }
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  uint8_t U8() {
    if (!Need(1)) return 0;
    return *p_++;
  }
  uint32_t U32() {
    if (!Need(4)) return 0;
    uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | p_[i];
    p_ += 4;
    return v;
  }
  float F32() { return std::bit_cast<float>(U32()); }
  uint32_t Varint() {
    uint32_t v = 0;
    for (int shift = 0; shift < 35; shift += 7) {
      const uint8_t b = U8();
      v |= static_cast<uint32_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    ok_ = false;  // over 5 bytes
    return 0;
  }
  void Skip(size_t n) {
    if (Need(n)) p_ += n;
  }

 private:
  bool Need(size_t n) {
    if (ok_ && left() >= n) return true;
    ok_ = false;
    return false;
  }
  const uint8_t* p_;
  const uint8_t* end_;
  bool ok_ = true;
};

// ---- frequency tables ---------------------------------------------------------

struct EncTable {
  std::vector<uint32_t> freq, cum;  // per symbol
};

// One entry per probability slot: the symbol it decodes to and that
// symbol's frequency and cumulative frequency.
struct DecSlot {
  uint16_t sym, freq, cum;
};
using DecTable = std::vector<DecSlot>;  // kProbScale entries

// Frequencies summing to kProbScale, every symbol that occurs at least 1.
EncTable Normalize(const std::vector<uint64_t>& counts);

// The table as varints: the alphabet size (up to the last symbol that
// occurs; 0 for a byte plane stored verbatim), then each symbol's frequency.
void WriteTable(std::vector<uint8_t>& out, const EncTable& t, bool verbatim = false);

// `verbatim_ok`: a byte plane's table, which may be empty (n = 0: the plane
// is stored verbatim).
Result<DecTable> ReadTable(Reader& in, uint32_t alphabet, bool verbatim_ok = false);

// ---- rANS ---------------------------------------------------------------------
//
// Two coder states share one byte stream. Each symbol names its state: the
// symbols of even channels use state 0 and those of odd channels state 1,
// so a decoder keeps both states in registers and decodes two channels per
// step, their dependency chains overlapping. Any such assignment is
// decodable as long as the decoder takes the symbols in the encoder's order.

// Collects symbols in decode order, each with its state and its table, or
// as `k` raw bits (a uniform symbol of 2^k values); Finish codes them in
// reverse and returns the stream the decoder reads forwards.
class RansEncoder {
 public:
  void Add(int state, uint8_t table, uint16_t sym) {
    items_.push_back({static_cast<uint8_t>(state), table, sym});
  }
  void AddBits(int state, int k, uint16_t value) {
    if (k > 0)
      items_.push_back({static_cast<uint8_t>(state), static_cast<uint8_t>(kBitsFlag | k), value});
  }
  std::vector<uint8_t> Finish(const std::vector<const EncTable*>& tables) const;

 private:
  static constexpr uint8_t kBitsFlag = 0x80;
  struct Item {
    uint8_t state;
    uint8_t table;  // or kBitsFlag | k
    uint16_t sym;
  };
  std::vector<Item> items_;
};

// The byte stream both states read from; the states live with the caller
// (x0 and x1, in registers).
class RansStream {
 public:
  RansStream(const uint8_t* p, const uint8_t* end) : p_(p), end_(end) {}
  // Reads a state (4 bytes, little-endian).
  uint32_t State() {
    if (end_ - p_ < 4) {
      ok_ = false;
      return kRansLow;
    }
    const uint32_t st = p_[0] | p_[1] << 8 | p_[2] << 16 | static_cast<uint32_t>(p_[3]) << 24;
    p_ += 4;
    if (st < kRansLow) ok_ = false;
    return st;
  }
  uint32_t Get(uint32_t& st, const DecSlot* t) {
    const DecSlot d = t[st & (kProbScale - 1)];
    st = d.freq * (st >> kProbBits) + (st & (kProbScale - 1)) - d.cum;
    Renormalize(st);
    return d.sym;
  }
  // `k` raw bits (0..12; with 0 the state is left as it is, so no branch).
  uint32_t GetBits(uint32_t& st, int k) {
    const uint32_t slot = st & (kProbScale - 1), shift = kProbBits - k;
    const uint32_t v = slot >> shift;
    st = (kProbScale >> k) * (st >> kProbBits) + slot - (v << shift);
    Renormalize(st);
    return v;
  }
  // Every byte read, none past the end, and both states back where the
  // encoder started them.
  bool Done(uint32_t x0, uint32_t x1) const {
    return ok_ && p_ == end_ && x0 == kRansLow && x1 == kRansLow;
  }

 private:
  // Reads a word into a state that fell below kRansLow: at most one, without
  // a branch on the data (a stream cut short reads zeros and fails Done).
  void Renormalize(uint32_t& st) {
    const bool need = st < kRansLow;
    const bool have = end_ - p_ >= 2;
    const uint32_t w = have ? static_cast<uint32_t>(p_[0] | p_[1] << 8) : 0;
    st = need ? (st << 16) | w : st;
    p_ += need && have ? 2 : 0;
    ok_ &= have || !need;
  }
  const uint8_t* p_;
  const uint8_t* end_;
  bool ok_ = true;
};

// Appends a stream: its byte length, then its bytes.
void PutStream(std::vector<uint8_t>& out, const std::vector<uint8_t>& s);

// Reads a stream's length and returns the stream, or CORRUPTION.
Result<RansStream> OpenStream(Reader& in);

}  // namespace kdn::kvbus::rans
