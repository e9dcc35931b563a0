// libkdn_client's C API (kdn/client.h) against a real kdn-store process:
// this binary links the shared library alone (no kdn library), as another
// engine would. Round trips through every layout kind and dtype, the keys
// against kdn's spec, lookups and misses, and every bad argument answered
// with a code and a message.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "kdn/client.h"

namespace {

namespace fs = std::filesystem;

constexpr int kLayers = 2, kHeads = 2, kDim = 8, kChunk = 64;

// A model folder: a llama config.json and a weights file, which is all the
// fingerprint reads (config, tensors it implies, a digest of the bytes).
fs::path WriteModel(const fs::path& dir, char weights_byte) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << R"({"architectures": ["LlamaForCausalLM"],
    "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": true})";
  std::ofstream(dir / "model.safetensors") << std::string(64, weights_byte);
  return dir;
}

// kdn-store on a free loopback port, killed at the end.
class StoreProcess {
 public:
  StoreProcess() {
    const char* bin = std::getenv("KDN_BIN_DIR");
    const std::string path = std::string(bin != nullptr ? bin : "bin") + "/kdn-store";
    int out[2];
    if (pipe(out) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], 1);
      close(out[0]);
      execl(path.c_str(), path.c_str(), "--listen", "tcp://127.0.0.1:0", "--host-mib", "64",
            "--log-level", "warn", static_cast<char*>(nullptr));
      _exit(127);
    }
    close(out[1]);
    FILE* f = fdopen(out[0], "r");
    char line[256] = {};
    if (f != nullptr && fgets(line, sizeof(line), f) != nullptr) {
      std::string s(line);
      while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
      if (s.starts_with("tcp://")) uri_ = "kdn-store://" + s.substr(6);
    }
    if (f != nullptr) fclose(f);
  }
  ~StoreProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
  }
  const std::string& uri() const { return uri_; }

 private:
  pid_t pid_ = -1;
  std::string uri_;
};

// Contiguous K and V buffers for `tokens` tokens of every layer, as `major`
// orders them, in `dtype`.
struct Buffers {
  Buffers(kdn_dtype dtype, kdn_major major, int64_t tokens) {
    const size_t es = dtype == KDN_F32 ? 4 : 2;
    const size_t bytes = static_cast<size_t>(tokens) * kHeads * kDim * es;
    for (int l = 0; l < kLayers; ++l) {
      k.emplace_back(bytes, 0);
      v.emplace_back(bytes, 0);
      kp.push_back(k.back().data());
      vp.push_back(v.back().data());
    }
    layout.dtype = dtype;
    layout.layers = kLayers;
    layout.kv_heads = kHeads;
    layout.head_dim = kDim;
    layout.k = kp.data();
    layout.v = vp.data();
    EXPECT_EQ(kdn_layout_contiguous(&layout, major, tokens), KDN_OK);
  }
  std::vector<std::vector<uint8_t>> k, v;
  std::vector<void*> kp, vp;
  kdn_kv_layout layout{};
};

// The value of (layer, K|V, token, head, element): exact in f16 and bf16.
float Value(int l, int kv, int64_t t, int h, int d) {
  return static_cast<float>(((l * 2 + kv) * 7 + t * 3 + h * 5 + d) % 64) / 4.0f;
}

