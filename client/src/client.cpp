// libkdn_client: the C API of kdn/client.h over kvbus (keys, prefix I/O,
// the shared tiers, the KV layout) and kdn_fingerprint. Nothing here knows
// an engine. No exception leaves an API function: each is caught at the
// boundary and reported as a status with a message.

#include "kdn/client.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "kdn/kvbridge/fingerprint.h"
#include "kdn/kvbus/chunk.h"
#include "kdn/kvbus/codec.h"
#include "kdn/net/curve.h"
#include "kdn/kvbus/key.h"
#include "kdn/kvbus/kv_layout.h"
#include "kdn/kvbus/prefix_io.h"
#include "kdn/kvbus/redis_store.h"
#include "kdn/kvbus/shared_tier.h"
#include "kdn/kvbus/steering.h"
#include "kdn/model/config.h"

struct kdn_model {
  kdn::model::ModelConfig config;
  kdn::DType kv_dtype = kdn::DType::kF32;
  kdn::kvbus::ChunkKey fingerprint;
};

struct kdn_client {
  const kdn_model* model = nullptr;
  kdn::kvbus::KeyContext keys;
  std::unique_ptr<kdn::kvbus::ChunkStore> store;
};

namespace {

using kdn::Status;
using kdn::StatusCode;
namespace kvbus = kdn::kvbus;

thread_local std::string g_error;

kdn_status ToC(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return KDN_OK;
    case StatusCode::kInvalidArgument: return KDN_INVALID_ARGUMENT;
    case StatusCode::kNotFound: return KDN_NOT_FOUND;
    case StatusCode::kCorruption: return KDN_CORRUPTION;
    case StatusCode::kUnimplemented: return KDN_UNIMPLEMENTED;
    case StatusCode::kResourceExhausted: return KDN_RESOURCE_EXHAUSTED;
    case StatusCode::kFailedPrecondition: return KDN_FAILED_PRECONDITION;
    case StatusCode::kUnavailable:
    case StatusCode::kDeadlineExceeded: return KDN_UNAVAILABLE;
    case StatusCode::kIoError: return KDN_IO_ERROR;
    case StatusCode::kInternal: break;
  }
  return KDN_INTERNAL;
}

kdn_status Report(const Status& st) {
  g_error = st.ok() ? std::string() : st.message();
  return ToC(st.code());
}

// Runs `f` (returning a Status) with the thread's error cleared first and
// no exception let through.
// `url` with the password from `password_file`, else from the file
// KDN_REDIS_PASSWORD_FILE names, else KDN_REDIS_PASSWORD; the environment
// only for a URL without one.
kdn::Result<std::string> WithRedisPassword(const std::string& url, const char* password_file) {
  if (password_file != nullptr && *password_file != '\0') {
    return kvbus::RedisUrlWithPasswordFile(url, password_file);
  }
  KDN_ASSIGN_OR_RETURN(kvbus::RedisUrl parsed, kvbus::ParseRedisUrl(url));
  if (!parsed.password.empty()) return url;
  if (const char* file = std::getenv("KDN_REDIS_PASSWORD_FILE"); file != nullptr && *file) {
    return kvbus::RedisUrlWithPasswordFile(url, file);
  }
  if (const char* password = std::getenv("KDN_REDIS_PASSWORD"); password != nullptr && *password) {
    return kvbus::RedisUrlWithPassword(url, password);
  }
  return url;
}

template <typename F>
kdn_status Guard(F&& f) noexcept {
  try {
    g_error.clear();
    return Report(f());
  } catch (const std::bad_alloc&) {
    g_error = "out of memory";
    return KDN_RESOURCE_EXHAUSTED;
  } catch (const std::exception& e) {
    g_error = e.what();
    return KDN_INTERNAL;
  } catch (...) {
    g_error = "unknown error";
    return KDN_INTERNAL;
  }
}

// kdn_dtype mirrors kdn::DType (kdn/common/dtype.h) value for value.
static_assert(KDN_F32 == static_cast<int>(kdn::DType::kF32));
static_assert(KDN_F16 == static_cast<int>(kdn::DType::kF16));
static_assert(KDN_BF16 == static_cast<int>(kdn::DType::kBF16));

