/* libkdn_client: kdn's KDN for any engine (docs/clients.md).
 *
 * An engine that is not kdn stores the KV of a token sequence in a KDN and
 * fetches the KV of a sequence's longest stored prefix, under the same
 * content addresses kdn's own workers use: a chunk one stores, the other
 * finds, when both run the same model files with the same KV dtype.
 *
 * A stable C ABI: plain structs and functions, no exceptions across it.
 * Every function that can fail returns a kdn_status; on failure the
 * calling thread's kdn_last_error() says what went wrong. Handles are
 * thread-safe: several threads may call into one kdn_client at once.
 */
#ifndef KDN_CLIENT_H_
#define KDN_CLIENT_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define KDN_API __attribute__((visibility("default")))
#else
#define KDN_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped when a struct or a function's meaning changes, or functions are
 * added (2: the Redis password file and kdn_status_is_miss; 3: documents;
 * 4: steering). The library's soname changes only when an earlier
 * version's calls would break: libkdn_client.so.2 serves versions 2 to 4. */
#define KDN_CLIENT_API_VERSION 4
KDN_API int kdn_api_version(void);

typedef enum kdn_status {
  KDN_OK = 0,
  KDN_INVALID_ARGUMENT = 1,    /* a null or short buffer, a layout that does not fit the model */
  KDN_NOT_FOUND = 2,           /* a model file that is not there */
  KDN_CORRUPTION = 3,          /* a model file that cannot be read as one */
  KDN_UNIMPLEMENTED = 4,       /* a model kdn cannot fingerprint (unknown architecture) */
  KDN_RESOURCE_EXHAUSTED = 5,  /* the store is full */
  KDN_FAILED_PRECONDITION = 6, /* a key file others may read */
  KDN_UNAVAILABLE = 7,         /* the KDN cannot be reached */
  KDN_INTERNAL = 8,
  KDN_IO_ERROR = 9
} kdn_status;

/* The message of the last call on this thread that failed ("" if none);
 * valid until this thread's next call into the library. */
KDN_API const char* kdn_last_error(void);
/* "INVALID_ARGUMENT" for KDN_INVALID_ARGUMENT, and so on. */
KDN_API const char* kdn_status_name(kdn_status status);
/* Nonzero when a failed kdn_lookup, kdn_fetch or kdn_store with this status
 * is the KDN's failure, not the caller's: the KDN unreachable or too slow
 * (UNAVAILABLE), full (RESOURCE_EXHAUSTED), or answering with what cannot
 * be read (CORRUPTION, UNIMPLEMENTED, NOT_FOUND, IO_ERROR, INTERNAL). An
 * engine takes such a lookup or fetch as a miss (0 tokens) and such a store
 * as nothing stored, and goes on: no KDN failure needs to fail a request.
 * Zero for KDN_OK and for the caller's errors (INVALID_ARGUMENT: a null or
 * short buffer, a layout that does not fit the model; FAILED_PRECONDITION). */
KDN_API int kdn_status_is_miss(kdn_status status);

/* Enums cross the ABI as int32_t (their size is the compiler's in C); a
 * value outside an enum is refused with KDN_INVALID_ARGUMENT. */
typedef enum kdn_dtype { KDN_F32 = 0, KDN_F16 = 1, KDN_BF16 = 2 } kdn_dtype;

/* ---- The model: what every key covers. ---- */

typedef struct kdn_model kdn_model;

/* Reads a model's files (a GGUF file, or a Hugging Face folder with
 * config.json and safetensors) and computes the fingerprint kdn's workers
 * compute for them, for KV kept as `kv_dtype` (what the engine's KV cache
 * holds: kdn's CPU worker keeps f32). Reads every weight byte once (the
 * digest): about a second per 10 GB. */
KDN_API kdn_status kdn_model_open(const char* path, int32_t kv_dtype, kdn_model** out);
KDN_API void kdn_model_close(kdn_model* model);

typedef struct kdn_model_info {
  int32_t layers;
  int32_t kv_heads;
  int32_t head_dim;
  int32_t kv_dtype;     /* a kdn_dtype */
  char fingerprint[33]; /* 32 hex digits and a NUL */
} kdn_model_info;
KDN_API kdn_status kdn_model_get_info(const kdn_model* model, kdn_model_info* out);

/* ---- A connection to a KDN. ---- */

typedef struct kdn_client kdn_client;