float Load(const kdn_kv_layout& L, int l, int kv, int64_t t, int h, int d) {
  int64_t off = h * L.stride_head + d;
  off += L.block_tokens > 0 ? L.block_table[t / L.block_tokens] * L.stride_block +
                                  (t % L.block_tokens) * L.stride_token
                            : t * L.stride_token;
  const uint8_t* base = static_cast<const uint8_t*>((kv == 0 ? L.k : L.v)[l]);
  if (L.dtype == KDN_F32) {
    float f;
    std::memcpy(&f, base + off * 4, 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, base + off * 2, 2);
  if (L.dtype == KDN_BF16) {
    uint32_t bits = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  // f16: the values above are small multiples of 1/4, normal numbers.
  const int e = (b >> 10) & 0x1f, m = b & 0x3ff;
  return e == 0 && m == 0 ? 0.0f : std::ldexp(1.0f + m / 1024.0f, e - 15) * ((b >> 15) ? -1 : 1);
}

void Fill(Buffers& b, int64_t tokens) {
  for (int l = 0; l < kLayers; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int64_t t = 0; t < tokens; ++t)
        for (int h = 0; h < kHeads; ++h)
          for (int d = 0; d < kDim; ++d) {
            const float f = Value(l, kv, t, h, d);
            int64_t off = t * b.layout.stride_token + h * b.layout.stride_head + d;
            std::memcpy((kv == 0 ? b.k : b.v)[l].data() + off * 4, &f, 4);
          }
}

int64_t Mismatches(const kdn_kv_layout& L, int64_t tokens) {
  int64_t bad = 0;
  for (int l = 0; l < kLayers; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int64_t t = 0; t < tokens; ++t)
        for (int h = 0; h < kHeads; ++h)
          for (int d = 0; d < kDim; ++d) bad += Load(L, l, kv, t, h, d) != Value(l, kv, t, h, d);
  return bad;
}

std::vector<int32_t> Tokens(int64_t n, int32_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = (seed + i * 37) % 300;
  return t;
}

class ClientApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { store_ = new StoreProcess(); }
  static void TearDownTestSuite() { delete store_; }

  void SetUp() override {
    ASSERT_FALSE(store_->uri().empty()) << "kdn-store did not start (KDN_BIN_DIR?)";
    dir_ = fs::temp_directory_path() / ("kdn-client-" + std::to_string(getpid()));
    ASSERT_EQ(kdn_model_open(WriteModel(dir_ / "a", 'a').c_str(), KDN_F32, &model_), KDN_OK)
        << kdn_last_error();
    kdn_client_options o{};
    o.chunk_tokens = kChunk;
    ASSERT_EQ(kdn_client_open(store_->uri().c_str(), model_, &o, &client_), KDN_OK)
        << kdn_last_error();
  }
  void TearDown() override {
    kdn_client_close(client_);
    kdn_model_close(model_);
    fs::remove_all(dir_);
  }

  static StoreProcess* store_;
  fs::path dir_;
  kdn_model* model_ = nullptr;
  kdn_client* client_ = nullptr;
};
StoreProcess* ClientApiTest::store_ = nullptr;

TEST_F(ClientApiTest, ModelInfoAndFingerprint) {
  EXPECT_EQ(kdn_api_version(), KDN_CLIENT_API_VERSION);
  kdn_model_info info{};
  ASSERT_EQ(kdn_model_get_info(model_, &info), KDN_OK);
  EXPECT_EQ(info.layers, kLayers);
  EXPECT_EQ(info.kv_heads, kHeads);
  EXPECT_EQ(info.head_dim, kDim);
  EXPECT_EQ(std::strlen(info.fingerprint), 32u);
  // The same files give the same fingerprint; other weights or another KV
  // dtype another.
  kdn_model *same = nullptr, *other = nullptr, *bf16 = nullptr;
  ASSERT_EQ(kdn_model_open((dir_ / "a").c_str(), KDN_F32, &same), KDN_OK);
  ASSERT_EQ(kdn_model_open(WriteModel(dir_ / "b", 'b').c_str(), KDN_F32, &other), KDN_OK);
  ASSERT_EQ(kdn_model_open((dir_ / "a").c_str(), KDN_BF16, &bf16), KDN_OK);
  kdn_model_info i2{}, i3{}, i4{};
  kdn_model_get_info(same, &i2);
  kdn_model_get_info(other, &i3);
  kdn_model_get_info(bf16, &i4);
  EXPECT_STREQ(i2.fingerprint, info.fingerprint);
  EXPECT_STRNE(i3.fingerprint, info.fingerprint);
  EXPECT_STRNE(i4.fingerprint, info.fingerprint);
  kdn_model_close(same);
  kdn_model_close(other);
  kdn_model_close(bf16);
}

TEST_F(ClientApiTest, SpansAreFullChunksThenTailPieces) {
  const auto t = Tokens(3 * kChunk + 6, 1);  // tail of 6: pieces 1, 4, 1
  int64_t count = -1;
  ASSERT_EQ(kdn_spans(client_, t.data(), static_cast<int64_t>(t.size()), nullptr, 0, &count),
            KDN_OK);
  ASSERT_EQ(count, 6);
  std::vector<kdn_span> s(static_cast<size_t>(count));
  ASSERT_EQ(kdn_spans(client_, t.data(), static_cast<int64_t>(t.size()), s.data(), count, &count),
            KDN_OK);
  const int64_t sizes[] = {kChunk, kChunk, kChunk, 1, 4, 1};
  int64_t first = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_EQ(s[i].first, first) << i;
    EXPECT_EQ(s[i].count, sizes[i]) << i;
    first += s[i].count;
  }
  // Chained: a change in the first token changes every key.
  auto u = t;
  u[0] ^= 1;
  std::vector<kdn_span> s2(s.size());
  ASSERT_EQ(kdn_spans(client_, u.data(), static_cast<int64_t>(u.size()), s2.data(), count, &count),
            KDN_OK);
  for (size_t i = 0; i < s.size(); ++i) EXPECT_NE(std::memcmp(s[i].key, s2[i].key, 16), 0) << i;
}

