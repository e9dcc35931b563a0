#include "llama_cpp_peer.h"

#include <omp.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <nlohmann/json.hpp>

namespace kdn::bench {

namespace {

// A shell word: the argument in single quotes.
std::string Quote(const std::string& s) {
  std::string q = "'";
  for (char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

}  // namespace

std::string DefaultLlamaBench() {
  if (const char* p = std::getenv("KDN_LLAMA_CPP_BENCH"))
    return std::string(p) + "/bin/llama-bench";
  const char* home = std::getenv("HOME");
  return std::string(home ? home : "") + "/.cache/kdn/llama-cpp-bench-0.3.36/bin/llama-bench";
}

Result<std::vector<LlamaBenchRow>> RunLlamaBench(const std::string& llama_bench,
                                                 const std::string& model, int threads, int reps,
                                                 const std::vector<std::string>& args) {
  if (::access(llama_bench.c_str(), X_OK) != 0) {
    return FailedPrecondition(llama_bench +
                              " is not there: build it with bench/llama_cpp_peer.sh --build-only "
                              "(or name one with --llama-bench)");
  }
  if (threads <= 0) threads = omp_get_max_threads();
  std::string cmd = Quote(llama_bench) + " -m " + Quote(model) + " -t " + std::to_string(threads) +
                    " -r " + std::to_string(std::max(reps, 1)) + " -o json";
  for (const std::string& a : args) cmd += " " + Quote(a);
  std::fprintf(stderr, "kdn-bench: peer: %s\n", cmd.c_str());
  cmd += " 2>/dev/null";
  FILE* f = ::popen(cmd.c_str(), "r");
  if (f == nullptr) return Internal("cannot run " + llama_bench);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) out.append(buf, n);
  const int rc = ::pclose(f);
  if (rc != 0) return Internal(llama_bench + " failed (status " + std::to_string(rc) + ")");
  auto j = nlohmann::json::parse(out, nullptr, false);
  if (j.is_discarded() || !j.is_array()) return Internal(llama_bench + " printed no JSON array");
  std::vector<LlamaBenchRow> rows;
  for (const auto& r : j) {
    LlamaBenchRow row;
    row.n_prompt = r.value("n_prompt", 0);
    row.n_gen = r.value("n_gen", 0);
    row.n_depth = r.value("n_depth", 0);
    row.tokens_per_s = r.value("avg_ts", 0.0);
    row.stddev = r.value("stddev_ts", 0.0);
    rows.push_back(row);
  }
  return rows;
}

}  // namespace kdn::bench
