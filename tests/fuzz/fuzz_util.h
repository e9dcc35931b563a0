#pragma once
// Helpers shared by the libFuzzer harnesses: a scratch folder for parsers
// that read files, a check that aborts (a failed check is a crash to
// libFuzzer, with the input saved), and the seed writer.
//
// Seeds: a harness whose seed corpus is made rather than written by hand
// (binary formats) writes it when run with KDN_FUZZ_WRITE_SEEDS=DIR, then
// exits; see WriteSeedsIfAsked.

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace kdn::fuzz {

// Aborts with `what` when `ok` is false.
inline void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz check failed: %s\n", what);
    std::abort();
  }
}

// A folder of this process's own, /tmp/kdn-fuzz-<pid>. libFuzzer ends a
// run with _Exit, past atexit, so each process removes the folders of
// processes that are gone before making its own.
inline const std::filesystem::path& ScratchDir() {
  static const std::filesystem::path dir = [] {
    const auto tmp = std::filesystem::temp_directory_path();
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(tmp, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("kdn-fuzz-", 0) != 0) continue;
      char* end = nullptr;
      const long pid = std::strtol(name.c_str() + 9, &end, 10);
      if (pid > 0 && *end == '\0' && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
        std::filesystem::remove_all(e.path(), ec);
      }
    }
    const auto mine = tmp / ("kdn-fuzz-" + std::to_string(::getpid()));
    std::filesystem::remove_all(mine, ec);
    std::filesystem::create_directories(mine);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(ScratchDir(), ec);
    });
    return mine;
  }();
  return dir;
}

inline void WriteFile(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  Check(out.good(), "writing a scratch file");
}

inline std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// With KDN_FUZZ_WRITE_SEEDS=DIR set, writes each of `seeds` to DIR/seed-<i>
// and exits: how a harness's made corpus is (re)generated.
inline void WriteSeedsIfAsked(const std::vector<std::string>& seeds) {
  const char* dir = std::getenv("KDN_FUZZ_WRITE_SEEDS");
  if (dir == nullptr) return;
  std::filesystem::create_directories(dir);
  for (size_t i = 0; i < seeds.size(); ++i) {
    WriteFile(std::filesystem::path(dir) / ("seed-" + std::to_string(i)), seeds[i]);
  }
  std::fprintf(stderr, "wrote %zu seeds to %s\n", seeds.size(), dir);
  std::exit(0);
}

}  // namespace kdn::fuzz