TEST_F(ClientApiTest, StoreThenFetchThroughEveryLayout) {
  const int64_t n = 3 * kChunk + 20;  // a tail of 20: pieces 1, 16, 2, 1
  const auto t = Tokens(n, 2);
  Buffers src(KDN_F32, KDN_TOKEN_MAJOR, n);
  Fill(src, n);
  kdn_store_result r{};
  ASSERT_EQ(kdn_store(client_, t.data(), n, &src.layout, &r), KDN_OK) << kdn_last_error();
  EXPECT_EQ(r.stored, 7);
  EXPECT_EQ(r.already_held, 0);
  // Again: all held, nothing built.
  ASSERT_EQ(kdn_store(client_, t.data(), n, &src.layout, &r), KDN_OK);
  EXPECT_EQ(r.stored, 0);
  EXPECT_EQ(r.already_held, 7);

  int64_t hit = -1;
  ASSERT_EQ(kdn_lookup(client_, t.data(), n, -1, &hit), KDN_OK);
  EXPECT_EQ(hit, n);
  // At most n - 1: the full chunks and the tail pieces that fit (1 + 16 + 2).
  ASSERT_EQ(kdn_lookup(client_, t.data(), n, n - 1, &hit), KDN_OK);
  EXPECT_EQ(hit, 3 * kChunk + 19);

  for (kdn_dtype dtype : {KDN_F32, KDN_F16, KDN_BF16}) {
    for (kdn_major major : {KDN_TOKEN_MAJOR, KDN_HEAD_MAJOR}) {
      Buffers dst(dtype, major, n);
      int64_t fetched = -1;
      ASSERT_EQ(kdn_fetch(client_, t.data(), n, -1, &dst.layout, &fetched), KDN_OK)
          << kdn_last_error();
      EXPECT_EQ(fetched, n);
      EXPECT_EQ(Mismatches(dst.layout, n), 0) << dtype << " " << major;
    }
  }
  // At most 100 tokens: the second chunk's first 36, into buffers of 100.
  ASSERT_EQ(kdn_lookup(client_, t.data(), n, 100, &hit), KDN_OK);
  EXPECT_EQ(hit, 100);
  Buffers part(KDN_F32, KDN_HEAD_MAJOR, 100);
  int64_t got = -1;
  ASSERT_EQ(kdn_fetch(client_, t.data(), n, 100, &part.layout, &got), KDN_OK) << kdn_last_error();
  EXPECT_EQ(got, 100);
  EXPECT_EQ(Mismatches(part.layout, 100), 0);

  // Paged, blocks of 4 tokens in a scrambled order, head-major in a block.
  const int64_t blocks = (n + 3) / 4 + 3;
  std::vector<int32_t> table(static_cast<size_t>((n + 3) / 4));
  for (size_t i = 0; i < table.size(); ++i) {
    table[i] = static_cast<int32_t>((i * 5 + 2) % static_cast<size_t>(blocks));
  }
  Buffers paged(KDN_BF16, KDN_HEAD_MAJOR, blocks * 4);
  ASSERT_EQ(kdn_layout_paged(&paged.layout, KDN_HEAD_MAJOR, 4, blocks), KDN_OK);
  paged.layout.block_table = table.data();
  paged.layout.block_table_len = static_cast<int64_t>(table.size());
  int64_t fetched = -1;
  ASSERT_EQ(kdn_fetch(client_, t.data(), n, -1, &paged.layout, &fetched), KDN_OK)
      << kdn_last_error();
  EXPECT_EQ(fetched, n);
  EXPECT_EQ(Mismatches(paged.layout, n), 0);

  // A prompt that continues past what was stored: what was stored of it (its
  // fourth chunk was never stored, but the tail pieces name the same 212
  // tokens), and its KV there is the stored KV.
  auto longer = t;
  const auto more = Tokens(2 * kChunk, 9);
  longer.insert(longer.end(), more.begin(), more.end());
  Buffers big(KDN_F32, KDN_TOKEN_MAJOR, static_cast<int64_t>(longer.size()));
  ASSERT_EQ(kdn_fetch(client_, longer.data(), static_cast<int64_t>(longer.size()), -1, &big.layout,
                      &fetched),
            KDN_OK);
  EXPECT_EQ(fetched, n);
  EXPECT_EQ(Mismatches(big.layout, n), 0);
  longer[3 * kChunk + 1] ^= 1;  // within the stored tail: the anchor only, under 16 tokens
  ASSERT_EQ(kdn_fetch(client_, longer.data(), static_cast<int64_t>(longer.size()), -1, &big.layout,
                      &fetched),
            KDN_OK);
  EXPECT_EQ(fetched, 3 * kChunk);
}

