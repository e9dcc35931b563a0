#include "kdn/model/gguf.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace kdn::model {
namespace {

// A GGUF file built byte by byte, so that each test can break one field.
class GgufBytes {
 public:
  explicit GgufBytes(uint32_t version = 3) {
    bytes_ = "GGUF";
    Put<uint32_t>(version);
  }
  template <typename T>
  GgufBytes& Put(T v) {
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof(v));
    return *this;
  }
  GgufBytes& Str(const std::string& s) {
    Put<uint64_t>(s.size());
    bytes_ += s;
    return *this;
  }
  GgufBytes& Counts(uint64_t tensors, uint64_t kv) { return Put(tensors).Put(kv); }
  GgufBytes& KeyU32(const std::string& k, uint32_t v) {
    return Str(k).Put<uint32_t>(static_cast<uint32_t>(GgufValueType::kUint32)).Put(v);
  }
  GgufBytes& KeyF32(const std::string& k, float v) {
    return Str(k).Put<uint32_t>(static_cast<uint32_t>(GgufValueType::kFloat32)).Put(v);
  }
  GgufBytes& KeyStr(const std::string& k, const std::string& v) {
    return Str(k).Put<uint32_t>(static_cast<uint32_t>(GgufValueType::kString)).Str(v);
  }
  GgufBytes& KeyStrings(const std::string& k, const std::vector<std::string>& v) {
    Str(k).Put<uint32_t>(static_cast<uint32_t>(GgufValueType::kArray));
    Put<uint32_t>(static_cast<uint32_t>(GgufValueType::kString)).Put<uint64_t>(v.size());
    for (const std::string& s : v) Str(s);
    return *this;
  }
  // A tensor description; `type` a ggml type number.
  GgufBytes& Tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type,
                    uint64_t offset) {
    Str(name).Put<uint32_t>(static_cast<uint32_t>(dims.size()));
    for (uint64_t d : dims) Put(d);
    return Put(type).Put(offset);
  }
  // Pads to the 32-byte alignment, then `n` data bytes (value i & 0xff).
  GgufBytes& Data(size_t n) {
    while (bytes_.size() % 32 != 0) bytes_ += '\0';
    for (size_t i = 0; i < n; ++i) bytes_ += static_cast<char>(i & 0xff);
    return *this;
  }
  std::string Write(const std::string& name) const {
    const auto dir =
        std::filesystem::temp_directory_path() / ("kdn_gguf_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    const std::string path = (dir / name).string();
    std::ofstream(path, std::ios::binary).write(bytes_.data(), bytes_.size());
    return path;
  }
  std::string& bytes() { return bytes_; }

 private:
  std::string bytes_;
};

// Two metadata pairs and one F32 tensor of 2 x 4.
GgufBytes Valid() {
  GgufBytes g;
  g.Counts(1, 3)
      .KeyStr("general.architecture", "llama")
      .KeyF32("llama.rope.freq_base", 10000.0f)
      .KeyStrings("tokenizer.ggml.tokens", {"a", "b", "c"})
      .Tensor("w", {4, 2}, 0, 0)
      .Data(32);
  return g;
}

TEST(GgufFile, ReadsMetadataAndTensorsOfAWellFormedFile) {
  auto f = GgufFile::Open(Valid().Write("valid.gguf"));
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->version(), 3u);
  EXPECT_EQ(*(*f)->String("general.architecture"), "llama");
  EXPECT_EQ(*(*f)->Float("llama.rope.freq_base"), 10000.0);
  EXPECT_EQ(*(*f)->Strings("tokenizer.ggml.tokens"), (std::vector<std::string>{"a", "b", "c"}));
  const GgufTensor* t = (*f)->FindTensor("w");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dims, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(t->bytes, 32u);
  EXPECT_EQ(t->data[5], 5);
}

TEST(GgufFile, NamesTheKeyAndTypeOfAWrongTypedRead) {
  auto f = GgufFile::Open(Valid().Write("typed.gguf"));
  ASSERT_TRUE(f.ok());
  auto r = (*f)->Int("general.architecture");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("general.architecture is string, not an integer"),
            std::string::npos)
      << r.status().message();
  EXPECT_EQ((*f)->Int("no.such.key").status().code(), StatusCode::kNotFound);
}

TEST(GgufFile, RefusesEveryTruncation) {
  const std::string whole = Valid().bytes();
  for (size_t n = 0; n < whole.size(); ++n) {
    GgufBytes g;
    g.bytes() = whole.substr(0, n);
    auto f = GgufFile::Open(g.Write("cut.gguf"));
    EXPECT_FALSE(f.ok()) << "cut at " << n;
  }
}

TEST(GgufFile, RefusesARowSizeThatOverflows) {
  // 2^62 F32 values: 2^64 bytes, which wraps to 0 in 64 bits.
  GgufBytes g;
  g.Counts(1, 0).Tensor("w", {uint64_t{1} << 62}, 0, 0).Data(0);
  auto f = GgufFile::Open(g.Write("overflow.gguf"));
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("overflows"), std::string::npos) << f.status().message();
}

TEST(GgufFile, RefusesAnAlignmentBelowEight) {
  GgufBytes g;
  g.Counts(0, 1).KeyU32("general.alignment", 4);
  auto f = GgufFile::Open(g.Write("align.gguf"));
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("general.alignment 4"), std::string::npos);
}

TEST(GgufFile, RefusesDataPastTheEndAnUnknownTypeAndAnotherVersion) {
  GgufBytes past;
  past.Counts(1, 0).Tensor("w", {8}, 0, 0).Data(16);  // 32 bytes needed
  EXPECT_EQ(GgufFile::Open(past.Write("past.gguf")).status().code(), StatusCode::kCorruption);
  GgufBytes type;
  type.Counts(1, 0).Tensor("w", {8}, 99, 0).Data(64);
  auto t = GgufFile::Open(type.Write("type.gguf"));
  EXPECT_EQ(t.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(t.status().message().find("unknown ggml type 99"), std::string::npos);
  GgufBytes v4(4);
  v4.Counts(0, 0);
  EXPECT_EQ(GgufFile::Open(v4.Write("v4.gguf")).status().code(), StatusCode::kUnimplemented);
}

TEST(GgufFile, RefusesACountTheFileCannotHold) {
  GgufBytes g;
  g.Counts(0, 1).Str("k").Put<uint32_t>(static_cast<uint32_t>(GgufValueType::kArray));
  g.Put<uint32_t>(static_cast<uint32_t>(GgufValueType::kUint8)).Put<uint64_t>(uint64_t{1} << 40);
  auto f = GgufFile::Open(g.Write("count.gguf"));
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("cannot fit"), std::string::npos) << f.status().message();
}

TEST(GgufFile, IsGgufPathTellsAFileFromAFolder) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("kdn_gguf_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "folder.gguf");
  EXPECT_FALSE(IsGgufPath(dir / "folder.gguf"));
  EXPECT_TRUE(IsGgufPath(Valid().Write("named.gguf")));
  EXPECT_TRUE(IsGgufPath(Valid().Write("no-extension")));  // by its magic
  EXPECT_TRUE(IsGgufPath(dir / "missing.gguf"));           // Open then says it is missing
  EXPECT_FALSE(IsGgufPath(dir / "missing-folder"));
  EXPECT_EQ(GgufFile::Open(dir / "missing.gguf").status().code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kdn::model