typedef struct kdn_client_options {
  /* kdn-store: a CURVE key file (kdn-keygen's members' file; the run
   * folder's keys of a kdn-launch deployment). NULL: the file
   * KDN_CURVE_KEYS names, else a plaintext connection. */
  const char* curve_keys_path;
  /* The tenant's namespace (a deployment's requests' cache salt); NULL or
   * "" for the default. */
  const char* ns;
  /* Tokens per chunk; 0 for kdn's default (256). Must equal the
   * deployment's --chunk-tokens for keys to meet. */
  int32_t chunk_tokens;
  /* Redis: expiry of what is stored, in milliseconds (0: none). */
  int64_t redis_ttl_ms;
  /* Redis: a file whose first line is the password, for a URL that has
   * none (so that no command line, config or log shows it). NULL: the
   * file KDN_REDIS_PASSWORD_FILE names, else the password in
   * KDN_REDIS_PASSWORD, else none. A password in the URL and this file
   * both is INVALID_ARGUMENT; the environment is read only for a URL
   * without one. */
  const char* redis_password_file;
} kdn_client_options;

/* Connects to the KDN at `uri` for `model`'s KV:
 *   kdn-store://host:port          a kdn-store
 *   redis://[user:pass@]host:port  a Redis Cluster or standalone Redis
 * `options` may be NULL. The model must outlive the client. A KDN that
 * cannot be reached at open is KDN_UNAVAILABLE (a configuration to fix, not
 * a miss). No message of the library holds a URL's password. */
KDN_API kdn_status kdn_client_open(const char* uri, const kdn_model* model,
                                   const kdn_client_options* options, kdn_client** out);
KDN_API void kdn_client_close(kdn_client* client);

/* ---- Keys. ---- */

typedef struct kdn_span {
  uint8_t key[16]; /* the 16 canonical bytes (big-endian hi, then lo) */
  int64_t first;   /* first token */
  int64_t count;   /* tokens */
} kdn_span;

/* The spans of `tokens` as they are stored (docs/kvbus.md): its full chunks
 * under their prefix keys, then its tail's pieces. Writes at most
 * `capacity` spans to `out` (which may be NULL when capacity is 0) and
 * their total to *count: call with capacity 0 to size the array. */
KDN_API kdn_status kdn_spans(const kdn_client* client, const int32_t* tokens, int64_t n,
                             kdn_span* out, int64_t capacity, int64_t* count);

/* ---- KV buffers: the layout descriptor. ---- */

/* Token t, KV head h, element d of layer l's K is the element at
 *   k[l] + block(t) * stride_block + (t % block_tokens) * stride_token
 *        + h * stride_head + d
 * (V likewise from v[l]), counted in elements of `dtype`; block(t) is
 * block_table[t / block_tokens] for a paged layout and 0 for a contiguous
 * one (block_tokens 0, where the token term is t * stride_token). K and V
 * in one buffer, or concatenated along the last dimension, are two bases
 * into it. kdn_layout_contiguous and kdn_layout_paged fill the strides of
 * the common layouts. */
typedef struct kdn_kv_layout {
  int32_t dtype; /* a kdn_dtype */
  int32_t layers;
  int32_t kv_heads;
  int32_t head_dim;
  void* const* k;        /* layers bases */
  void* const* v;        /* layers bases */
  uint64_t buffer_bytes; /* bytes each base may be accessed from */
  int64_t stride_token;
  int64_t stride_head;
  int32_t block_tokens; /* 0: contiguous */
  int64_t stride_block;
  const int32_t* block_table;
  int64_t block_table_len;
} kdn_kv_layout;

typedef enum kdn_major {
  KDN_TOKEN_MAJOR = 0, /* [tokens][kv_heads][head_dim] (kdn's chunks, vLLM's flash layout) */
  KDN_HEAD_MAJOR = 1   /* [kv_heads][tokens][head_dim] (transformers' caches) */
} kdn_major;

/* Sets a layout's strides, block_tokens and buffer_bytes for contiguous
 * buffers of `capacity` tokens each (its dtype and shape must be set). */
KDN_API kdn_status kdn_layout_contiguous(kdn_kv_layout* layout, int32_t major, int64_t capacity);
/* The same for paged buffers of `num_blocks` blocks of `block_tokens`
 * tokens, each block ordered as `major` says (block_table is the caller's
 * to set). */
KDN_API kdn_status kdn_layout_paged(kdn_kv_layout* layout, int32_t major, int32_t block_tokens,
                                    int64_t num_blocks);

/* ---- Lookup, fetch, store. ---- */

/* Failures of the three calls below for which kdn_status_is_miss is true
 * are the KDN's; take them as a miss or as nothing stored. */