// A document is one chunk under its segment key, position 0, whatever its
// length: stored once, fetched whole in any layout, apart from prompts'
// prefix chunks of the same tokens; a miss for another model or namespace.
TEST_F(ClientApiTest, DocumentsAreStoredWholeUnderTheirSegmentKey) {
  const int64_t n = kChunk + 37;
  const auto t = Tokens(n, 5);
  int held = -1;
  ASSERT_EQ(kdn_document_held(client_, t.data(), n, &held), KDN_OK) << kdn_last_error();
  EXPECT_EQ(held, 0);
  Buffers src(KDN_F32, KDN_TOKEN_MAJOR, n);
  Fill(src, n);
  int already = -1;
  ASSERT_EQ(kdn_document_store(client_, t.data(), n, &src.layout, &already), KDN_OK)
      << kdn_last_error();
  EXPECT_EQ(already, 0);
  ASSERT_EQ(kdn_document_store(client_, t.data(), n, &src.layout, &already), KDN_OK);
  EXPECT_EQ(already, 1);
  ASSERT_EQ(kdn_document_held(client_, t.data(), n, &held), KDN_OK);
  EXPECT_EQ(held, 1);
  for (kdn_dtype dtype : {KDN_F32, KDN_BF16}) {
    for (kdn_major major : {KDN_TOKEN_MAJOR, KDN_HEAD_MAJOR}) {
      Buffers dst(dtype, major, n);
      ASSERT_EQ(kdn_document_fetch(client_, t.data(), n, &dst.layout), KDN_OK) << kdn_last_error();
      EXPECT_EQ(Mismatches(dst.layout, n), 0) << dtype << " " << major;
    }
  }
  // Not a prompt's prefix: no prefix chunk was stored.
  int64_t hit = -1;
  ASSERT_EQ(kdn_lookup(client_, t.data(), n, -1, &hit), KDN_OK);
  EXPECT_EQ(hit, 0);
  // Its first tokens are another document: a miss, as is another namespace.
  Buffers dst(KDN_F32, KDN_TOKEN_MAJOR, n);
  EXPECT_EQ(kdn_document_fetch(client_, t.data(), n - 1, &dst.layout), KDN_NOT_FOUND);
  EXPECT_TRUE(kdn_status_is_miss(KDN_NOT_FOUND));
  kdn_client_options o{};
  o.chunk_tokens = kChunk;
  o.ns = "tenant-2";
  kdn_client* client_ns = nullptr;
  ASSERT_EQ(kdn_client_open(store_->uri().c_str(), model_, &o, &client_ns), KDN_OK);
  ASSERT_EQ(kdn_document_held(client_ns, t.data(), n, &held), KDN_OK);
  EXPECT_EQ(held, 0);
  EXPECT_EQ(kdn_document_fetch(client_ns, t.data(), n, &dst.layout), KDN_NOT_FOUND);
  kdn_client_close(client_ns);
  // Bad arguments: no tokens, buffers shorter than the document.
  EXPECT_EQ(kdn_document_store(client_, t.data(), 0, &src.layout, nullptr), KDN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kdn_last_error()).find("at least one token"), std::string::npos);
  Buffers short_dst(KDN_F32, KDN_TOKEN_MAJOR, n - 1);
  EXPECT_EQ(kdn_document_fetch(client_, t.data(), n, &short_dst.layout), KDN_INVALID_ARGUMENT);
  EXPECT_EQ(kdn_document_held(client_, t.data(), n, nullptr), KDN_INVALID_ARGUMENT);
}

