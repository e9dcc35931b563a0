// The rANS coder and frequency tables under kvc (rans.h).
#include "rans.h"

#include <algorithm>
#include <numeric>
#include <string>

namespace kdn::kvbus::rans {

EncTable Normalize(const std::vector<uint64_t>& counts) {
  EncTable t;
  const size_t n = counts.size();
  t.freq.assign(n, 0);
  t.cum.assign(n + 1, 0);
  const uint64_t total = std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  if (total == 0) return t;
  int64_t sum = 0;
  for (size_t s = 0; s < n; ++s) {
    if (counts[s] == 0) continue;
    t.freq[s] = std::max<uint32_t>(1, static_cast<uint32_t>(counts[s] * kProbScale / total));
    sum += t.freq[s];
  }
  // Hand the rounding error to (or take it from) the most frequent symbols.
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(),
            [&](uint32_t a, uint32_t b) { return t.freq[a] > t.freq[b]; });
  int64_t diff = static_cast<int64_t>(kProbScale) - sum;
  if (diff > 0) t.freq[order[0]] += static_cast<uint32_t>(diff);
  for (size_t i = 0; diff < 0; i = (i + 1) % n) {
    const uint32_t s = order[i];
    if (t.freq[s] > 1) {
      const uint32_t take = static_cast<uint32_t>(
          std::min<int64_t>(-diff, std::max<int64_t>(1, (t.freq[s] - 1) / 2)));
      t.freq[s] -= take;
      diff += take;
    }
  }
  for (size_t s = 0; s < n; ++s) t.cum[s + 1] = t.cum[s] + t.freq[s];
  return t;
}

void WriteTable(std::vector<uint8_t>& out, const EncTable& t, bool verbatim) {
  if (verbatim) {
    PutVarint(out, 0);
    return;
  }
  size_t n = t.freq.size();
  while (n > 0 && t.freq[n - 1] == 0) --n;
  PutVarint(out, static_cast<uint32_t>(n));
  for (size_t s = 0; s < n; ++s) PutVarint(out, t.freq[s]);
}

Result<DecTable> ReadTable(Reader& in, uint32_t alphabet, bool verbatim_ok) {
  const uint32_t n = in.Varint();
  if (in.ok() && n == 0 && verbatim_ok) return DecTable{};
  if (!in.ok() || n == 0 || n > alphabet) {
    return Corruption("kvc: a table of " + std::to_string(n) + " symbols, at most " +
                      std::to_string(alphabet) + " allowed");
  }
  DecTable t(kProbScale);
  uint32_t cum = 0;
  for (uint32_t s = 0; s < n; ++s) {
    const uint32_t f = in.Varint();
    if (!in.ok() || f > kProbScale - cum) return Corruption("kvc: table frequencies overflow");
    for (uint32_t k = 0; k < f; ++k) {
      t[cum + k] = {static_cast<uint16_t>(s), static_cast<uint16_t>(f), static_cast<uint16_t>(cum)};
    }
    cum += f;
  }
  if (cum != kProbScale) return Corruption("kvc: table frequencies do not sum to 4096");
  return t;
}

std::vector<uint8_t> RansEncoder::Finish(const std::vector<const EncTable*>& tables) const {
  std::vector<uint8_t> rev;
  rev.reserve(items_.size() / 2 + 16);
  uint32_t x[2] = {kRansLow, kRansLow};
  for (size_t i = items_.size(); i-- > 0;) {
    const Item& it = items_[i];
    uint32_t f, c;
    if (it.table & kBitsFlag) {
      f = kProbScale >> (it.table & ~kBitsFlag);
      c = it.sym * f;
    } else {
      f = tables[it.table]->freq[it.sym];
      c = tables[it.table]->cum[it.sym];
    }
    uint32_t& st = x[it.state];
    // (kRansLow / kProbScale) * 2^16 * f: one word out always brings st
    // below it. 64-bit: a symbol of probability 1 makes it 2^32.
    if (uint64_t{st} >= (uint64_t{f} << 20)) {
      rev.push_back(static_cast<uint8_t>(st >> 8));  // reversed below: low byte first
      rev.push_back(static_cast<uint8_t>(st));
      st >>= 16;
    }
    st = ((st / f) << kProbBits) + (st % f) + c;
  }
  for (int j = 1; j >= 0; --j) {
    for (int b = 3; b >= 0; --b) rev.push_back(static_cast<uint8_t>(x[j] >> (8 * b)));
  }
  return {rev.rbegin(), rev.rend()};
}

void PutStream(std::vector<uint8_t>& out, const std::vector<uint8_t>& s) {
  PutVarint(out, static_cast<uint32_t>(s.size()));
  out.insert(out.end(), s.begin(), s.end());
}

Result<RansStream> OpenStream(Reader& in) {
  const uint32_t len = in.Varint();
  if (!in.ok() || len < 8 || len > in.left()) return Corruption("kvc: stream length out of range");
  const uint8_t* begin = in.pos();
  in.Skip(len);
  return RansStream(begin, begin + len);
}

}  // namespace kdn::kvbus::rans
