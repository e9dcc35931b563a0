#pragma once
// llama.cpp's llama-bench as kdn-bench's CPU peer, run in the same process
// run as kdn's own measurement (prefill and decode --llama-cpp): the binary
// bench/llama_cpp_peer.sh builds, on the same GGUF file with the same
// threads, its JSON records read back.

#include <string>
#include <vector>

#include "kdn/common/status.h"

namespace kdn::bench {

// Where bench/llama_cpp_peer.sh installs llama-bench:
// $KDN_LLAMA_CPP_BENCH/bin/llama-bench, else
// ~/.cache/kdn/llama-cpp-bench-0.3.36/bin/llama-bench.
std::string DefaultLlamaBench();

struct LlamaBenchRow {
  int n_prompt = 0;  // pp<n_prompt> when n_gen is 0
  int n_gen = 0;     // tg<n_gen> when n_prompt is 0
  int n_depth = 0;   // tokens of context before the test
  double tokens_per_s = 0;
  double stddev = 0;
};

// Runs `llama_bench -m model -t threads -r reps -o json ARGS` and returns
// its records. FailedPrecondition when the binary is missing (naming the
// script that builds it); Internal when it fails or prints no JSON.
Result<std::vector<LlamaBenchRow>> RunLlamaBench(const std::string& llama_bench,
                                                 const std::string& model, int threads, int reps,
                                                 const std::vector<std::string>& args);

}  // namespace kdn::bench