// Steering vectors and steered versions are kdn's to make (POST
// /v1/kdn/steering, /v1/kdn/edit; their hits are tests/client/test_hf.py's):
// here, the misses and the bad arguments.
TEST_F(ClientApiTest, SteeringVectorsAndSteeredVersionsTheKdnLacksAreMisses) {
  int64_t layers = -1;
  EXPECT_EQ(kdn_steering_vector_fetch(client_, "trust", 0, nullptr, nullptr, &layers),
            KDN_NOT_FOUND);
  EXPECT_EQ(layers, 0);
  EXPECT_NE(std::string(kdn_last_error()).find("trust"), std::string::npos) << kdn_last_error();
  int32_t layer_buf[2];
  EXPECT_EQ(kdn_steering_vector_fetch(client_, "trust", 2, layer_buf, nullptr, &layers),
            KDN_INVALID_ARGUMENT);
  EXPECT_EQ(kdn_steering_vector_fetch(client_, nullptr, 0, nullptr, nullptr, &layers),
            KDN_INVALID_ARGUMENT);
  EXPECT_EQ(kdn_steering_vector_fetch(client_, "trust", 0, nullptr, nullptr, nullptr),
            KDN_INVALID_ARGUMENT);

  // A document held whole is not its steered version.
  const int64_t n = 20;
  const auto t = Tokens(n, 6);
  Buffers src(KDN_F32, KDN_TOKEN_MAJOR, n);
  Fill(src, n);
  ASSERT_EQ(kdn_document_store(client_, t.data(), n, &src.layout, nullptr), KDN_OK);
  Buffers dst(KDN_F32, KDN_TOKEN_MAJOR, n);
  EXPECT_EQ(kdn_steered_document_fetch(client_, t.data(), n, "trust", 1.0f, &dst.layout),
            KDN_NOT_FOUND);
  EXPECT_EQ(kdn_steered_document_fetch(client_, t.data(), n, nullptr, 1.0f, &dst.layout),
            KDN_INVALID_ARGUMENT);
  EXPECT_EQ(kdn_steered_document_fetch(client_, t.data(), 0, "trust", 1.0f, &dst.layout),
            KDN_INVALID_ARGUMENT);
}

TEST_F(ClientApiTest, MissesForOtherPromptsModelsAndNamespaces) {
  const int64_t n = 2 * kChunk;
  const auto t = Tokens(n, 3);
  Buffers src(KDN_F32, KDN_TOKEN_MAJOR, n);
  Fill(src, n);
  ASSERT_EQ(kdn_store(client_, t.data(), n, &src.layout, nullptr), KDN_OK);
  int64_t hit = -1;
  ASSERT_EQ(kdn_lookup(client_, t.data(), n, -1, &hit), KDN_OK);
  EXPECT_EQ(hit, n);
  const auto other = Tokens(n, 4);
  ASSERT_EQ(kdn_lookup(client_, other.data(), n, -1, &hit), KDN_OK);
  EXPECT_EQ(hit, 0);

  kdn_model* model_b = nullptr;
  ASSERT_EQ(kdn_model_open(WriteModel(dir_ / "b", 'b').c_str(), KDN_F32, &model_b), KDN_OK);
  kdn_client_options o{};
  o.chunk_tokens = kChunk;
  kdn_client* client_b = nullptr;
  ASSERT_EQ(kdn_client_open(store_->uri().c_str(), model_b, &o, &client_b), KDN_OK);
  ASSERT_EQ(kdn_lookup(client_b, t.data(), n, -1, &hit), KDN_OK);
  EXPECT_EQ(hit, 0);
  Buffers dst(KDN_F32, KDN_TOKEN_MAJOR, n);
  int64_t fetched = -1;
  ASSERT_EQ(kdn_fetch(client_b, t.data(), n, -1, &dst.layout, &fetched), KDN_OK);
  EXPECT_EQ(fetched, 0);
  kdn_client_close(client_b);
  kdn_model_close(model_b);

  o.ns = "tenant-2";
  kdn_client* client_ns = nullptr;
  ASSERT_EQ(kdn_client_open(store_->uri().c_str(), model_, &o, &client_ns), KDN_OK);
  ASSERT_EQ(kdn_lookup(client_ns, t.data(), n, -1, &hit), KDN_OK);
  EXPECT_EQ(hit, 0);
  kdn_client_close(client_ns);
}

