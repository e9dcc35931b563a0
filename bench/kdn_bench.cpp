// kdn-bench: named workloads, each reported as a table for people and, with
// --json, one JSON object for machines. Every figure comes with the ratio it
// exists for, taken in the same run.
//
// Workloads (more arrive with the subsystems they measure):
//   prefill   one long prompt, no cache: tokens/s, and achieved GFLOP/s
//             against the sgemm peak of this machine measured in the same run.
//   decode    a batch of sequences generating: tokens/s; achieved GFLOP/s
//             against the same sgemm peak; and the bytes a step must read
//             (weights in the format the engine holds them + KV) per second
//             against memcpy bandwidth, the limit that matters at small
//             batches, measured in the same run. prefill and decode with
//             --llama-cpp also run llama.cpp's llama-bench on the same GGUF
//             and threads (llama_cpp_peer.h) and report kdn's ratio to it.
//   store     one request's KV through the host tier (paged KV -> chunk ->
//             tier -> paged KV) against one-thread memcpy, and through the
//             disk tier against the disk's own sequential bandwidth, both
//             measured in the same run.
//   pd-transfer  one request's KV from a prefill process to a decode process
//             over the tcp transport (loopback), against memcpy in the same run.
//   cuda-ipc  one request's KV (16K tokens of llama3-8b, blocks scattered in
//             each pool) between two processes' GPU KV pools through the
//             kvbus device planes (cuda_ipc, nccl; bench/cuda_planes_workload.cpp):
//             GB/s and the ratio to a device-to-device cudaMemcpy of the same
//             bytes in the same run. CUDA builds only.
//   multiturn  conversations against a running deployment (--url, the
//             router's): a fresh random context per conversation, then turns
//             that each add a user message and the answer; time to first
//             token of the later turns, whose prefix the KDN holds, against
//             the first turn's cold prefill and against a floor measured
//             after each later turn: the same number of new tokens on top of
//             a context of whole cached chunks.
//   rag-blend k documents in a new order + a question, the documents' KV
//             cached alone: TTFT of CacheBlend (several ratios) vs full
//             prefill vs prefix caching alone, with KL and greedy agreement
//             against full prefill.
//   kv-codec  the KV codec on one request's KV computed from real text: bytes
//             per token against raw, plain 8-bit quantization and zstd; KV
//             error and the KL it causes; encode and decode GB/s; TTFT with
//             the prefix loaded from the disk tier and from kdn-store, raw
//             against encoded.
//   tokenize  a tokenizer folder (--tokenizer) encoding a ~32K-token text and
//             decoding it back, whole and token by token: tokens/s and
//             microseconds per 1000 tokens against a 1 ms/1000-token budget.
//   blend-fidelity  multi-document prompts of real English prose (licence
//             texts): per blend mode (full reuse, deviation-chosen, random,
//             progressive filtering; several ratios) the KL and top-1
//             agreement with full prefill over 32 teacher-forced answer
//             positions, whole greedy answers equal, and TTFT vs full prefill.
//   prune-fidelity  question-free KV pruning (kdn/prune) on documents of
//             real prose: per method, granularity and keep ratio the KL and
//             top-1 agreement with the whole KV over questions unseen at
//             pruning time and their answers, KV stored, TTFT; kvpress's
//             presses on the same samples with --kvpress-python.
//   quality   exact-match accuracy of a question-answering model (models/kdn-qa)
//             on its held-out eval set through kdn's engine, by hops: full
//             prefill, full reuse of each document's KV, CacheBlend ratios.
#include <cblas.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include <CLI/CLI.hpp>

#include "bench_util.h"
#include "llama_cpp_peer.h"
#include "kdn/control/request_spec.h"
#include "kdn/engine/cpu_runtime.h"
#include "kdn/model/gguf.h"
#include "kdn/worker/worker_flags.h"
#include "kdn/engine/open_engine.h"

