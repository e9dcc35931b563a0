#pragma once
// Private to kdn_kvbus_cuda: lowercase hex of the handles carried as text
// (cudaIpcMemHandle_t, a GPU's UUID, ncclUniqueId).

#include <cstddef>
#include <cstdint>
#include <string>

namespace kdn::kvbus::cuda::internal {

inline std::string Hex(const void* data, size_t n) {
  static const char* kDigits = "0123456789abcdef";
  const auto* p = static_cast<const uint8_t*>(data);
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) out += kDigits[p[i] >> 4], out += kDigits[p[i] & 15];
  return out;
}

// False (and *out partly written) unless `s` is exactly 2n lowercase hex digits.
inline bool Unhex(const std::string& s, void* out, size_t n) {
  auto digit = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (s.size() != 2 * n) return false;
  auto* p = static_cast<uint8_t*>(out);
  for (size_t i = 0; i < n; ++i) {
    const int hi = digit(s[2 * i]), lo = digit(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    p[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return true;
}

}  // namespace kdn::kvbus::cuda::internal
