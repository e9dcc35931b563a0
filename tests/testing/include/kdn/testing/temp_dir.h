#pragma once
// A fresh folder for one test, named after it and removed with the object.

#include <filesystem>

namespace kdn::testing {

class TempDir {
 public:
  // Under the system's temporary folder: kdn_test_<suite>_<test>_<pid>_<n>.
  // Call it inside a test (it names the folder after the running one).
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace kdn::testing
