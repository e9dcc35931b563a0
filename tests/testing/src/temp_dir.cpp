#include "kdn/testing/temp_dir.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <system_error>

namespace kdn::testing {

TempDir::TempDir() {
  static std::atomic<int> counter{0};
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string test = info == nullptr
                               ? std::string("no_test")
                               : std::string(info->test_suite_name()) + "_" + info->name();
  std::string name =
      "kdn_test_" + test + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
  // Parameterized tests' names carry '/'.
  for (char& c : name) {
    if (c == '/') c = '_';
  }
  path_ = std::filesystem::temp_directory_path() / name;
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace kdn::testing
