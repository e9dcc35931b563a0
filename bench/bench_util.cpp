#include "bench_util.h"

#include <cblas.h>
#include <fcntl.h>
#include <unistd.h>
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <thread>

#include "kdn/engine/cpu_runtime.h"
#include "kdn/engine/open_engine.h"
#include "kdn/kvbridge/paged_chunks.h"
#include "kdn/engine/presets.h"
#include "kdn/engine/sampler.h"

namespace kdn::bench {

using namespace kdn::engine;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double SgemmPeakGflops(int n, int reps) {
  std::vector<float> a(static_cast<size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  double best = 0.0;
  for (int r = 0; r < reps + 1; ++r) {
    auto t0 = Clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    const double s = Seconds(t0, Clock::now());
    if (r > 0) best = std::max(best, 2.0 * n * n * n / s / 1e9);  // first run warms up
  }
  return best;
}

double MemcpyGBps(size_t bytes, int reps) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 0.0;
  for (int r = 0; r < reps + 1; ++r) {
    auto t0 = Clock::now();
#pragma omp parallel
    {
      const size_t nt = omp_get_num_threads(), t = omp_get_thread_num();
      const size_t per = bytes / nt, lo = t * per, hi = t + 1 == nt ? bytes : lo + per;
      std::memcpy(dst.data() + lo, src.data() + lo, hi - lo);
    }
    const double s = Seconds(t0, Clock::now());
    if (r > 0) best = std::max(best, 2.0 * bytes / s / 1e9);
  }
  return best;
}

double RssMib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  }
  return 0;
}

Result<std::unique_ptr<engine::Engine>> MakeModel(const Common& c, int64_t kv_tokens,
                                                  std::string* what) {
  KDN_ASSIGN_OR_RETURN(const engine::Device device, engine::ParseDevice(c.device));
  engine::OpenOptions opts{.device = device, .kv_tokens = kv_tokens, .threads = c.threads};
  KDN_ASSIGN_OR_RETURN(opts.weights_dtype, engine::ParseWeightsDType(c.weights_dtype));
  std::unique_ptr<engine::Engine> e;
  if (!c.model_dir.empty()) {
    *what = c.model_dir + " on " + device.ToString() +
            (device.cuda() ? "" : " (weights " + c.weights_dtype + ")");
    KDN_ASSIGN_OR_RETURN(e, engine::OpenEngine(c.model_dir, opts));
  } else {
    KDN_ASSIGN_OR_RETURN(Preset p, FindPreset(c.preset));
    *what = "preset " + p.name + " (seed " + std::to_string(c.seed) + ") on " + device.ToString();
    KDN_ASSIGN_OR_RETURN(e, engine::MaterializeEngine(p.config, c.seed, opts, p.dtype));
  }
  kvbridge::PinChunkBuffersFor(*e);  // as a worker does
  return e;
}

json Machine(const Common& c) {
  return {{"backend", c.device},
          {"threads", c.threads > 0 ? c.threads : omp_get_max_threads()},
          {"hardware_threads", std::thread::hardware_concurrency()},
          {"blas", openblas_get_config()},
          {"blas_core", BlasCoreName()}};
}

void Emit(const Common& c, const json& j) {
  if (c.json_path.empty()) return;
  std::ofstream out(c.json_path);
  out << j.dump(2) << "\n";
  std::printf("wrote %s\n", c.json_path.c_str());
}

double MemcpyOneThreadGBps(size_t bytes, int reps) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 0.0;
  for (int r = 0; r < reps + 1; ++r) {
    auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    const double s = Seconds(t0, Clock::now());
    if (r > 0) best = std::max(best, bytes / s / 1e9);
  }
  return best;
}

kdn::DType ParseDType(const std::string& s) {
  if (s == "bf16") return kdn::DType::kBF16;
  if (s == "f16") return kdn::DType::kF16;
  return kdn::DType::kF32;
}

void DropFromPageCache(const std::filesystem::path& dir) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

double Mean(const std::vector<double>& x) {
  return x.empty() ? 0 : std::accumulate(x.begin(), x.end(), 0.0) / static_cast<double>(x.size());
}

Interval Bootstrap(const std::vector<double>& x, int resamples, uint64_t seed) {
  Interval iv{Mean(x), Mean(x), Mean(x)};
  if (x.size() < 2 || resamples <= 0) return iv;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, x.size() - 1);
  std::vector<double> means(resamples);
  for (double& m : means) {
    double s = 0;
    for (size_t i = 0; i < x.size(); ++i) s += x[pick(rng)];
    m = s / static_cast<double>(x.size());
  }
  std::sort(means.begin(), means.end());
  iv.lo = means[static_cast<size_t>(0.025 * (resamples - 1))];
  iv.hi = means[static_cast<size_t>(0.975 * (resamples - 1))];
  return iv;
}

}  // namespace kdn::bench