Status CheckDType(int d, const char* what) {
  if (!kdn::DTypeFromValue(d)) {
    return kdn::InvalidArgument(std::string(what) + " is " + std::to_string(d) +
                                "; kdn_dtype is KDN_F32, KDN_F16 or KDN_BF16");
  }
  return Status::Ok();
}

Status CheckMajor(int32_t m) {
  if (m != KDN_TOKEN_MAJOR && m != KDN_HEAD_MAJOR) {
    return kdn::InvalidArgument("major is " + std::to_string(m) +
                                "; kdn_major is KDN_TOKEN_MAJOR or KDN_HEAD_MAJOR");
  }
  return Status::Ok();
}

Status CheckTokensArg(const int32_t* tokens, int64_t n) {
  if (n < 0) return kdn::InvalidArgument("a negative token count");
  if (n > 0 && tokens == nullptr) return kdn::InvalidArgument("tokens is null");
  return Status::Ok();
}

// A document: at least one token, and at most a chunk's token count.
Status CheckDocumentArg(const int32_t* tokens, int64_t n) {
  KDN_RETURN_IF_ERROR(CheckTokensArg(tokens, n));
  if (n == 0) return kdn::InvalidArgument("a document has at least one token");
  if (n > INT32_MAX) return kdn::InvalidArgument("a document of more than 2^31 tokens");
  return Status::Ok();
}

int64_t Limit(int64_t limit, int64_t n) { return limit < 0 || limit > n ? n : limit; }

// How far a fetch of at most `limit` tokens looks: to the end of the chunk
// `limit` falls in (its KV is a prefix of that chunk's), the prompt's end
// at most.
int64_t Reach(int64_t limit, int64_t n, int64_t chunk_tokens) {
  return std::min(n, (limit + chunk_tokens - 1) / chunk_tokens * chunk_tokens);
}

// The C layout as kvbus's, checked against the client's model.
kdn::Result<kvbus::KvLayout> ToLayout(const kdn_client* c, const kdn_kv_layout* in) {
  if (in == nullptr) return kdn::InvalidArgument("the KV layout is null");
  KDN_RETURN_IF_ERROR(CheckDType(in->dtype, "the KV layout's dtype"));
  if (in->k == nullptr || in->v == nullptr) {
    return kdn::InvalidArgument("the KV layout's k or v array is null");
  }
  if (in->layers < 0 || in->kv_heads <= 0 || in->head_dim <= 0) {
    return kdn::InvalidArgument("the KV layout's shape is not set");
  }
  if (in->block_tokens > 0 && in->block_table == nullptr) {
    return kdn::InvalidArgument("a paged KV layout needs a block table");
  }
  kvbus::KvLayout l;
  l.dtype = static_cast<kdn::DType>(in->dtype);
  l.layers = in->layers;
  l.kv_heads = in->kv_heads;
  l.head_dim = in->head_dim;
  // The shape first: the base arrays are read for the model's layer count
  // only.
  const kdn::model::ModelConfig& m = c->model->config;
  KDN_RETURN_IF_ERROR(kvbus::CheckLayoutShape(l, m.num_layers, m.num_kv_heads, m.head_dim));
  for (int i = 0; i < in->layers; ++i) {
    l.k.push_back(static_cast<uint8_t*>(in->k[i]));
    l.v.push_back(static_cast<uint8_t*>(in->v[i]));
  }
  l.buffer_bytes = in->buffer_bytes;
  l.stride_token = in->stride_token;
  l.stride_head = in->stride_head;
  l.block_tokens = in->block_tokens;
  l.stride_block = in->stride_block;
  if (in->block_tokens > 0) {
    l.block_table = {in->block_table,
                     static_cast<size_t>(std::max<int64_t>(in->block_table_len, 0))};
  }
  KDN_RETURN_IF_ERROR(kvbus::CheckLayout(l, m.num_layers, m.num_kv_heads, m.head_dim));
  return l;
}