/* The length of the longest prefix of `tokens` whose KV the KDN holds for
 * this model, at most `limit` tokens (negative: n): full chunks, then tail
 * pieces if they cover at least 16 tokens, cut at `limit` (a chunk across
 * it gives its first tokens: an engine that must compute the prompt's
 * last token asks for n - 1 and gets them even when the prompt ends on a
 * chunk's end). Exactly what a fetch would bring, unless the KDN changes
 * in between. Nothing is read. */
KDN_API kdn_status kdn_lookup(kdn_client* client, const int32_t* tokens, int64_t n, int64_t limit,
                              int64_t* hit_tokens);

/* Writes the KV of the longest stored prefix of `tokens` (at most `limit`
 * tokens; negative: n) into tokens [0, *fetched) of `dst`, and sets
 * *fetched. A chunk that is missing, damaged or of another model ends the
 * prefix (a miss, never wrong KV). A layout that does not fit the model,
 * or buffers too short for `limit` tokens, is refused before anything is
 * read. */
KDN_API kdn_status kdn_fetch(kdn_client* client, const int32_t* tokens, int64_t n, int64_t limit,
                             const kdn_kv_layout* dst, int64_t* fetched);

typedef struct kdn_store_result {
  int64_t stored;       /* spans put */
  int64_t already_held; /* spans the KDN held */
  int64_t not_stored;   /* after a failed put: that span and the rest */
} kdn_store_result;

/* Stores the KV of `tokens` (all n of them, KV at tokens [0, n) of `src`)
 * as its spans (kdn_spans), each span the KDN lacks. `out` may be NULL. A
 * failed put ends it, with its error. */
KDN_API kdn_status kdn_store(kdn_client* client, const int32_t* tokens, int64_t n,
                             const kdn_kv_layout* src, kdn_store_result* out);

/* ---- Documents (docs/clients.md, "Documents"). ---- */

/* A document's KV is computed on its own, from position 0, and stored
 * whole under its segment key: what kdn's prefill workers store for an
 * injected document and fuse when a request's prompt holds it (CacheBlend).
 * A document with an erratum (docs/serving.md, "Editing a document") is the
 * tokens of both: an engine edits a document by fetching its KV, computing
 * the erratum's tokens on top of it, and storing the whole as a document. */

/* *held: 1 when the KDN holds KV under the document's key (whole, or pruned
 * by kdn: such KV cannot be fetched), else 0. Nothing is read. */
KDN_API kdn_status kdn_document_held(kdn_client* client, const int32_t* tokens, int64_t n,
                                     int* held);

/* Writes the document's KV into tokens [0, n) of `dst`. NOT_FOUND (a miss)
 * when the KDN lacks it, holds it pruned, or holds a chunk that is damaged
 * or of another model; a layout that does not fit the model, or buffers
 * shorter than n tokens, is refused before anything is read. */
KDN_API kdn_status kdn_document_fetch(kdn_client* client, const int32_t* tokens, int64_t n,
                                      const kdn_kv_layout* dst);

/* Stores the document's KV (tokens [0, n) of `src`, computed from position
 * 0) under its key, unless the KDN holds it already (*already_held: 1;
 * `already_held` may be NULL). */
KDN_API kdn_status kdn_document_store(kdn_client* client, const int32_t* tokens, int64_t n,
                                      const kdn_kv_layout* src, int* already_held);

/* ---- Steering (docs/serving.md, "Steering a document"). ---- */

/* A steering vector is made by kdn (POST /v1/kdn/steering) and stored in
 * the KDN under its name; a document's steered version (POST /v1/kdn/edit
 * with `steer`) is its KV with strength times the vector added to its last
 * token's values at the vector's layers, stored beside the original. */

/* Reads the steering vector named `name`: *n_layers is its layer count; when
 * it is at most `capacity` (layers), its layers go to `layers` and its
 * values to `values`, kv_heads * head_dim floats a layer, in the order of
 * its layers ([layer][kv_head][head_dim]); with a smaller capacity (0
 * included, with NULL buffers) nothing is written but *n_layers. NOT_FOUND
 * (a miss) when the KDN holds no vector of that name for this model. */
KDN_API kdn_status kdn_steering_vector_fetch(kdn_client* client, const char* name, int64_t capacity,
                                             int32_t* layers, float* values, int64_t* n_layers);

/* Writes the KV of the document's version steered by the vector `vector` at
 * `strength` into tokens [0, n) of `dst`, as kdn_document_fetch writes the
 * document's own. NOT_FOUND (a miss) when the KDN does not hold that
 * version. */
KDN_API kdn_status kdn_steered_document_fetch(kdn_client* client, const int32_t* tokens, int64_t n,
                                              const char* vector, float strength,
                                              const kdn_kv_layout* dst);

#ifdef __cplusplus
}
#endif

#endif /* KDN_CLIENT_H_ */