int main(int argc, char** argv) {
  using namespace kdn::bench;
  kdn::engine::PrepareCpuRuntime(argv);
  CLI::App app{"kdn benchmarks: named workloads, reported as ratios taken in one run."};
  app.require_subcommand(1);
  Common c;
  auto common = [&](CLI::App* sub) {
    sub->add_option("--preset", c.preset, "Generated model preset (ignored with --model)")
        ->capture_default_str();
    sub->add_option("--seed", c.seed, "Seed of the generated weights")->capture_default_str();
    sub->add_option("--model", c.model_dir, "Model folder or .gguf file instead of a preset");
    sub->add_option("--threads", c.threads, "CPU threads (0 = all cores)")->capture_default_str();
    kdn::worker::AddWeightsDTypeOption(*sub, &c.weights_dtype);
    sub->add_option("--reps", c.reps, "Timed repetitions (best is reported)")
        ->capture_default_str();
    sub->add_option("--json", c.json_path, "Also write the results as one JSON object");
  };
  std::vector<int> lengths = {512, 2048};
  auto device_option = [&](CLI::App* sub) {
    sub->add_option("--device", c.device,
                    "cpu (weights per --weights-dtype, vs sgemm peak and memcpy) or cuda (bf16 on "
                    "GPU 0, vs the bf16 "
                    "GEMM peak and a device copy; presets are made in device memory)")
        ->check(CLI::IsMember({"cpu", "cuda"}))
        ->capture_default_str();
    sub->add_option("--peer", c.peer_path,
                    "With --device cuda: bench/hf_peer.py's JSON from the same GPU; adds kdn vs "
                    "transformers ratios for the lengths and batches it measured")
        ->check(CLI::ExistingFile);
  };
  auto* prefill = app.add_subcommand(
      "prefill", "One long prompt, no cache: tokens/s and FLOP/s vs the matrix-product peak");
  common(prefill);
  device_option(prefill);
  prefill->add_option("--tokens", lengths, "Prompt lengths")->capture_default_str()->delimiter(',');
  bool llama_cpp = false;
  std::string llama_bench = DefaultLlamaBench();
  auto peer_options = [&](CLI::App* sub) {
    sub->add_flag("--llama-cpp", llama_cpp,
                  "Also run llama.cpp's llama-bench on the same --model file and threads, after "
                  "kdn's runs, and report kdn's ratio to it (bench/llama_cpp_peer.sh builds it)");
    sub->add_option("--llama-bench", llama_bench, "The llama-bench binary --llama-cpp runs")
        ->capture_default_str();
  };
  peer_options(prefill);

  std::vector<int> batches = {1, 8, 32};
  int context = 512, steps = 16;
  auto* decode =
      app.add_subcommand("decode", "A batch generating: tokens/s and GB/s vs a memory copy");
  common(decode);
  device_option(decode);
  decode->add_option("--batch", batches, "Batch sizes")->capture_default_str()->delimiter(',');
  decode->add_option("--context", context, "Tokens of KV each sequence holds")
      ->capture_default_str();
  decode->add_option("--steps", steps, "Decode steps timed per batch size")->capture_default_str();
  peer_options(decode);
  int store_tokens = 4096, chunk_tokens = 256;
  std::string store_dtype = "f32", disk_dir = std::filesystem::temp_directory_path().string();
  auto* store =
      app.add_subcommand("store", "Host and disk tier GB/s vs memcpy and the disk's own bandwidth");
  common(store);
  store->add_option("--tokens", store_tokens, "Tokens of KV moved")->capture_default_str();
  store->add_option("--chunk-tokens", chunk_tokens, "Tokens per chunk")->capture_default_str();
  store->add_option("--dtype", store_dtype, "Chunk dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  store->add_option("--disk-dir", disk_dir, "Folder for the disk tier")->capture_default_str();
  std::vector<std::string> store_backends;
  std::string bench_store_url, bench_redis_url;
  int shared_chunk_mib = 4, shared_clients = 4, shared_chunks = 16;
  store
      ->add_option("--backends", store_backends,
                   "Instead of the host and disk tiers: the shared tiers kdn-store and/or redis, "
                   "put and get GB/s and a 128-key lookup, redis against redis-benchmark on the "
                   "same cluster (started and stopped here unless --kdn-store/--kdn-redis)")
      ->delimiter(',')
      ->check(CLI::IsMember({"kdn-store", "redis"}));
  store->add_option("--kdn-store", bench_store_url, "A running kdn-store (tcp://host:port)");
  store->add_option("--kdn-redis", bench_redis_url,
                    "A running Redis Cluster: redis://[user:password@]host:port[,...]");
  store->add_option("--chunk-mib", shared_chunk_mib, "With --backends: MiB of KV per chunk")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  store->add_option("--clients", shared_clients, "With --backends: client threads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  store->add_option("--chunks", shared_chunks, "With --backends: chunks each client puts and gets")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  PdTransferOptions pdo;
  auto* pd = app.add_subcommand(
      "pd-transfer", "One request's KV between two processes, per kvbus transport, vs memcpy");
  common(pd);
  pd->add_option("--tokens", pdo.tokens, "Tokens of KV in the request")->capture_default_str();
  pd->add_option("--chunk-tokens", pdo.chunk_tokens, "Tokens per chunk")->capture_default_str();
  pd->add_option("--dtype", pdo.dtype, "Chunk dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  pd->add_option("--transport", pdo.transports,
                 "Transports to measure in this run (tcp, shm, cuda_ipc, nccl; repeat or "
                 "comma-separate). cuda_ipc and nccl run the device planes over the host "
                 "backend (memory standing in for a device's, a loopback socket for NCCL), into "
                 "an in-place pool of their own")
      ->delimiter(',')
      ->check(CLI::IsMember({"tcp", "shm", "cuda_ipc", "nccl"}))
      ->capture_default_str();
  pd->add_option("--landing", pdo.landings,
                 "Where the receiving process puts the KV, each measured in this run: in-place "
                 "(scattered over 16-token blocks of a pool, as a decode worker's KV blocks; "
                 "docs/kvbus.md, \"Landing in place\") or staging (copied out of the landing "
                 "segment into a chunk buffer, as before)")
      ->delimiter(',')
      ->check(CLI::IsMember({"in-place", "staging"}))
      ->capture_default_str();
  pd->add_option("--socket-buffer-kib", pdo.socket_buffer_kib,
                 "SO_SNDBUF/SO_RCVBUF of the connection (0: the OS's autotuning)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  pd->add_flag("--curve", pdo.curve,
               "Measure each transport twice in this run: plaintext, then with CURVE (kdn's "
               "authenticated sockets, docs/kvbus.md), and print the CURVE rows' share of "
               "plaintext");
  pd->add_option("--nixl", pdo.nixl_python,
                 "A Python with the PyPI nixl wheel: also run --nixl-script for the same bytes "
                 "in this run (NIXL moving them between two processes) and print each row's "
                 "share of it");
  pd->add_option("--nixl-script", pdo.nixl_script, "The NIXL peer script")->capture_default_str();
  int ipc_tokens = 16384;
  std::string ipc_preset = "llama3-8b";
  std::vector<std::string> ipc_paths = {"local", "cuda_ipc", "nccl", "nccl-self"};
  auto* cuda_ipc = app.add_subcommand(
      "cuda-ipc",
      "One request's KV between two processes' GPU pools (cuda_ipc, nccl) vs cudaMemcpy");
  cuda_ipc->add_option("--preset", ipc_preset, "Model preset whose KV shape is moved")
      ->capture_default_str();
  cuda_ipc->add_option("--tokens", ipc_tokens, "Tokens of KV in the request")
      ->capture_default_str();
  cuda_ipc
      ->add_option("--path", ipc_paths,
                   "Paths to measure (local, cuda_ipc, nccl, nccl-self; repeat or "
                   "comma-separate)")
      ->delimiter(',')
      ->check(CLI::IsMember({"local", "cuda_ipc", "nccl", "nccl-self"}))
      ->capture_default_str();
  cuda_ipc->add_option("--seed", c.seed, "Seed of the block tables")->capture_default_str();
  cuda_ipc->add_option("--reps", c.reps, "Timed repetitions (best is reported)")
      ->capture_default_str();
  cuda_ipc->add_option("--json", c.json_path, "Also write the results as one JSON object");
  MultiturnOptions mt;
  uint64_t mt_seed = 0;
  auto* multiturn = app.add_subcommand(
      "multiturn",
      "TTFT of later turns vs the first turn: against a running deployment (--url), "
      "or through the prefill worker's logic in this process (--device)");
  auto* mt_url = multiturn->add_option("--url", mt.url, "The router's URL, http://HOST:PORT");
  auto* mt_device =
      multiturn
          ->add_option("--device", c.device,
                       "Instead of --url: the engine in this process, on cpu, cuda or cuda:N, "
                       "over a host-memory KDN tier (a preset is materialised on the GPU)")
          ->check(kdn::worker::CheckDeviceName)
          ->excludes(mt_url);
  multiturn->add_option("--preset", c.preset, "With --device: generated model preset")
      ->capture_default_str()
      ->needs(mt_device);
  multiturn
      ->add_option("--model", c.model_dir, "With --device: a model folder or .gguf file instead")
      ->needs(mt_device);
  multiturn->add_option("--threads", c.threads, "With --device cpu: CPU threads (0 = all cores)")
      ->capture_default_str()
      ->needs(mt_device);
  multiturn->add_option("--context-tokens", mt.context_tokens, "Tokens of shared context")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  multiturn->add_option("--turns", mt.turns, "Turns per conversation")
      ->capture_default_str()
      ->check(CLI::Range(2, 1000));
  multiturn->add_option("--turn-tokens", mt.turn_tokens, "Tokens of each new user message")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  multiturn->add_option("--max-tokens", mt.max_tokens, "Tokens of each answer")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  multiturn
      ->add_option("--conversations", mt.conversations,
                   "Independent conversations (per-turn median and mean over them)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  multiturn
      ->add_option("--chunk-tokens", mt.chunk_tokens,
                   "The deployment's tokens per KV chunk (kdn-launch --chunk-tokens): the "
                   "floor's context is whole chunks")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  multiturn->add_option("--seed", mt_seed, "Seed of the text (default: a new one each run)");
  multiturn
      ->add_option("--paths", mt.paths,
                   "With --url: run the conversations once per path, each request with that "
                   "\"disaggregation\" field (always, auto, never; docs/serving.md, \"Two "
                   "paths\"), text of its own each, and compare later turns against the first")
      ->delimiter(',')
      ->needs(mt_url);
  multiturn->add_option("--json", c.json_path, "Also write the results as one JSON object");
  std::string eval_path;
  int quality_limit = 0, quality_max_tokens = 96, quality_check = 1;
  std::vector<double> quality_ratios = {0.05, 0.15, 0.3};
  std::vector<double> quality_random = {0.15};
  auto* quality = app.add_subcommand(
      "quality", "Exact-match accuracy of a QA model on its eval set, through kdn's engine");
  common(quality);
  quality->add_option("--eval", eval_path, "Eval set (default: MODEL/eval.jsonl)");
  quality->add_option("--limit", quality_limit, "Only the first N examples (0: all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  quality->add_option("--max-tokens", quality_max_tokens, "Answer tokens at most")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  bool quality_full_only = false;
  quality
      ->add_option("--ratios", quality_ratios,
                   "CacheBlend recompute ratios, each in (0, 1]; full reuse (ratio 0) "
                   "runs beside them")
      ->delimiter(',')
      ->capture_default_str();
  quality
      ->add_option("--random-ratios", quality_random,
                   "Ratios at which randomly chosen tokens are recomputed instead of the "
                   "deviation-chosen ones (CacheBlend's baseline); 0: none")
      ->delimiter(',')
      ->capture_default_str();
  quality->add_flag("--full-prefill-only", quality_full_only,
                    "Only full prefill: no full reuse, no CacheBlend");
  quality->add_option("--check-layer", quality_check, "Layer whose KV deviation picks the tokens")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  std::vector<int> quality_layers;
  quality
      ->add_option("--check-layers", quality_layers,
                   "Also run each --ratios value with progressive filtering over these check "
                   "layers (ascending, comma-separated)")
      ->delimiter(',');
  std::vector<std::string> quality_selections;
  quality
      ->add_option("--selections", quality_selections,
                   "Also run each --ratios value with these selection policies (comma-separated "
                   "names of --blend-selection: query, query+boundary:8, boundary+deviation:8, "
                   "...); a query selection's pass counts as recomputed")
      ->delimiter(',');
  std::string quality_codec = "raw";
  quality
      ->add_option("--kv-codec", quality_codec,
                   "Code each document's KV at this level and use the decoded KV in the "
                   "reuse and blend modes (raw, lossless, q2 ... q8)")
      ->capture_default_str();
  KvCodecOptions kc;
  kc.disk_dir = disk_dir;
  auto* kv_codec = app.add_subcommand(
      "kv-codec",
      "KV codec: size vs raw, int8 and zstd; error and KL; GB/s; TTFT from disk and kdn-store");
  common(kv_codec);
  kv_codec->add_option("--tokens", kc.tokens, "Tokens of KV (whole chunks), computed from the text")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  kv_codec->add_option("--chunk-tokens", kc.chunk_tokens, "Tokens per chunk")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  kv_codec->add_option("--dtype", kc.dtype, "Chunk dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  kv_codec->add_option("--levels", kc.levels, "Codec levels to measure (lossless, q2 ... q8)")
      ->delimiter(',')
      ->capture_default_str();
  kv_codec
      ->add_option("--ttft-levels", kc.ttft_levels,
                   "Levels whose TTFT is measured from each tier, beside raw (none: skip)")
      ->delimiter(',')
      ->capture_default_str();
  kv_codec->add_option("--text", kc.text_dir,
                       "Folder whose eval.jsonl documents give the text, tokenized by "
                       "--model's tokenizer (a preset's: this folder's) (default: --model's; "
                       "e.g. models/kdn-qa for a preset or a .gguf file)");
  kv_codec
      ->add_option("--suffix-tokens", kc.suffix_tokens,
                   "New tokens computed on top of the cached KV (KL, TTFT)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  kv_codec->add_option("--disk-dir", kc.disk_dir, "Folder for the disk tier")
      ->capture_default_str();
  int rb_docs = 6, rb_doc_tokens = 512, rb_question = 32, rb_check = 1;
  std::vector<double> rb_ratios = {0.0, 0.05, 0.15, 0.3, 1.0};
  auto* rag = app.add_subcommand("rag-blend",
                                 "CacheBlend TTFT and quality vs full prefill and prefix caching");
  common(rag);
  rag->add_option("--device", c.device,
                  "Where the engine runs: cpu, cuda or cuda:N (a preset is materialised on the "
                  "GPU, bf16)")
      ->check(kdn::worker::CheckDeviceName)
      ->capture_default_str();
  rag->add_option("--docs", rb_docs, "Documents per prompt")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  rag->add_option("--doc-tokens", rb_doc_tokens, "Tokens per document")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  rag->add_option("--question-tokens", rb_question, "Tokens of the question")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  rag->add_option("--ratios", rb_ratios, "Recompute ratios to run")
      ->delimiter(',')
      ->capture_default_str();
  rag->add_option("--check-layer", rb_check, "Layer whose KV deviation picks the tokens")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  std::vector<std::string> rb_selections = {"deviation"};
  rag->add_option("--selections", rb_selections,
                  "Blend selection policies the blend rows run with (comma-separated: "
                  "deviation, random, boundary:K, boundary+deviation:K); boundary:K runs once")
      ->delimiter(',')
      ->check([](const std::string& v) {
        auto s = kdn::blend::ParseBlendSelection(v);
        return s.ok() ? std::string() : s.status().message();
      })
      ->capture_default_str();
  std::vector<int> rb_layers;
  rag->add_option("--check-layers", rb_layers,
                  "Also run each partial ratio with progressive filtering over these check "
                  "layers (ascending, comma-separated)")
      ->delimiter(',');
  BlendFidelityOptions bf;
  std::vector<std::string> bf_layers;
  auto* fidelity = app.add_subcommand(
      "blend-fidelity",
      "CacheBlend vs full prefill on prompts of real prose: KL, top-1 and greedy agreement over "
      "the answer, TTFT, per selection and ratio");
  common(fidelity);
  fidelity->add_option("--device", c.device, "Where the engine runs: cpu, cuda or cuda:N")
      ->check(kdn::worker::CheckDeviceName)
      ->capture_default_str();
  fidelity->add_option("--text-dir", bf.text_dir, "Folder of English text files (the documents)")
      ->capture_default_str();
  fidelity->add_option("--prompts", bf.prompts, "Prompts")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  fidelity->add_option("--docs", bf.docs, "Documents per prompt")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  fidelity
      ->add_option("--doc-tokens", bf.doc_tokens,
                   "A document: consecutive paragraphs of one file, at least this many tokens")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  fidelity->add_option("--answer-tokens", bf.answer_tokens, "Answer positions compared")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  fidelity->add_option("--ratios", bf.ratios, "Recompute ratios, each in (0, 1)")
      ->delimiter(',')
      ->capture_default_str();
  fidelity
      ->add_option("--check-layer", bf.check_layer,
                   "The one check layer of deviation and random selection")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  fidelity
      ->add_option("--boundary", bf.boundary,
                   "Boundary selection (EPIC's): one row for each K, the first K tokens of each "
                   "document recomputed (comma-separated; 0: no such rows)")
      ->delimiter(',')
      ->capture_default_str();
  fidelity
      ->add_option("--boundary-deviation", bf.boundary_deviation,
                   "boundary+deviation:K rows at each ratio, with one check and each schedule "
                   "(0: none)")
      ->capture_default_str()
      ->check(CLI::Range(0, kdn::blend::kMaxBoundaryTokens));
  fidelity
      ->add_option("--query", bf.query,
                   "query and query+boundary:K rows at each ratio (K of --boundary-deviation; "
                   "the question's pass counted in the recomputed share)")
      ->capture_default_str();
  fidelity
      ->add_option("--max-kl", bf.max_kl,
                   "Quality-target rows: blend_max_kl values (comma-separated), the ratio "
                   "raised from the first of --ratios")
      ->delimiter(',');
  fidelity->add_flag("--calibrate", bf.calibrate,
                     "Fit each prompt's KL against its residual deviation over the deviation "
                     "rows (the slope a quality target uses); run on prompts (--seed) other than "
                     "those reported");
  fidelity->add_option("--check-layers", bf_layers,
                       "A progressive schedule's check layers, comma-separated and ascending "
                       "(repeat the option for several schedules)");
  PruneFidelityOptions pf;
  auto* prune_fidelity = app.add_subcommand(
      "prune-fidelity",
      "Question-free KV pruning vs the whole KV on real prose, kdn's methods and kvpress's presses "
      "in the same run: KL (bootstrap interval) and top-1 over question and answer, KV stored, "
      "TTFT");
  common(prune_fidelity);
  prune_fidelity->add_option("--text-dir", pf.text_dir, "Folder of English text files")
      ->capture_default_str();
  prune_fidelity->add_option("--documents", pf.documents, "Documents (each pruned once)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  prune_fidelity->add_option("--questions", pf.questions, "Questions per document")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  prune_fidelity
      ->add_option("--doc-tokens", pf.doc_tokens,
                   "A document: consecutive paragraphs of one file, at least this many tokens")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  prune_fidelity->add_option("--answer-tokens", pf.answer_tokens, "Greedy answer tokens compared")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  prune_fidelity->add_option("--keep", pf.keeps, "Keep ratios, each in (0, 1]")
      ->delimiter(',')
      ->capture_default_str();
  prune_fidelity
      ->add_option("--methods", pf.methods, "kdn's scores: expected_attention, knorm, kvzip")
      ->delimiter(',')
      ->capture_default_str();
  prune_fidelity
      ->add_option("--granularity", pf.granularities,
                   "What kdn keeps alike: token (every layer and head), layer, head; or global "
                   "(each layer and head as many as its scores earn)")
      ->delimiter(',')
      ->capture_default_str();
  prune_fidelity->add_option("--sinks", pf.sinks, "First tokens always kept")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  prune_fidelity
      ->add_flag("--kvzip-profiled,!--no-kvzip-profiled", pf.kvzip_profiled,
                 "Under kvzip, its profiled scoring too (the model's head budgets measured "
                 "first, about 12 s for SmolLM2 on 2 cores); without it, what a deployment stores "
                 "for kvzip is measured with its full scoring")
      ->capture_default_str();
  prune_fidelity
      ->add_option("--kvzip-chunk", pf.kvzip_chunk,
                   "Context tokens KVzip repeats per pass (longer contexts: in parts)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  prune_fidelity->add_option("--bootstrap", pf.bootstrap, "Resamples of the KL intervals")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  prune_fidelity
      ->add_option("--kvpress-python", pf.kvpress_python,
                   "Python with kvpress (scripts/kvpress-env.sh: .venv-kvpress/bin/python): also "
                   "run kvpress's presses on the same samples (needs --model SmolLM2.gguf)")
      ->check(CLI::ExistingFile);
  prune_fidelity->add_option("--kvpress-script", pf.kvpress_script, "bench/kvpress_peer.py")
      ->capture_default_str()
      ->check(CLI::ExistingFile);
  prune_fidelity
      ->add_option("--kvpress-presses", pf.kvpress_presses,
                   "kvpress presses to run (none: only the transformers replays, which need no "
                   "kvpress)")
      ->delimiter(',')
      ->capture_default_str();
  prune_fidelity
      ->add_option("--work-dir", pf.work_dir,
                   "Where the peer's transformers model and exchange files go")
      ->capture_default_str();
  KvEditOptions ke;
  auto* kv_edit = app.add_subcommand(
      "kv-edit",
      "Edits of a stored document's KV on a knowledge-conflict set: efficacy, paraphrases, "
      "specificity, fluency and cost per arm (no edit, re-prefill with an instruction, the "
      "instruction as text, an erratum), with bootstrap intervals");
  common(kv_edit);
  AddKvEditOptions(kv_edit, &ke);
  std::string tk_dir, tk_text;
  int tk_tokens = 32768;
  auto* tokenize = app.add_subcommand(
      "tokenize", "Tokenizer encode and decode speed on a long text: tokens/s, us per 1000 tokens");
  tokenize
      ->add_option("--tokenizer", tk_dir,
                   "Folder with tokenizer.json (and tokenizer_config.json), or a .gguf file")
      ->required()
      ->check(CLI::ExistingPath);
  tokenize->add_option("--text", tk_text, "Text file to encode (default: a synthetic text)")
      ->check(CLI::ExistingFile);
  tokenize->add_option("--tokens", tk_tokens, "Tokens of the synthetic text, about")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  tokenize->add_option("--reps", c.reps, "Timed repetitions (best is reported)")
      ->capture_default_str();
  tokenize->add_option("--json", c.json_path, "Also write the results as one JSON object");
  ServeLoadOptions sl;
  uint64_t sl_seed = 0;
  int slow_prompts = 16, slow_tokens = 512, slow_delay_ms = 50;
  auto* slow_tier = app.add_subcommand(
      "slow-tier",
      "A burst of cold prompts at one prefill worker, with no shared tier and with one that "
      "answers every call late: both prompt tokens/s and their ratio (aim: at least 0.9x)");
  common(slow_tier);
  slow_tier->add_option("--prompts", slow_prompts, "Prompts in the burst")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  slow_tier->add_option("--tokens", slow_tokens, "Tokens of each prompt")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  slow_tier->add_option("--delay-ms", slow_delay_ms, "How late the shared tier answers each call")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  auto* serve_load = app.add_subcommand(
      "serve-load",
      "Many clients against a running deployment, their documents reused under a Zipf law: "
      "throughput and goodput at a TTFT objective, TTFT and inter-token percentiles, errors, the "
      "KDN hit rate, RSS; --soak N judges N requests against the soak's aims");
  serve_load->add_option("--url", sl.url, "The router's URL, http://HOST:PORT")->required();
  serve_load->add_option("--clients", sl.clients, "Concurrent clients")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  serve_load->add_option("--requests", sl.requests, "Requests in all")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve_load
      ->add_option("--soak", sl.soak,
                   "Run this many requests instead, then exit 1 unless there was no error, "
                   "every KV block came back, and no process's RSS grew 5% after warm-up "
                   "(the first 10%; RSS needs --run-dir)")
      ->check(CLI::PositiveNumber);
  serve_load->add_option("--documents", sl.documents, "Distinct documents")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve_load->add_option("--zipf", sl.zipf, "Zipf exponent of document popularity")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 10.0));
  serve_load->add_option("--doc-chars", sl.doc_chars, "Characters of a document (random words)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve_load
      ->add_option("--question-chars", sl.question_chars,
                   "Characters of the new question after each document")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve_load->add_option("--max-tokens", sl.max_tokens, "Tokens of each answer (ignore_eos)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve_load->add_option("--ttft-slo-ms", sl.ttft_slo_ms, "TTFT objective for the goodput")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve_load
      ->add_option("--run-dir", sl.run_dir,
                   "kdn-launch's run dir: each process's RSS is read from /proc")
      ->check(CLI::ExistingDirectory);
  serve_load->add_option("--seed", sl_seed, "Seed of the text (default: a new one each run)");
  serve_load
      ->add_option("--chat-turns", sl.chat_turns,
                   "Each client's requests are chats of this many turns: a document and a "
                   "question, then the answer and a new question each turn")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  serve_load
      ->add_option("--paths", sl.paths,
                   "Run the load once per path, each request with that \"disaggregation\" "
                   "field (always, auto, never), text of its own each, and compare them")
      ->delimiter(',');
  serve_load->add_flag(
      "--overcommit", sl.overcommit,
      "The overcommit case: each request a document of its own and all sent at once (--clients "
      "defaults to --requests); reports the load's prompt + max_tokens against the decode "
      "workers' KV pools (aim: at least 2x), the completed share, preemptions and resumes");
  serve_load
      ->add_option("--roomy-url", sl.roomy_url,
                   "With --overcommit: a second deployment of the same model whose decode pools "
                   "hold the whole load; the same load runs there too and the two are compared")
      ->needs("--overcommit");
  serve_load->add_option("--json", c.json_path, "Also write the results as one JSON object");
  CLI11_PARSE(app, argc, argv);

  if (tokenize->parsed()) return RunTokenize(c, tk_dir, tk_text, tk_tokens);
  if (serve_load->parsed()) {
    if (serve_load->count("--seed") > 0) sl.seed = sl_seed;
    if (sl.overcommit && serve_load->count("--clients") == 0) sl.clients = sl.requests;
    return RunServeLoad(c, sl);
  }

  if (c.threads > 0) {
    omp_set_num_threads(c.threads);
    openblas_set_num_threads(c.threads);
  }
  if (multiturn->parsed()) {
    if (multiturn->count("--seed") > 0) mt.seed = mt_seed;
    if (mt_device->count() > 0) return RunMultiturnEngine(c, mt);
    if (mt_url->count() == 0) {
      std::fprintf(stderr,
                   "kdn-bench multiturn: give --url (a deployment) or --device (this "
                   "process)\n");
      return 2;
    }
    return RunMultiturn(c, mt);
  }
  if (rag->parsed()) {
    return RunRagBlend(c, rb_docs, rb_doc_tokens, rb_question, rb_ratios, rb_check, rb_layers,
                       rb_selections);
  }
  if (fidelity->parsed()) {
    for (const std::string& s : bf_layers) {
      std::vector<int> layers;
      std::stringstream in(s);
      std::string item;
      while (std::getline(in, item, ',')) {
        try {
          layers.push_back(std::stoi(item));
        } catch (const std::exception&) {
          std::fprintf(stderr,
                       "kdn-bench blend-fidelity: --check-layers %s: not a list of "
                       "layers\n",
                       s.c_str());
          return 2;
        }
      }
      bf.check_layers.push_back(std::move(layers));
    }
    return RunBlendFidelity(c, bf);
  }
  if (prune_fidelity->parsed()) {
    if (pf.kvpress_presses == std::vector<std::string>{"none"}) pf.kvpress_presses.clear();
    if (!pf.kvpress_python.empty() && !kdn::model::IsGgufPath(c.model_dir)) {
      std::fprintf(stderr, "kdn-bench prune-fidelity: --kvpress-python needs --model FILE.gguf\n");
      return 2;
    }
    return RunPruneFidelity(c, pf);
  }
  if (kv_edit->parsed()) {
    return RunKvEdit(c, ke);
  }
  if (quality->parsed()) {
    if (quality_random == std::vector<double>{0.0}) quality_random.clear();
    if (quality_full_only) quality_ratios.clear(), quality_random.clear();
    return RunQuality(c, eval_path, quality_limit, quality_max_tokens, quality_ratios,
                      quality_random, quality_check, quality_codec, quality_layers,
                      quality_selections);
  }
  if (kv_codec->parsed()) {
    if (kc.ttft_levels == std::vector<std::string>{"none"}) kc.ttft_levels.clear();
    if (kc.text_dir.empty() && (c.model_dir.empty() || kdn::model::IsGgufPath(c.model_dir))) {
      std::fprintf(stderr,
                   "kdn-bench kv-codec: with a preset or a .gguf file, give --text "
                   "(e.g. models/kdn-qa)\n");
      return 2;
    }
    return RunKvCodec(c, kc);
  }
  if (cuda_ipc->parsed()) {
    c.preset = ipc_preset;
#if KDN_BENCH_CUDA
    return RunCudaIpc(c, ipc_tokens, ipc_paths);
#else
    std::fprintf(stderr,
                 "kdn-bench cuda-ipc: this build has no CUDA (configure with KDN_CUDA=ON where "
                 "nvcc is)\n");
    return 1;
#endif
  }
  if (llama_cpp) {
    if (c.device != "cpu") {
      std::fprintf(stderr, "kdn-bench: --llama-cpp is the CPU peer: run it with --device cpu\n");
      return 2;
    }
    c.llama_bench = llama_bench;
  }
  if (c.device == "cuda") {
#if KDN_BENCH_CUDA
    if (prefill->parsed()) return RunCudaPrefill(c, lengths);
    if (decode->parsed()) return RunCudaDecode(c, batches, context, steps);
#else
    std::fprintf(stderr,
                 "kdn-bench: --device cuda: this build has no CUDA (configure with "
                 "KDN_CUDA=ON where nvcc is)\n");
    return 1;
#endif
  }
  if (prefill->parsed()) return RunPrefill(c, lengths);
  if (slow_tier->parsed()) return RunSlowTier(c, slow_prompts, slow_tokens, slow_delay_ms);
  if (pd->parsed()) {
    return RunPdTransfer(c, pdo);
  }
  if (store->parsed() && !store_backends.empty()) {
    return RunSharedTiers(c, store_backends, bench_store_url, bench_redis_url, shared_chunk_mib,
                          shared_clients, shared_chunks);
  }
  if (store->parsed()) return RunStore(c, store_tokens, chunk_tokens, store_dtype, disk_dir);
  return RunDecode(c, batches, context, steps);
}