// Writes the whole document KV under `key` (n tokens) into `dst`; a miss
// when it is absent, pruned, damaged or of another model.
Status FetchDocumentUnder(kdn_client* client, const kvbus::ChunkKey& key, int64_t n,
                          const kdn_kv_layout* dst) {
  KDN_ASSIGN_OR_RETURN(kvbus::KvLayout layout, ToLayout(client, dst));
  KDN_RETURN_IF_ERROR(kvbus::CheckTokens(layout, 0, n));
  auto chunk = client->store->Get(key);
  if (!chunk.ok()) {
    return chunk.status().code() == StatusCode::kNotFound
               ? kdn::NotFound("the KDN does not hold document " + key.ToHex())
               : chunk.status();
  }
  const kdn_model& m = *client->model;
  if (!kvbus::ChunkFits(**chunk, m.fingerprint, n, m.kv_dtype) || (*chunk)->info().position != 0) {
    return kdn::NotFound("document " + key.ToHex() + ": " +
                         ((*chunk)->info().pruned()
                              ? std::string("the KDN holds it pruned, with no whole KV")
                              : std::string("the stored chunk is not this model's KV of ") +
                                    std::to_string(n) + " tokens"));
  }
  return kvbus::ChunkToLayout(**chunk, 0, layout, n);
}

}  // namespace

