#pragma once
// The element types of KV: one enum for the engine's KV cache and tensors
// (kdn::engine names it DType too), the chunk format's dtype field
// (kdn/kvbus/chunk.h) and the C ABI's kdn_dtype (kdn/client.h mirrors its
// values; client.cpp checks each by static_assert, and tests/client/
// test_hf.py checks the Python package's table against the header). The
// values are what chunk headers hold: never renumber. Thread-safe (pure).

#include <cstdint>
#include <optional>

namespace kdn {

enum class DType : uint32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Bytes of one element.
constexpr int DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }

// "f32", "f16", "bf16": the spelling of flags, logs and the model
// fingerprint (docs/kvbus.md, "Model fingerprint"); never change it.
constexpr const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "?";
}

// safetensors' spelling: "F32", "F16", "BF16".
constexpr const char* SafetensorsDTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
  }
  return "?";
}

// The DType of a value from outside (a chunk header, the C ABI), or none
// for a value that is not one.
constexpr std::optional<DType> DTypeFromValue(int64_t v) {
  if (v < 0 || v > static_cast<int64_t>(DType::kBF16)) return std::nullopt;
  return static_cast<DType>(v);
}

}  // namespace kdn
