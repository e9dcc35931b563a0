#pragma once
// Shared pieces of kdn-bench: the physical limits measured in each run
// (sgemm peak, memcpy bandwidth), common flags, and output.

#include <chrono>
#include <filesystem>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kdn/common/status.h"
#include "kdn/engine/generate.h"
#include "kdn/engine/engine.h"
#include "kdn/kvbus/chunk.h"

namespace CLI {
class App;
}  // namespace CLI

namespace kdn::bench {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double Seconds(Clock::time_point a, Clock::time_point b);

// The mean of samples (0 for none), and with it the percentile
// bootstrap's 95% interval: `resamples` resamples drawn with `seed`; with
// fewer than 2 samples or no resamples the interval is the mean alone.
double Mean(const std::vector<double>& x);
struct Interval {
  double mean = 0, lo = 0, hi = 0;
};
Interval Bootstrap(const std::vector<double>& x, int resamples, uint64_t seed);

// Best-of-N GFLOP/s of a square single-precision product: the ceiling the
// engine's matrix products can reach on this machine with these threads.
double SgemmPeakGflops(int n, int reps);

// Best-of-N GB/s of memcpy over a buffer far larger than the caches, counting
// bytes read plus bytes written, with the same threads as the engine.
double MemcpyGBps(size_t bytes, int reps);

// Best-of-N GB/s of one thread copying `bytes` (bytes copied per second).
double MemcpyOneThreadGBps(size_t bytes, int reps);

struct Common {
  std::string device = "cpu";  // cpu, cuda or cuda:N (engine::ParseDevice)
  std::string preset = "small";
  uint64_t seed = 0;
  std::string model_dir;
  int threads = 0;
  std::string weights_dtype = "native";  // engine::WeightsDType, on the CPU
  int reps = 3;
  std::string json_path;
  std::string peer_path;    // bench/hf_peer.py's JSON, for kdn-vs-peer ratios (cuda)
  std::string llama_bench;  // prefill/decode --llama-cpp: llama-bench to run as the CPU peer
};

// Greedy tokens continuing a sequence (kdn/engine/generate.h).
using engine::GreedyTokens;

// The model of --model or --preset on --device, its KV pool holding
// kv_tokens. A preset on a GPU is materialised there (its values are not the
// CPU's: compare backends on a model folder).
Result<std::unique_ptr<engine::Engine>> MakeModel(const Common& c, int64_t kv_tokens,
                                                  std::string* what);
// "f32", "f16" or "bf16" (anything else is f32: the flags check the choice).
kdn::DType ParseDType(const std::string& s);
// Asks the kernel to drop every file under `dir` from the page cache, so the
// next read comes from the device (clean pages only; no privileges needed).
void DropFromPageCache(const std::filesystem::path& dir);

// This process's resident memory (VmRSS), in MiB.
double RssMib();

// Backend, threads, BLAS build and core: what a run ran on.
json Machine(const Common& c);
// Writes `j` to --json's file, if one was given.
void Emit(const Common& c, const json& j);

// FLOPs of a forward pass over n new tokens after `past` cached ones, with
// `logit_rows` rows of logits (2 per multiply-add; causal attention counted
// for the pairs it computes).
double ForwardFlops(const model::ModelConfig& m, int64_t n, int64_t past, int64_t logit_rows);

int RunPrefill(const Common& c, const std::vector<int>& lengths);
int RunDecode(const Common& c, const std::vector<int>& batches, int context, int steps);
// The same on the GPU (CudaEngine, bf16), against the bf16 GEMM peak and the
// device-to-device copy bandwidth measured in the same run. Presets are
// materialised in device memory (no weights file needed).
int RunCudaPrefill(const Common& c, const std::vector<int>& lengths);
int RunCudaDecode(const Common& c, const std::vector<int>& batches, int context, int steps);
// cuda-ipc: one request's KV (tokens of c.preset's shape) between the paged
// pools of two processes on the GPU through the kvbus device planes
// (cuda_ipc, nccl; `paths` also: local, cuda_ipc/layer is cuda_ipc's twin,
// nccl-self), against a device-to-device cudaMemcpy in the same run
// (bench/cuda_planes_workload.cpp).
int RunCudaIpc(const Common& c, int tokens, const std::vector<std::string>& paths);
int RunStore(const Common& c, int tokens, int chunk_tokens, const std::string& dtype,
             const std::string& disk_dir);
// The shared KDN tiers (kdn-store, redis): put/get GB/s with `clients`
// threads, a 128-key lookup, and redis against redis-benchmark
// (bench/shared_tier_workload.cpp). Empty URLs: started for the run.
int RunSharedTiers(const Common& c, const std::vector<std::string>& backends,
                   const std::string& store_url, const std::string& redis_url, int chunk_mib,
                   int clients, int per_client);
// slow-tier: a burst of `prompts` cold prompts of `tokens` tokens at one
// prefill worker, with no shared tier and with one `delay_ms` late on every
// call (bench/slow_tier_workload.cpp).
int RunSlowTier(const Common& c, int prompts, int tokens, int delay_ms);
// pd-transfer: one request's KV between two processes (docs/kvbus.md, "Measured").
struct PdTransferOptions {
  int tokens = 4096, chunk_tokens = 256;
  std::string dtype = "f32";
  int socket_buffer_kib = 0;
  std::vector<std::string> transports = {"tcp", "shm"};
  // Where the receiver puts the KV: "in-place" (a landing site, as a decode
  // worker's KV blocks) and/or "staging" (its sink, after a copy out of the
  // landing segment).
  std::vector<std::string> landings = {"in-place", "staging"};
  bool curve = false;  // each row again with CURVE
  // Set: run this Python on nixl_script (bench/nixl_peer.py) for the same
  // bytes, as the peer figure in the same run.
  std::string nixl_python;
  std::string nixl_script = "bench/nixl_peer.py";
};
int RunPdTransfer(const Common& c, const PdTransferOptions& o);

// multiturn: conversations against a running deployment (docs/serving.md).
// Of Common only json_path applies.
struct MultiturnOptions {
  std::string url;            // the router's, http://HOST:PORT
  int context_tokens = 4096;  // shared context, fresh and random per conversation
  int turns = 4;
  int turn_tokens = 64;  // each new user message
  int max_tokens = 16;   // each answer
  int conversations = 2;
  int chunk_tokens = 256;  // the deployment's (kdn-launch --chunk-tokens): for the floor's context
  std::optional<uint64_t> seed;  // of the text; none: a new one each run, printed
  // The requests' "disaggregation" field, one run of the conversations per
  // entry (text of its own each); empty: one run, the router's own path.
  std::vector<std::string> paths;
};
int RunMultiturn(const Common& c, const MultiturnOptions& o);

// serve-load: many clients against a running deployment, their documents
// reused under a Zipf law (bench/serving_workloads.cpp; docs/serving.md).
struct ServeLoadOptions {
  std::string url;
  int clients = 8;
  int requests = 200;
  int soak = 0;  // > 0: that many requests, judged against the soak's aims
  int documents = 64;
  double zipf = 1.1;
  int doc_chars = 1024;
  int question_chars = 32;
  int max_tokens = 16;
  double ttft_slo_ms = 1000;
  std::string run_dir;  // kdn-launch's: processes' RSS read from /proc
  std::optional<uint64_t> seed;
  int chat_turns = 1;              // > 1: each client's requests are chats of that many turns
  std::vector<std::string> paths;  // as MultiturnOptions::paths: one run each
  // The overcommit case (docs/serving.md, "Admission and preemption"): every
  // request a document of its own, all of them at once; the load's prompt +
  // max_tokens against the decode pools (read from /status.json). With
  // roomy_url, the same load runs on that deployment too (its pools large
  // enough to need no preemption), and the two are compared.
  bool overcommit = false;
  std::string roomy_url;
};
int RunServeLoad(const Common& c, const ServeLoadOptions& o);
// The same conversations through prefill_worker::Prefiller in this process,
// on c.device (bench/multiturn_engine.cpp).
int RunMultiturnEngine(const Common& c, const MultiturnOptions& o);

// rag-blend: CacheBlend vs full prefill vs prefix caching (bench/blend_workloads.cpp).
// With check_layers, each ratio also runs with progressive filtering over
// those layers (blend::CheckSchedule's default ratios). `selections`
// (blend::ParseBlendSelection's names) are the policies each blend row
// runs with; a boundary:K one runs once (it uses no ratio).
int RunRagBlend(const Common& c, int docs, int doc_tokens, int question_tokens,
                const std::vector<double>& ratios, int check_layer,
                const std::vector<int>& check_layers,
                const std::vector<std::string>& selections = {"deviation"});

// blend-fidelity: CacheBlend's answers against full prefill's on prompts of
// real prose (bench/blend_fidelity.cpp; docs/blend.md).
struct BlendFidelityOptions {
  std::string text_dir = "/usr/share/common-licenses";
  int prompts = 50;
  int docs = 6;
  int doc_tokens = 96;  // a document: whole paragraphs, at least this many tokens
  int answer_tokens = 32;
  std::vector<double> ratios = {0.05, 0.15, 0.3};
  int check_layer = 1;
  std::vector<std::vector<int>> check_layers;  // progressive schedules
  // EPIC's boundary selection: one row per K (no ratio); and
  // boundary+deviation:K at each ratio, with one check and each schedule
  // (0: none).
  std::vector<int> boundary = {4, 16, 32};
  int boundary_deviation = 16;
  // query and query+boundary:K (K: boundary_deviation, 8 when that is 0)
  // rows at each ratio.
  bool query = true;
  // Quality-target rows (blend_max_kl), each starting at the first ratio.
  std::vector<double> max_kl;
  // Fit KL against the residual deviation (blend::BlendOptions::
  // kl_per_residual) over the deviation rows, and print the slope.
  bool calibrate = false;
};
int RunBlendFidelity(const Common& c, const BlendFidelityOptions& o);

// prune-fidelity: question-free KV pruning (kdn/prune) against full KV and
// against kvpress's presses on the same samples (bench/prune_fidelity.cpp;
// docs/kvbus.md, "Pruned KV").
struct PruneFidelityOptions {
  std::string text_dir = "/usr/share/common-licenses";
  int documents = 12;
  int questions = 2;     // per document
  int doc_tokens = 384;  // a document: whole paragraphs, at least this many tokens
  int answer_tokens = 24;
  std::vector<double> keeps = {0.5, 0.25, 0.125};
  std::vector<std::string> methods = {"expected_attention", "knorm", "kvzip"};
  std::vector<std::string> granularities = {"token", "layer", "head", "global"};
  int sinks = 4;
  int kvzip_chunk = 2048;  // context tokens per KVzip repeat pass
  // kvzip's profiled scoring too (the model's head budgets measured first).
  bool kvzip_profiled = true;
  int bootstrap = 2000;  // resamples for the KL intervals
  // Set: run this Python (scripts/kvpress-env.sh's) on kvpress_script.
  std::string kvpress_python;
  std::string kvpress_script = "bench/kvpress_peer.py";
  std::vector<std::string> kvpress_presses = {"expected_attention", "knorm",  "keydiff",
                                              "streaming_llm",      "snapkv", "kvzip"};
  std::string work_dir = "/tmp/kdn-prune-fidelity";
};
int RunPruneFidelity(const Common& c, const PruneFidelityOptions& o);

// kv-edit: edits of a stored document's KV on a knowledge-conflict set
// (bench/kv_edit.cpp; docs/kvbus.md, "Editing stored KV").
struct KvEditOptions {
  std::string facts_path = "bench/data/kv_edit_facts.txt";
  int items = 0;        // at most; 0: every fact the model knows
  int other_facts = 4;  // true facts in each document beside the counterfactual
  int fluency_items = 48;
  int fluency_tokens = 64;
  double recompute_ratio = 0.15;
  std::vector<double> emphasize_strengths = {1, 2, 4};
  // Value steering: strengths (a row each) of the vector from --steer-pairs
  // contrastive pairs, added to the document's last token's values.
  std::vector<double> steer_strengths = {1, 2, 4, 8};
  int steer_pairs = 32;
  // Emphasis on profiled heads (PASTA's profiling): the --profile-heads
  // heads whose bias of --profile-strength alone most raises the stated
  // object's log-probability over --profile-items documents of facts the
  // model does not know; a row per strength.
  std::vector<double> profiled_strengths = {2, 4, 8};
  int profile_heads = 16;
  int profile_items = 16;
  double profile_strength = 4;
  int bootstrap = 2000;
  std::string instruction =
      "Answer from the text below. Where it differs from what you know, the text is right.";
  std::string erratum = "Note: the text above is right.";
};
// kv-edit's flags on its subcommand (bench/kv_edit.cpp).
void AddKvEditOptions(CLI::App* sub, KvEditOptions* o);
int RunKvEdit(const Common& c, const KvEditOptions& o);

// quality: exact match of a QA model on its eval set, by task family and mode
// (bench/quality_workload.cpp). With `check_layers`, each of `ratios` also
// runs with progressive filtering over them. `kv_codec` (a kvbus codec level) codes the
// documents' KV before reuse. `ratios` are CacheBlend's (deviation-chosen
// tokens), `random_ratios` the same numbers of tokens chosen at random;
// each of `selections` (blend::ParseBlendSelection's names) also runs at
// each of `ratios`.
std::string QaPrompt(const std::vector<std::string>& documents, const std::string& question);
int RunQuality(const Common& c, const std::string& eval_path, int limit, int max_tokens,
               const std::vector<double>& ratios, const std::vector<double>& random_ratios,
               int check_layer, const std::string& kv_codec, const std::vector<int>& check_layers,
               const std::vector<std::string>& selections = {});

// kv-codec: the KV codec's size, error and speed against raw, plain 8-bit
// quantization and zstd, and TTFT with the prefix loaded from the disk tier
// and from a kdn-store, raw against encoded (bench/codec_workload.cpp).
struct KvCodecOptions {
  int tokens = 4096;  // of KV (whole chunks), computed from the text
  int chunk_tokens = 256;
  std::string dtype = "f32";
  std::vector<std::string> levels = {"lossless", "q8", "q6", "q4", "q3", "q2"};
  std::vector<std::string> ttft_levels = {"lossless", "q4"};  // raw always; empty: no TTFT
  // eval.jsonl, whose documents --model's tokenizer (a preset's: this
  // folder's tokenizer.json) encodes; default: --model's folder
  std::string text_dir;
  int suffix_tokens = 64;
  std::string disk_dir;
};
int RunKvCodec(const Common& c, const KvCodecOptions& o);

// tokenize: encode and decode speed of a tokenizer folder on a long text
// (--text, or a synthetic one of about `tokens` tokens), in tokens/s and
// microseconds per 1000 tokens against a 1 ms/1000-token budget
// (bench/tokenize_workload.cpp). Of Common only reps and json_path apply.
int RunTokenize(const Common& c, const std::string& tokenizer_dir, const std::string& text_path,
                int tokens);

}  // namespace kdn::bench