extern "C" {

int kdn_api_version(void) { return KDN_CLIENT_API_VERSION; }

const char* kdn_last_error(void) { return g_error.c_str(); }

const char* kdn_status_name(kdn_status status) {
  switch (status) {
    case KDN_OK: return "OK";
    case KDN_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case KDN_NOT_FOUND: return "NOT_FOUND";
    case KDN_CORRUPTION: return "CORRUPTION";
    case KDN_UNIMPLEMENTED: return "UNIMPLEMENTED";
    case KDN_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case KDN_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case KDN_UNAVAILABLE: return "UNAVAILABLE";
    case KDN_INTERNAL: return "INTERNAL";
    case KDN_IO_ERROR: return "IO_ERROR";
  }
  return "UNKNOWN";
}

int kdn_status_is_miss(kdn_status status) {
  switch (status) {
    case KDN_UNAVAILABLE:
    case KDN_RESOURCE_EXHAUSTED:
    case KDN_CORRUPTION:
    case KDN_UNIMPLEMENTED:
    case KDN_NOT_FOUND:
    case KDN_IO_ERROR:
    case KDN_INTERNAL: return 1;
    case KDN_OK:
    case KDN_INVALID_ARGUMENT:
    case KDN_FAILED_PRECONDITION: break;
  }
  return 0;
}

kdn_status kdn_model_open(const char* path, int32_t kv_dtype, kdn_model** out) {
  return Guard([&]() -> Status {
    if (path == nullptr || out == nullptr) return kdn::InvalidArgument("path or out is null");
    *out = nullptr;
    KDN_RETURN_IF_ERROR(CheckDType(kv_dtype, "kv_dtype"));
    auto m = std::make_unique<kdn_model>();
    KDN_ASSIGN_OR_RETURN(m->config, kdn::model::LoadModelConfig(path));
    m->kv_dtype = static_cast<kdn::DType>(kv_dtype);
    KDN_ASSIGN_OR_RETURN(m->fingerprint,
                         kdn::kvbridge::FolderFingerprint(path, m->config, m->kv_dtype));
    *out = m.release();
    return Status::Ok();
  });
}

void kdn_model_close(kdn_model* model) { delete model; }

kdn_status kdn_model_get_info(const kdn_model* model, kdn_model_info* out) {
  return Guard([&]() -> Status {
    if (model == nullptr || out == nullptr) return kdn::InvalidArgument("model or out is null");
    out->layers = model->config.num_layers;
    out->kv_heads = model->config.num_kv_heads;
    out->head_dim = model->config.head_dim;
    out->kv_dtype = static_cast<int32_t>(model->kv_dtype);
    const std::string hex = model->fingerprint.ToHex();
    std::memcpy(out->fingerprint, hex.c_str(), hex.size() + 1);
    return Status::Ok();
  });
}

kdn_status kdn_client_open(const char* uri, const kdn_model* model,
                           const kdn_client_options* options, kdn_client** out) {
  return Guard([&]() -> Status {
    if (uri == nullptr || model == nullptr || out == nullptr) {
      return kdn::InvalidArgument("uri, model or out is null");
    }
    *out = nullptr;
    const kdn_client_options o = options != nullptr ? *options : kdn_client_options{};
    if (o.chunk_tokens < 0 || o.redis_ttl_ms < 0) {
      return kdn::InvalidArgument("chunk_tokens and redis_ttl_ms may not be negative");
    }
    auto c = std::make_unique<kdn_client>();
    c->model = model;
    c->keys.model_fingerprint = model->fingerprint;
    c->keys.ns = o.ns != nullptr ? o.ns : "";
    c->keys.chunk_tokens = o.chunk_tokens > 0 ? o.chunk_tokens : kvbus::kDefaultChunkTokens;
    kvbus::SharedTierOptions shared;
    shared.model = model->fingerprint;
    shared.ttl = std::chrono::milliseconds(o.redis_ttl_ms);
    std::string u = uri;
    if (u.starts_with("redis://")) {
      KDN_ASSIGN_OR_RETURN(u, WithRedisPassword(u, o.redis_password_file));
    } else {
      KDN_ASSIGN_OR_RETURN(
          shared.curve,
          kdn::net::CurveKeysFromFlagOrEnv(o.curve_keys_path != nullptr ? o.curve_keys_path : ""));
    }
    KDN_ASSIGN_OR_RETURN(auto tier, kvbus::OpenSharedTier(u, shared));
    // What kdn's workers stored coded is decoded on the way out; what this
    // client stores goes raw.
    c->store = std::make_unique<kvbus::CodecTier>(std::move(tier), kvbus::CodecTierOptions{});
    *out = c.release();
    return Status::Ok();
  });
}

void kdn_client_close(kdn_client* client) { delete client; }

kdn_status kdn_spans(const kdn_client* client, const int32_t* tokens, int64_t n, kdn_span* out,
                     int64_t capacity, int64_t* count) {
  return Guard([&]() -> Status {
    if (client == nullptr || count == nullptr)
      return kdn::InvalidArgument("client or count is null");
    KDN_RETURN_IF_ERROR(CheckTokensArg(tokens, n));
    if (capacity < 0 || (capacity > 0 && out == nullptr)) {
      return kdn::InvalidArgument("out is null or capacity negative");
    }
    const std::span<const int32_t> t(tokens, static_cast<size_t>(n));
    const auto prefix = kvbus::PrefixKeys(client->keys, t);
    const auto spans = kvbus::StoredSpans(client->keys, t, prefix);
    *count = static_cast<int64_t>(spans.size());
    for (size_t i = 0; i < spans.size() && static_cast<int64_t>(i) < capacity; ++i) {
      spans[i].key.ToBytes(out[i].key);
      out[i].first = spans[i].first;
      out[i].count = spans[i].count;
    }
    return Status::Ok();
  });
}

kdn_status kdn_layout_contiguous(kdn_kv_layout* layout, int32_t major, int64_t capacity) {
  return Guard([&]() -> Status {
    if (layout == nullptr) return kdn::InvalidArgument("layout is null");
    KDN_RETURN_IF_ERROR(CheckDType(layout->dtype, "the KV layout's dtype"));
    KDN_RETURN_IF_ERROR(CheckMajor(major));
    if (capacity < 0 || layout->kv_heads <= 0 || layout->head_dim <= 0) {
      return kdn::InvalidArgument("a negative capacity, or the layout's shape is not set");
    }
    const int64_t H = layout->kv_heads, D = layout->head_dim;
    layout->block_tokens = 0;
    layout->stride_block = 0;
    layout->stride_token = major == KDN_HEAD_MAJOR ? D : H * D;
    layout->stride_head = major == KDN_HEAD_MAJOR ? capacity * D : D;
    layout->buffer_bytes =
        static_cast<uint64_t>(capacity * H * D) *
        static_cast<uint64_t>(kdn::DTypeSize(static_cast<kdn::DType>(layout->dtype)));
    return Status::Ok();
  });
}

kdn_status kdn_layout_paged(kdn_kv_layout* layout, int32_t major, int32_t block_tokens,
                            int64_t num_blocks) {
  return Guard([&]() -> Status {
    if (layout == nullptr) return kdn::InvalidArgument("layout is null");
    KDN_RETURN_IF_ERROR(CheckDType(layout->dtype, "the KV layout's dtype"));
    KDN_RETURN_IF_ERROR(CheckMajor(major));
    if (block_tokens <= 0 || num_blocks < 0 || layout->kv_heads <= 0 || layout->head_dim <= 0) {
      return kdn::InvalidArgument(
          "block_tokens must be positive, num_blocks not negative, and "
          "the layout's shape set");
    }
    const int64_t H = layout->kv_heads, D = layout->head_dim;
    layout->block_tokens = block_tokens;
    layout->stride_block = int64_t{block_tokens} * H * D;
    layout->stride_token = major == KDN_HEAD_MAJOR ? D : H * D;
    layout->stride_head = major == KDN_HEAD_MAJOR ? int64_t{block_tokens} * D : D;
    layout->buffer_bytes =
        static_cast<uint64_t>(num_blocks * layout->stride_block) *
        static_cast<uint64_t>(kdn::DTypeSize(static_cast<kdn::DType>(layout->dtype)));
    return Status::Ok();
  });
}

kdn_status kdn_lookup(kdn_client* client, const int32_t* tokens, int64_t n, int64_t limit,
                      int64_t* hit_tokens) {
  return Guard([&]() -> Status {
    if (client == nullptr || hit_tokens == nullptr) {
      return kdn::InvalidArgument("client or hit_tokens is null");
    }
    KDN_RETURN_IF_ERROR(CheckTokensArg(tokens, n));
    const std::span<const int32_t> t(tokens, static_cast<size_t>(n));
    const auto prefix = kvbus::PrefixKeys(client->keys, t);
    const int64_t lim = Limit(limit, n);
    *hit_tokens = std::min(lim, kvbus::StoredPrefixTokens(*client->store, client->keys, t, prefix,
                                                          Reach(lim, n, client->keys.chunk_tokens),
                                                          kvbus::kMinTailTokens, 0));
    return Status::Ok();
  });
}

kdn_status kdn_fetch(kdn_client* client, const int32_t* tokens, int64_t n, int64_t limit,
                     const kdn_kv_layout* dst, int64_t* fetched) {
  return Guard([&]() -> Status {
    if (client == nullptr || fetched == nullptr) {
      return kdn::InvalidArgument("client or fetched is null");
    }
    *fetched = 0;
    KDN_RETURN_IF_ERROR(CheckTokensArg(tokens, n));
    KDN_ASSIGN_OR_RETURN(kvbus::KvLayout layout, ToLayout(client, dst));
    const int64_t lim = Limit(limit, n);
    KDN_RETURN_IF_ERROR(kvbus::CheckTokens(layout, 0, lim));
    const std::span<const int32_t> t(tokens, static_cast<size_t>(n));
    const auto prefix = kvbus::PrefixKeys(client->keys, t);
    const auto spans = kvbus::FetchPrefix(*client->store, client->keys, t, prefix,
                                          Reach(lim, n, client->keys.chunk_tokens),
                                          kvbus::kMinTailTokens, 0, client->model->kv_dtype);
    for (const auto& [span, chunk] : spans) {
      if (span.first >= lim) break;
      const int64_t count = std::min(span.count, lim - span.first);
      KDN_RETURN_IF_ERROR(kvbus::ChunkToLayout(*chunk, span.first, layout, count));
      *fetched = span.first + count;
    }
    return Status::Ok();
  });
}

kdn_status kdn_store(kdn_client* client, const int32_t* tokens, int64_t n, const kdn_kv_layout* src,
                     kdn_store_result* out) {
  return Guard([&]() -> Status {
    if (client == nullptr) return kdn::InvalidArgument("client is null");
    if (out != nullptr) *out = {};
    KDN_RETURN_IF_ERROR(CheckTokensArg(tokens, n));
    KDN_ASSIGN_OR_RETURN(kvbus::KvLayout layout, ToLayout(client, src));
    KDN_RETURN_IF_ERROR(kvbus::CheckTokens(layout, 0, n));
    const std::span<const int32_t> t(tokens, static_cast<size_t>(n));
    const auto prefix = kvbus::PrefixKeys(client->keys, t);
    const auto spans = kvbus::StoredSpans(client->keys, t, prefix);
    std::vector<kvbus::ChunkKey> keys;
    for (const auto& s : spans) keys.push_back(s.key);
    // Chunks are built only for the spans the KDN lacks.
    const std::vector<bool> held = client->store->ContainsMany(keys);
    std::vector<std::shared_ptr<const kvbus::Chunk>> missing;
    int64_t already = 0;
    for (size_t i = 0; i < spans.size(); ++i) {
      if (held[i]) {
        ++already;
        continue;
      }
      const kvbus::KeyedSpan& s = spans[i];
      kvbus::ChunkInfo info;
      info.key = s.key;
      info.model_fingerprint = client->model->fingerprint;
      info.layers = static_cast<uint32_t>(layout.layers);
      info.kv_heads = static_cast<uint32_t>(layout.kv_heads);
      info.head_dim = static_cast<uint32_t>(layout.head_dim);
      info.tokens = static_cast<uint32_t>(s.count);
      info.dtype = client->model->kv_dtype;
      info.position = s.first;
      KDN_ASSIGN_OR_RETURN(auto chunk, kvbus::Chunk::Build(info, [&](uint8_t* payload) {
                             kvbus::LayoutToPayload(layout, s.first, s.count, info.dtype, payload);
                           }));
      missing.push_back(std::move(chunk));
    }
    const kvbus::PutOutcome put = kvbus::PutMissing(*client->store, missing);
    if (out != nullptr) {
      out->stored = static_cast<int64_t>(put.stored);
      out->already_held = already + static_cast<int64_t>(put.already_held);
      out->not_stored = static_cast<int64_t>(put.not_stored);
    }
    return put.error;
  });
}

kdn_status kdn_document_held(kdn_client* client, const int32_t* tokens, int64_t n, int* held) {
  return Guard([&]() -> Status {
    if (client == nullptr || held == nullptr) return kdn::InvalidArgument("client or held is null");
    *held = 0;
    KDN_RETURN_IF_ERROR(CheckDocumentArg(tokens, n));
    const std::span<const int32_t> t(tokens, static_cast<size_t>(n));
    *held = client->store->Contains(kvbus::SegmentKey(client->keys, t)) ? 1 : 0;
    return Status::Ok();
  });
}

kdn_status kdn_document_fetch(kdn_client* client, const int32_t* tokens, int64_t n,
                              const kdn_kv_layout* dst) {
  return Guard([&]() -> Status {
    if (client == nullptr) return kdn::InvalidArgument("client is null");
    KDN_RETURN_IF_ERROR(CheckDocumentArg(tokens, n));
    const std::span<const int32_t> t(tokens, static_cast<size_t>(n));
    return FetchDocumentUnder(client, kvbus::SegmentKey(client->keys, t), n, dst);
  });
}

kdn_status kdn_steered_document_fetch(kdn_client* client, const int32_t* tokens, int64_t n,
                                      const char* vector, float strength,
                                      const kdn_kv_layout* dst) {
  return Guard([&]() -> Status {
    if (client == nullptr || vector == nullptr) {
      return kdn::InvalidArgument("client or vector is null");
    }
    KDN_RETURN_IF_ERROR(CheckDocumentArg(tokens, n));
    const std::span<const int32_t> t(tokens, static_cast<size_t>(n));
    // The version's key is made of the vector's id: the vector first.
    auto chunk = client->store->Get(kvbus::SteeringVectorKey(client->keys, vector));
    if (!chunk.ok() || !(*chunk)->info().is_steering()) {
      return !chunk.ok() && chunk.status().code() != StatusCode::kNotFound
                 ? chunk.status()
                 : kdn::NotFound(std::string("the KDN holds no steering vector '") + vector + "'");
    }
    const kvbus::ChunkKey key = kvbus::SteeredKey(kvbus::SegmentKey(client->keys, t),
                                                  kvbus::SteeringVectorId(**chunk), strength);
    return FetchDocumentUnder(client, key, n, dst);
  });
}

kdn_status kdn_steering_vector_fetch(kdn_client* client, const char* name, int64_t capacity,
                                     int32_t* layers, float* values, int64_t* n_layers) {
  return Guard([&]() -> Status {
    if (client == nullptr || name == nullptr || n_layers == nullptr) {
      return kdn::InvalidArgument("client, name or n_layers is null");
    }
    *n_layers = 0;
    if (capacity < 0 || (capacity > 0 && (layers == nullptr || values == nullptr))) {
      return kdn::InvalidArgument("a capacity of layers needs its layers and values buffers");
    }
    const kvbus::ChunkKey key = kvbus::SteeringVectorKey(client->keys, name);
    auto chunk = client->store->Get(key);
    if (!chunk.ok()) {
      return chunk.status().code() == StatusCode::kNotFound
                 ? kdn::NotFound(std::string("the KDN holds no steering vector '") + name + "'")
                 : chunk.status();
    }
    const kdn::model::ModelConfig& m = client->model->config;
    const kvbus::ChunkInfo& info = (*chunk)->info();
    if (info.model_fingerprint != client->model->fingerprint ||
        static_cast<int>(info.layers) != m.num_layers ||
        static_cast<int>(info.kv_heads) != m.num_kv_heads ||
        static_cast<int>(info.head_dim) != m.head_dim) {
      return kdn::NotFound(std::string("steering vector '") + name + "' is not this model's");
    }
    KDN_ASSIGN_OR_RETURN(kvbus::SteeringVector v, kvbus::SteeringFromChunk(**chunk));
    *n_layers = static_cast<int64_t>(v.layers.size());
    if (capacity < *n_layers) return Status::Ok();
    std::copy(v.layers.begin(), v.layers.end(), layers);
    std::copy(v.values.begin(), v.values.end(), values);
    return Status::Ok();
  });
}

kdn_status kdn_document_store(kdn_client* client, const int32_t* tokens, int64_t n,
                              const kdn_kv_layout* src, int* already_held) {
  return Guard([&]() -> Status {
    if (client == nullptr) return kdn::InvalidArgument("client is null");
    if (already_held != nullptr) *already_held = 0;
    KDN_RETURN_IF_ERROR(CheckDocumentArg(tokens, n));
    KDN_ASSIGN_OR_RETURN(kvbus::KvLayout layout, ToLayout(client, src));
    KDN_RETURN_IF_ERROR(kvbus::CheckTokens(layout, 0, n));
    const std::span<const int32_t> t(tokens, static_cast<size_t>(n));
    kvbus::ChunkInfo info;
    info.key = kvbus::SegmentKey(client->keys, t);
    if (client->store->Contains(info.key)) {
      if (already_held != nullptr) *already_held = 1;
      return Status::Ok();
    }
    info.model_fingerprint = client->model->fingerprint;
    info.layers = static_cast<uint32_t>(layout.layers);
    info.kv_heads = static_cast<uint32_t>(layout.kv_heads);
    info.head_dim = static_cast<uint32_t>(layout.head_dim);
    info.tokens = static_cast<uint32_t>(n);
    info.dtype = client->model->kv_dtype;
    info.position = 0;
    KDN_ASSIGN_OR_RETURN(auto chunk, kvbus::Chunk::Build(info, [&](uint8_t* payload) {
                           kvbus::LayoutToPayload(layout, 0, n, info.dtype, payload);
                         }));
    const std::vector<std::shared_ptr<const kvbus::Chunk>> one{std::move(chunk)};
    const kvbus::PutOutcome put = kvbus::PutMissing(*client->store, one);
    if (already_held != nullptr && put.already_held > 0) *already_held = 1;
    return put.error;
  });
}

}  // extern "C"