TEST_F(ClientApiTest, BadArgumentsAreCodesWithMessages) {
  const int64_t n = kChunk;
  const auto t = Tokens(n, 5);
  int64_t out = 0;
  kdn_model* m = nullptr;
  EXPECT_EQ(kdn_model_open(nullptr, KDN_F32, &m), KDN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kdn_last_error()), "");
  EXPECT_EQ(kdn_model_open((dir_ / "missing").c_str(), KDN_F32, &m), KDN_NOT_FOUND);
  EXPECT_EQ(m, nullptr);
  EXPECT_EQ(kdn_model_open((dir_ / "a").c_str(), 7, &m), KDN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kdn_last_error()).find("kdn_dtype"), std::string::npos);
  kdn_client* c = nullptr;
  EXPECT_EQ(kdn_client_open("http://x:1", model_, nullptr, &c), KDN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kdn_last_error()).find("redis://"), std::string::npos);
  EXPECT_EQ(kdn_lookup(client_, nullptr, n, -1, &out), KDN_INVALID_ARGUMENT);
  EXPECT_EQ(kdn_lookup(client_, t.data(), -1, -1, &out), KDN_INVALID_ARGUMENT);
  EXPECT_EQ(kdn_lookup(nullptr, t.data(), n, -1, &out), KDN_INVALID_ARGUMENT);
  EXPECT_EQ(kdn_spans(client_, t.data(), n, nullptr, 3, &out), KDN_INVALID_ARGUMENT);
  EXPECT_EQ(kdn_fetch(client_, t.data(), n, -1, nullptr, &out), KDN_INVALID_ARGUMENT);
  // A success clears the message.
  EXPECT_EQ(kdn_lookup(client_, t.data(), n, -1, &out), KDN_OK);
  EXPECT_STREQ(kdn_last_error(), "");

  // Short buffers: refused before anything is read or written.
  Buffers short_buf(KDN_F32, KDN_TOKEN_MAJOR, n - 1);
  EXPECT_EQ(kdn_store(client_, t.data(), n, &short_buf.layout, nullptr), KDN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kdn_last_error()).find("past the KV buffers"), std::string::npos)
      << kdn_last_error();
  EXPECT_EQ(kdn_fetch(client_, t.data(), n, -1, &short_buf.layout, &out), KDN_INVALID_ARGUMENT);
  // Layouts that do not fit the model.
  Buffers wrong(KDN_F32, KDN_TOKEN_MAJOR, n);
  wrong.layout.layers = kLayers + 1;
  EXPECT_EQ(kdn_store(client_, t.data(), n, &wrong.layout, nullptr), KDN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kdn_last_error()).find("the model's KV is 2 x 2 x 8"), std::string::npos)
      << kdn_last_error();
  Buffers null_layer(KDN_F32, KDN_TOKEN_MAJOR, n);
  null_layer.kp[1] = nullptr;
  EXPECT_EQ(kdn_fetch(client_, t.data(), n, -1, &null_layer.layout, &out), KDN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kdn_last_error()).find("null buffer"), std::string::npos);
  Buffers overlap(KDN_F32, KDN_TOKEN_MAJOR, n);
  overlap.layout.stride_head = kDim - 1;
  EXPECT_EQ(kdn_fetch(client_, t.data(), n, -1, &overlap.layout, &out), KDN_INVALID_ARGUMENT);
  Buffers paged(KDN_F32, KDN_TOKEN_MAJOR, n);
  ASSERT_EQ(kdn_layout_paged(&paged.layout, KDN_TOKEN_MAJOR, 4, n / 4), KDN_OK);
  std::vector<int32_t> table = {0, 1};  // 2 of the 4 blocks n tokens need
  paged.layout.block_table = table.data();
  paged.layout.block_table_len = 2;
  EXPECT_EQ(kdn_fetch(client_, t.data(), n, -1, &paged.layout, &out), KDN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kdn_last_error()).find("block table"), std::string::npos);
  EXPECT_EQ(kdn_layout_contiguous(&paged.layout, 5, n), KDN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kdn_last_error()).find("kdn_major"), std::string::npos);
  paged.layout.dtype = 9;
  EXPECT_EQ(kdn_fetch(client_, t.data(), n, -1, &paged.layout, &out), KDN_INVALID_ARGUMENT);
  EXPECT_STREQ(kdn_status_name(KDN_UNAVAILABLE), "UNAVAILABLE");
}

