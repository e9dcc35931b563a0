#pragma once
// Reading GGUF, llama.cpp's one-file model format (docs/engine.md, "GGUF"):
// a header (magic "GGUF", version 2 or 3, counts), typed metadata key/value
// pairs, tensor descriptions, then the tensors' data at an alignment.
//
// GgufFile::Open memory-maps the file and checks everything before anyone
// reads it: the magic and version, every string's and array's length against
// the bytes left, every tensor's type, dimensions and byte range against the
// file, so a truncated, malformed or hostile file is a Status that names the
// file and what is wrong, never a crash or a huge allocation. Tensors whose
// type the reader knows the block size of may be of any such type here; which
// ones can be dequantized is the engine's business (kdn/engine/gguf_weights.h).
//
// Here, in kdn_model, rather than in the engine: kdn-router reads a GGUF's
// config, tokenizer and chat template without linking the engine.
// Thread-safe after Open (read-only).

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kdn/common/mapped_file.h"
#include "kdn/common/status.h"
#include "kdn/model/config.h"

namespace kdn::model {

enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};
const char* GgufValueTypeName(GgufValueType t);

// One metadata value. Integers and bools are held in `bits` (signed ones
// sign-extended), floats in `f`, strings in `s`, arrays in `items` (each of
// type `elem`).
struct GgufValue {
  GgufValueType type = GgufValueType::kUint8;
  uint64_t bits = 0;
  double f = 0;
  std::string s;
  GgufValueType elem = GgufValueType::kUint8;
  std::vector<GgufValue> items;
};

// ggml's tensor types, as numbered in the file. The reader knows the block
// size of each named here (and refuses a number it does not know).
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
};

// The layout of a ggml type: `block_elements` values stored in `block_bytes`.
struct GgmlTypeInfo {
  const char* name = nullptr;  // as llama.cpp spells it: "Q4_1"
  int64_t block_elements = 0;
  int64_t block_bytes = 0;
};
// nullptr for a number the reader does not know.
const GgmlTypeInfo* FindGgmlType(uint32_t type);

struct GgufTensor {
  std::string name;
  // ggml's order: dims[0] is the innermost (contiguous) one. A Hugging Face
  // [out, in] matrix is stored as dims {in, out}.
  std::vector<int64_t> dims;
  uint32_t type = 0;              // a GgmlType; FindGgmlType(type) is never null
  const uint8_t* data = nullptr;  // into the mapping; valid while the file lives
  size_t bytes = 0;

  int64_t numel() const;
};

class GgufFile {
 public:
  // Corruption for a malformed file (naming what and where), NotFound or
  // IoError when it cannot be read, InvalidArgument when `path` is not a
  // regular file, Unimplemented for a version other than 2
  // or 3 or a tensor type number the reader does not know.
  static Result<std::unique_ptr<GgufFile>> Open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return file_->path(); }
  uint32_t version() const { return version_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const GgufTensor* FindTensor(const std::string& name) const;
  const GgufValue* Find(const std::string& key) const;

  // Typed reads of a metadata key. NotFound when absent; InvalidArgument
  // naming the file, the key and the type found when it is of another type
  // (or, for Int, out of int64's range). Int takes any integer type; Float
  // float32 or float64; the list forms an array of such elements.
  Result<int64_t> Int(const std::string& key) const;
  Result<double> Float(const std::string& key) const;
  Result<bool> Bool(const std::string& key) const;
  Result<std::string> String(const std::string& key) const;
  Result<std::vector<std::string>> Strings(const std::string& key) const;
  Result<std::vector<int64_t>> Ints(const std::string& key) const;
  Result<std::vector<double>> Floats(const std::string& key) const;

  // The file's name and `what`, for error messages.
  std::string Where(const std::string& what) const;

 private:
  GgufFile() = default;
  Status Parse();

  std::unique_ptr<MappedFile> file_;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

// Whether `path` names a GGUF file rather than a model folder: it is not a
// directory and either ends in ".gguf" or begins with GGUF's magic. Model
// loaders take either (a --model argument).
bool IsGgufPath(const std::filesystem::path& path);

// The ModelConfig of a GGUF file's metadata: general.architecture "llama"
// and its llama.* keys (sizes, heads, rms epsilon, RoPE base and linear
// scaling, context length), the tokenizer.ggml.* BOS/EOS ids, tied
// embeddings where there is no output.weight tensor. What kdn does not run
// (another architecture, experts, RoPE over part of the head, a rope_freqs
// tensor, YaRN) is Unimplemented naming the key; the sizes are then checked
// as config.json's are. torch_dtype holds "gguf:" and the tensor types found
// (e.g. "gguf:F32+Q4_1+Q8_0"), which the model fingerprint carries.
Result<ModelConfig> ModelConfigFromGguf(const GgufFile& file);

// The token id tokenizer.ggml.`key` (bos_token_id, eos_token_id,
// unknown_token_id, padding_token_id...) names, or, where the file has no
// such key, the one llama.cpp assumes: sentencepiece's 1, 2 and 0 for BOS,
// EOS and unknown with tokenizer model "llama"; -1 (none) otherwise. Not
// checked against the vocabulary; InvalidArgument when the key is not an
// integer.
Result<int64_t> GgufTokenId(const GgufFile& file, const std::string& key);

}  // namespace kdn::model