TEST_F(ClientApiTest, AnUnreachableStoreIsAMissNotAnError) {
  kdn_client_options o{};
  o.chunk_tokens = kChunk;
  kdn_client* c = nullptr;
  // Port 1 on loopback: nothing listens there.
  ASSERT_EQ(kdn_client_open("kdn-store://127.0.0.1:1", model_, &o, &c), KDN_OK);
  const auto t = Tokens(kChunk, 6);
  int64_t hit = -1;
  EXPECT_EQ(kdn_lookup(c, t.data(), kChunk, -1, &hit), KDN_OK);
  EXPECT_EQ(hit, 0);
  Buffers src(KDN_F32, KDN_TOKEN_MAJOR, kChunk);
  kdn_store_result r{};
  EXPECT_EQ(kdn_store(c, t.data(), kChunk, &src.layout, &r), KDN_UNAVAILABLE) << kdn_last_error();
  EXPECT_EQ(r.not_stored, 1);
  kdn_client_close(c);
}

TEST(ClientStatus, TheKdnsFailuresAreMissesTheCallersAreNot) {
  for (kdn_status st : {KDN_UNAVAILABLE, KDN_RESOURCE_EXHAUSTED, KDN_CORRUPTION, KDN_UNIMPLEMENTED,
                        KDN_NOT_FOUND, KDN_IO_ERROR, KDN_INTERNAL}) {
    EXPECT_EQ(kdn_status_is_miss(st), 1) << kdn_status_name(st);
  }
  for (kdn_status st : {KDN_OK, KDN_INVALID_ARGUMENT, KDN_FAILED_PRECONDITION}) {
    EXPECT_EQ(kdn_status_is_miss(st), 0) << kdn_status_name(st);
  }
}

TEST_F(ClientApiTest, ARedisPasswordComesFromAFileOrTheEnvironmentAndIsNeverShown) {
  const std::string secret = "s3cret-not-to-show";
  const fs::path file = dir_ / "redis.password";
  std::ofstream(file) << secret << "\n";
  kdn_client_options o{};
  o.chunk_tokens = kChunk;
  kdn_client* c = nullptr;
  // A file and a password in the URL both: refused, neither shown.
  o.redis_password_file = file.c_str();
  EXPECT_EQ(kdn_client_open(("redis://:" + secret + "@127.0.0.1:1").c_str(), model_, &o, &c),
            KDN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kdn_last_error()).find("not both"), std::string::npos) << kdn_last_error();
  EXPECT_EQ(std::string(kdn_last_error()).find(secret), std::string::npos) << kdn_last_error();
  // A file that is not there: named.
  const fs::path missing = dir_ / "no-such-file";
  o.redis_password_file = missing.c_str();
  EXPECT_EQ(kdn_client_open("redis://127.0.0.1:1", model_, &o, &c), KDN_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kdn_last_error()).find(missing.string()), std::string::npos);
  // From the file, the environment's file or the environment itself, to a
  // Redis that is not there: UNAVAILABLE, the password in no message.
  o.redis_password_file = file.c_str();
  EXPECT_EQ(kdn_client_open("redis://127.0.0.1:1", model_, &o, &c), KDN_UNAVAILABLE);
  EXPECT_EQ(std::string(kdn_last_error()).find(secret), std::string::npos) << kdn_last_error();
  o.redis_password_file = nullptr;
  setenv("KDN_REDIS_PASSWORD_FILE", missing.c_str(), 1);
  EXPECT_EQ(kdn_client_open("redis://127.0.0.1:1", model_, &o, &c), KDN_INVALID_ARGUMENT)
      << "the environment's file is read";
  unsetenv("KDN_REDIS_PASSWORD_FILE");
  setenv("KDN_REDIS_PASSWORD", secret.c_str(), 1);
  EXPECT_EQ(kdn_client_open("redis://127.0.0.1:1", model_, &o, &c), KDN_UNAVAILABLE);
  EXPECT_EQ(std::string(kdn_last_error()).find(secret), std::string::npos) << kdn_last_error();
  unsetenv("KDN_REDIS_PASSWORD");
  EXPECT_EQ(c, nullptr);
}

}  // namespace

extern "C" int kdn_client_header_is_c(void);
TEST(ClientHeader, CompilesAsC) { EXPECT_EQ(kdn_client_header_is_c(), 1); }
